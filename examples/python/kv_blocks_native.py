#!/usr/bin/python3
"""Two processes move KV-cache blocks the way a vLLM KV connector does, on ferry's native API.

The prefill process registers one K and one V array per layer, shaped
[num_blocks, block_size, kv_heads, head_dim] as vLLM lays them out, fills some blocks and
prints its agent address and region ids. The decode process registers its own arrays,
connects, reads the prefill blocks into its own (different) block ids, one descriptor per
layer and block, then notifies the owner that it may free them.

    PYTHONPATH=build/release/python /usr/bin/python3 examples/python/kv_blocks_native.py

(one command: it starts the prefill side itself, as a child process).
"""

import json
import subprocess
import sys

import numpy as np

import ferry

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 4, 64, 16, 2, 64
BLOCK_BYTES = BLOCK * HEADS * DIM * 2  # float16


def caches():
    return [np.zeros((BLOCKS, BLOCK, HEADS, DIM), dtype=np.float16) for _ in range(2 * LAYERS)]


def prefill():
    a = ferry.Agent("prefill-0")
    kv = caches()
    regions = [a.register_memory(t) for t in kv]
    blocks = [3, 4, 9]  # where this request's KV sits here
    for i, t in enumerate(kv):
        for b in blocks:
            t[b] = (i * 100 + b) % 2048  # a value per tensor and block
    print(json.dumps({"address": a.listen_address, "regions": [r.id for r in regions],
                      "blocks": blocks}), flush=True)
    # Wait for the decoder's "done", then exit (a real worker frees the blocks then).
    while True:
        for peer, payload in a.wait_notifications(1.0):
            print(f"prefill: {peer} says {payload.decode()}", file=sys.stderr)
            return


def decode():
    child = subprocess.Popen([sys.executable, __file__, "prefill"], stdout=subprocess.PIPE,
                             text=True)
    info = json.loads(child.stdout.readline())
    a = ferry.Agent("decode-0")
    kv = caches()
    regions = [a.register_memory(t) for t in kv]
    peer = a.connect(info["address"])
    mine = [10, 11, 12]  # the blocks the decoder allocated for this request
    local, remote = [], []
    for i in range(2 * LAYERS):
        for src, dst in zip(info["blocks"], mine):
            local.append(ferry.Descriptor(regions[i], dst * BLOCK_BYTES, BLOCK_BYTES))
            remote.append(ferry.Descriptor(info["regions"][i], src * BLOCK_BYTES, BLOCK_BYTES))
    t = a.read(local, peer, remote)
    t.wait(30)
    for i, t_ in enumerate(kv):
        for src, dst in zip(info["blocks"], mine):
            assert (t_[dst] == (i * 100 + src) % 2048).all(), (i, src, dst)
    a.notify(peer, b"req-0 read, free its blocks")
    assert child.wait(30) == 0
    print(f"decode: read {len(local)} blocks ({t.bytes} bytes) from {peer}, all correct")


if __name__ == "__main__":
    prefill() if sys.argv[1:] == ["prefill"] else decode()

#!/usr/bin/python3
"""The KV block transfer of kv_blocks_native.py, written against NIXL's Python API, as a vLLM
NixlConnector does it; it runs on ferry through the compatibility layer.

    PYTHONPATH=build/release/python:build/release/python/compat \\
        /usr/bin/python3 examples/python/kv_blocks_nixl.py

The prefill side (a child process) registers per-layer caches, sends its agent metadata and the
base addresses of its caches over a pipe (vLLM uses ZMQ), and frees the blocks when the decoder's
notification arrives. The decoder prepares its local and the remote block lists and reads remote
blocks into its own block ids by index.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

LAYERS, BLOCKS, BLOCK_BYTES = 4, 64, 16 * 2 * 64 * 2


def caches():
    return [np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(2 * LAYERS)]


def block_descs(bases):
    return [(base + b * BLOCK_BYTES, BLOCK_BYTES, 0) for base in bases for b in range(BLOCKS)]


def prefill():
    agent = nixl_agent("prefill-0", nixl_agent_config(backends=["UCX"]))
    kv = caches()
    agent.register_memory(agent.get_reg_descs(
        [(t.ctypes.data, t.nbytes, 0, "") for t in kv], "DRAM"))
    blocks = [3, 4, 9]
    for i, t in enumerate(kv):
        for b in blocks:
            t[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES] = (i * 16 + b) % 256
    print(json.dumps({"metadata": agent.get_agent_metadata().hex(),
                      "bases": [t.ctypes.data for t in kv], "blocks": blocks}), flush=True)
    decoder = agent.add_remote_agent(bytes.fromhex(sys.stdin.readline().strip()))
    while not agent.check_remote_xfer_done(decoder, b"req-0"):
        time.sleep(0.001)
    print("prefill: blocks of req-0 freed", file=sys.stderr)


def decode():
    # NIXL's logging writes INFO to stdout, which the child answers on: WARN keeps it quiet.
    child = subprocess.Popen([sys.executable, __file__, "prefill"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    info = json.loads(child.stdout.readline())
    agent = nixl_agent("decode-0", None)
    kv = caches()
    agent.register_memory(agent.get_reg_descs(
        [(t.ctypes.data, t.nbytes, 0, "") for t in kv], "DRAM"))
    remote = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
    child.stdin.write(agent.get_agent_metadata().hex() + "\n")
    child.stdin.flush()
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs([t.ctypes.data for t in kv]),
                                    "DRAM")
    remote_h = agent.prep_xfer_dlist(remote, block_descs(info["bases"]), "DRAM")
    mine = [10, 11, 12]
    local_ids = [t * BLOCKS + b for t in range(2 * LAYERS) for b in mine]
    remote_ids = [t * BLOCKS + b for t in range(2 * LAYERS) for b in info["blocks"]]
    handle = agent.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids,
                                     notif_msg=b"req-0")
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    assert state == "DONE", state
    for i, t in enumerate(kv):
        for src, dst in zip(info["blocks"], mine):
            assert (t[dst * BLOCK_BYTES:(dst + 1) * BLOCK_BYTES] == (i * 16 + src) % 256).all()
    agent.release_xfer_handle(handle)
    assert child.wait(30) == 0
    print(f"decode: read {len(local_ids)} blocks from {remote} through NIXL's API, all correct")


if __name__ == "__main__":
    prefill() if sys.argv[1:] == ["prefill"] else decode()

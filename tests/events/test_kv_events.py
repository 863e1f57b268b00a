"""KV events of a `ferry serve` worker, read the way vLLM's own subscriber reads vLLM's: a ZeroMQ
SUB socket (multipart: topic, 8-byte big-endian sequence number, msgpack payload) and the replay
ROUTER socket, decoded with Debian's python3-msgpack field by field as vllm/distributed/kv_events.py
defines the structs, and every block hash recomputed with python3-cbor2 as vLLM's sha256_cbor
computes it (kv_cache_utils.py: hash_block_tokens from NONE_HASH = sha256_cbor(PYTHONHASHSEED)).

Run by ctest (kv_events_subscriber_test) with FERRY_BIN set; Debian's /usr/bin/python3.
"""

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.request

import cbor2
import msgpack
import pytest
import zmq

FERRY = os.environ["FERRY_BIN"]
BLOCK = 16


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def chain(parent, tokens, seed="0"):
    """vLLM's hashes of the full blocks of `tokens` after `parent` (None: the prompt's start)."""
    h = sha256_cbor(seed) if parent is None else parent
    out = []
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        h = sha256_cbor((h, tuple(tokens[i:i + BLOCK]), None))
        out.append(h)
    return out


class Worker:
    def __init__(self, model, *extra):
        self.proc = subprocess.Popen(
            [FERRY, "serve", "--model", model, "--port", "0", "--block-size", str(BLOCK),
             "--num-kv-blocks", "24", "--max-model-len", "256",
             "--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0",
             *extra],
            stdout=subprocess.PIPE, text=True)
        self.events = self.replay = None
        for line in self.proc.stdout:
            m = re.search(r"kv events at tcp://[^:]+:(\d+), replay at tcp://[^:]+:(\d+)", line)
            if m:
                self.events = f"tcp://127.0.0.1:{m.group(1)}"
                self.replay = f"tcp://127.0.0.1:{m.group(2)}"
            m = re.search(r"listening on http://[^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        assert self.events and self.replay, "the worker did not print its kv events endpoints"

    def complete(self, prompt, max_tokens=4):
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200

    def close(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def model():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tiny.gguf")
        subprocess.run([FERRY, "model", "init", "--preset", "tiny", "--out", path], check=True,
                       stdout=subprocess.DEVNULL)
        yield path


def replay(ctx, endpoint, start, raw=b""):
    """Every buffered batch from `start` on, as (seq, payload), through a DEALER socket (a REQ
    socket, as vLLM's example uses, takes only the first reply)."""
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send_multipart([b"", raw or start.to_bytes(8, "big")])
    out = []
    while True:
        assert s.poll(10000), "no end-of-replay marker"
        empty, seq, payload = s.recv_multipart()
        assert empty == b""
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            assert payload == b""
            break
        out.append((seq, payload))
    s.close()
    return out


def test_events_decode_as_vllms_structs_and_hashes_recompute(model):
    w = Worker(model)
    ctx = zmq.Context()
    try:
        prompts = [list(range(1, 41)), list(range(1, 33)) + [200, 201, 202], list(range(100, 160))]
        # Then more than the cache's 24 blocks hold: the oldest cached blocks are evicted.
        prompts += [list(range(k, k + 60)) for k in range(2, 190, 17)]
        # Before anyone subscribed: these batches are found again through the replay socket.
        w.complete(prompts[0])
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.events)
        time.sleep(0.3)  # ZeroMQ's slow joiner
        for p in prompts[1:]:
            w.complete(p)
        live = []
        deadline = time.time() + 20
        while time.time() < deadline and len(live) < 2:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b""
                live.append((int.from_bytes(seq, "big"), payload))
        assert live, "no live batch"
        # The last completion's events are published after its answer: read on until the stream
        # has been quiet for a second, so the replays below see every batch (two replays taken
        # while a batch was still on its way differed by it in a CI run).
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            live.append((int.from_bytes(seq, "big"), payload))
        batches = replay(ctx, w.replay, 0)
        seqs = [s for s, _ in batches]
        assert seqs == list(range(len(seqs))), "batches are numbered 0, 1, 2, ... without a gap"
        for s, payload in live:
            assert (s, payload) in batches, "a live batch is replayed byte for byte"
        assert [s for s, _ in replay(ctx, w.replay, 2)] == seqs[2:]

        stored, removed = {}, set()
        for _, payload in batches:
            batch = msgpack.unpackb(payload, raw=False)
            # EventBatch(ts, events, data_parallel_rank): a map, as msgspec encodes the struct.
            assert list(batch) == ["ts", "events", "data_parallel_rank"]
            assert isinstance(batch["ts"], float) and abs(batch["ts"] - time.time()) < 600
            assert batch["data_parallel_rank"] == 0
            for ev in batch["events"]:
                kind = ev["type"]
                if kind == "BlockStored":
                    assert list(ev) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                                        "block_size", "lora_id", "medium", "lora_name",
                                        "group_idx"]
                    assert ev["block_size"] == BLOCK and ev["medium"] == "GPU"
                    assert ev["lora_id"] is None and ev["lora_name"] is None
                    assert ev["group_idx"] == 0
                    assert len(ev["token_ids"]) == BLOCK * len(ev["block_hashes"])
                    assert all(isinstance(h, bytes) and len(h) == 32 for h in ev["block_hashes"])
                    # Anyone recomputes them from the tokens, the parent and the seed.
                    assert ev["block_hashes"] == chain(ev["parent_block_hash"], ev["token_ids"])
                    for h in ev["block_hashes"]:
                        stored[h] = ev
                elif kind == "BlockRemoved":
                    assert list(ev) == ["type", "block_hashes", "medium", "group_idx"]
                    for h in ev["block_hashes"]:
                        assert h in stored, "only a stored block is removed"
                        removed.add(h)
                else:
                    assert kind == "AllBlocksCleared" and list(ev) == ["type"]
        # Each prompt's full blocks were stored under the hashes a router computes from it.
        for p in prompts:
            for h in chain(None, p):
                assert h in stored, f"prompt of {len(p)} tokens: block not announced"
        # The second prompt shares the first's two leading blocks: stored once, not again.
        shared = chain(None, prompts[0])[:2]
        assert sum(1 for _, p in batches for ev in msgpack.unpackb(p, raw=False)["events"]
                   if ev["type"] == "BlockStored" and shared[0] in ev["block_hashes"]) == 1
        # 24 blocks in all: the third prompt evicted cached blocks, announced as removed.
        assert removed, "a full cache evicts, and says so"
        # A malformed replay request: answered with the end marker alone; the worker goes on.
        assert replay(ctx, w.replay, 0, raw=b"short") == []
        w.complete(prompts[0])
    finally:
        ctx.destroy(linger=0)
        w.close()


def test_legacy_layout_is_vllms_example_subscribers(model):
    w = Worker(model, "--kv-events-layout", "legacy", "--prefix-hash-seed", "1234")
    ctx = zmq.Context()
    try:
        prompt = list(range(7, 7 + 3 * BLOCK))
        w.complete(prompt, max_tokens=1)
        deadline = time.time() + 20
        batches = []
        while time.time() < deadline and not batches:
            batches = replay(ctx, w.replay, 0)
            time.sleep(0.05)
        events = [ev for _, p in batches for ev in msgpack.unpackb(p, raw=False)[1]]
        first = msgpack.unpackb(batches[0][1], raw=False)
        assert isinstance(first, list) and len(first) == 2, "array_like EventBatch: [ts, events]"
        stored = [ev for ev in events if ev[0] == "BlockStored"]
        assert stored
        ev = stored[0]
        # ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
        assert len(ev) == 7 and ev[4] == BLOCK and ev[5] is None and ev[6] == "GPU"
        assert ev[2] is None and ev[3][:3 * BLOCK] == prompt
        want = [int.from_bytes(h[-8:], "big") for h in chain(None, prompt, seed="1234")]
        assert ev[1][:3] == want, "64-bit integer hashes from the seed given"
    finally:
        ctx.destroy(linger=0)
        w.close()


def test_replays_beyond_the_budget_get_no_answer(model):
    """A client asking for the whole buffer again and again: the worker serves
    --kv-events-replays-per-second of them (a token bucket) and leaves the rest unanswered, and
    its live events keep flowing."""
    w = Worker(model, "--kv-events-replays-per-second", "2")
    ctx = zmq.Context()
    try:
        w.complete(list(range(1, 41)))
        s = ctx.socket(zmq.DEALER)
        s.connect(w.replay)
        for _ in range(12):
            s.send_multipart([b"", (0).to_bytes(8, "big")])
        answered = 0
        deadline = time.time() + 1.0
        while time.time() < deadline:
            if s.poll(100):
                _, seq, _ = s.recv_multipart()
                answered += int.from_bytes(seq, "big", signed=True) == -1
        s.close()
        # 2 at once, then one more each half second; the rest refused.
        assert 2 <= answered <= 5, answered
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{w.port}/metrics").read().decode()
        refused = float(re.search(r"^ferry_kv_events_replays_refused_total (\S+)$", metrics,
                                  re.M).group(1))
        assert refused >= 12 - answered - 1, metrics
        time.sleep(0.6)  # the bucket refills: an honest subscriber is answered again
        assert replay(ctx, w.replay, 0), "no replay after the budget refilled"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.events)
        time.sleep(0.3)
        w.complete(list(range(50, 90)))
        assert sub.poll(5000), "live events stopped"
        sub.close()
    finally:
        ctx.destroy(linger=0)
        w.close()


@pytest.mark.parametrize("flags,named", [
    (["--kv-events-endpoint", "tcp://127.0.0.1:0"], "--kv-events-endpoint 'tcp://127.0.0.1:0'"),
    (["--kv-events-endpoint", "bogus://x"], "--kv-events-endpoint 'bogus://x'"),
    (["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://no-such:1"],
     "--kv-events-replay-endpoint 'tcp://no-such:1'"),
    (["--kv-events-endpoint", "tcp://*:0", "--kv-events-layout", "msgspec"], "msgspec"),
])
def test_a_bad_events_flag_stops_the_worker_with_its_name(model, flags, named):
    r = subprocess.run([FERRY, "serve", "--model", model, "--port", "0", *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert named in r.stderr, r.stderr


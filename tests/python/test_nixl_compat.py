"""NIXL's Python API on ferry (python/compat/nixl), used the way its callers use it: NIXL's own
examples/python flow (get_reg_descs, register_memory, metadata exchange, initialize_xfer,
transfer, check_xfer_state, check_remote_xfer_done) and vLLM's NixlConnector flow
(prep_xfer_dlist for local and remote blocks, make_prepped_xfer by block ids, notifications,
release_*), with numpy arrays and (addr, len, dev) lists; then the errors a NIXL caller expects.
"""

import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from nixl._api import (nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle,
                       nixl_xfer_handle)
import nixl._bindings as nixlBind

N = 1 << 16


def uniq(name):
    return f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def wait_done(agent, handle, limit=10):
    deadline = time.time() + limit
    state = agent.check_xfer_state(handle)
    while state == "PROC" and time.time() < deadline:
        state = agent.check_xfer_state(handle)
    return state


@pytest.fixture
def agents():
    target = nixl_agent(uniq("target"), nixl_agent_config(backends=["UCX"]))
    initiator = nixl_agent(uniq("initiator"), None)
    yield target, initiator


def test_nixl_example_flow(agents):
    target, initiator = agents
    assert "UCX" in target.get_plugin_list()
    assert target.get_plugin_mem_types("UCX") == ["DRAM"]
    t_buf = np.arange(N, dtype=np.uint8)
    i_buf = np.zeros(N, dtype=np.uint8)
    t_reg = target.get_reg_descs([(t_buf.ctypes.data, N, 0, "")], "DRAM")
    assert target.register_memory(t_reg) is not None
    i_reg = initiator.register_memory(i_buf)  # an array alone, as NIXL takes a tensor
    assert len(i_reg) == 1

    name = initiator.add_remote_agent(target.get_agent_metadata())
    assert name == target.name
    assert initiator.check_remote_metadata(name)
    target_descs = t_reg.trim()
    init_descs = initiator.get_xfer_descs([(i_buf.ctypes.data, N, 0)], "DRAM")
    # Descriptor lists serialize, as NIXL's example sends them to the peer.
    target_descs = initiator.deserialize_descs(target.get_serialized_descs(target_descs))

    handle = initiator.initialize_xfer("READ", init_descs, target_descs, name, b"UUID1")
    state = initiator.transfer(handle)
    assert state in ("PROC", "DONE")
    assert wait_done(initiator, handle) == "DONE"
    assert (i_buf == t_buf).all()
    # The target learns of it through the notification.
    deadline = time.time() + 10
    while not target.check_remote_xfer_done(initiator.name, b"UUID") and time.time() < deadline:
        time.sleep(0.001)
    assert time.time() < deadline
    # A handle posts again (NIXL reuses prepared transfers), here as a WRITE of new bytes.
    i_buf[:] = 7
    w = initiator.initialize_xfer("WRITE", init_descs, target_descs, name)
    initiator.transfer(w)
    assert wait_done(initiator, w) == "DONE" and (t_buf == 7).all()
    initiator.release_xfer_handle(handle)
    initiator.release_xfer_handle(w)
    initiator.remove_remote_agent(name)
    assert not initiator.check_remote_metadata(name)
    initiator.deregister_memory(i_reg)
    target.deregister_memory(t_reg)


def test_vllm_nixl_connector_flow(agents):
    """Per-layer KV caches, blocks by id, a READ of remote blocks into other local ids."""
    prefill, decode = agents
    layers, blocks, block_bytes = 3, 8, 512
    p_caches = [np.zeros(blocks * block_bytes, dtype=np.uint8) for _ in range(layers)]
    d_caches = [np.zeros(blocks * block_bytes, dtype=np.uint8) for _ in range(layers)]
    for l, c in enumerate(p_caches):
        for b in range(blocks):
            c[b * block_bytes:(b + 1) * block_bytes] = l * 16 + b
    for agent, caches in ((prefill, p_caches), (decode, d_caches)):
        descs = agent.get_reg_descs([(c.ctypes.data, c.nbytes, 0, "") for c in caches], "DRAM")
        agent.register_memory(descs)

    def block_list(caches):
        return [(c.ctypes.data + b * block_bytes, block_bytes, 0)
                for c in caches for b in range(blocks)]

    # The decoder prepares its own blocks and, from the prefill side's metadata, the remote ones.
    remote = decode.add_remote_agent(prefill.get_agent_metadata())
    local_h = decode.prep_xfer_dlist("NIXL_INIT_AGENT", block_list(d_caches), "DRAM")
    remote_h = decode.prep_xfer_dlist(remote, block_list(p_caches), "DRAM")
    src_blocks, dst_blocks = [2, 3, 5], [0, 6, 7]
    local_ids = [l * blocks + b for l in range(layers) for b in dst_blocks]
    remote_ids = [l * blocks + b for l in range(layers) for b in src_blocks]
    x = decode.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids,
                                 notif_msg=b"req-42")
    decode.transfer(x)
    assert wait_done(decode, x) == "DONE"
    for l, c in enumerate(d_caches):
        for s, d in zip(src_blocks, dst_blocks):
            assert (c[d * block_bytes:(d + 1) * block_bytes] == l * 16 + s).all(), (l, s, d)
    assert decode.query_xfer_backend(x) == "UCX"
    # The prefill worker frees the blocks on the notification (get_new_notifs, vLLM's path).
    deadline, notifs = time.time() + 10, {}
    while not notifs and time.time() < deadline:
        notifs = prefill.get_new_notifs()
    assert notifs == {decode.name: [b"req-42"]}
    decode.send_notif(remote, b"heartbeat")
    deadline = time.time() + 10
    while time.time() < deadline:
        if prefill.update_notifs().get(decode.name):
            break
    assert prefill.notifs[decode.name] == [b"heartbeat"]
    decode.release_xfer_handle(x)
    decode.release_dlist_handle(local_h)
    decode.release_dlist_handle(remote_h)
    decode.release_dlist_handle(local_h)  # again: nothing, as NIXL's handle.release()
    with pytest.raises(nixlBind.nixlInvalidParamError):
        decode.make_prepped_xfer("READ", local_h, [0], remote_h, [0])


def test_the_errors_a_nixl_caller_expects(agents):
    target, initiator = agents
    buf = np.zeros(N, dtype=np.uint8)
    reg = target.register_memory(target.get_reg_descs([(buf.ctypes.data, N, 0, "")], "DRAM"))
    mine = np.zeros(N, dtype=np.uint8)
    initiator.register_memory(mine)
    name = initiator.add_remote_agent(target.get_agent_metadata())
    local = initiator.get_xfer_descs([(mine.ctypes.data, 64, 0)], "DRAM")
    # A remote address outside everything the target registered: refused, never sent.
    with pytest.raises(nixlBind.nixlNotFoundError, match="not inside"):
        initiator.initialize_xfer(
            "READ", local, initiator.get_xfer_descs([(buf.ctypes.data + N, 64, 0)], "DRAM"), name)
    assert not initiator.check_remote_metadata(
        name, initiator.get_xfer_descs([(buf.ctypes.data + N - 8, 64, 0)], "DRAM"))
    with pytest.raises(nixlBind.nixlNotFoundError, match="inside registered"):
        initiator.prep_xfer_dlist("NIXL_INIT_AGENT", [(12345, 8, 0)], "DRAM")
    with pytest.raises(nixlBind.nixlNotFoundError, match="no metadata"):
        initiator.prep_xfer_dlist("nobody", [(buf.ctypes.data, 8, 0)], "DRAM")
    with pytest.raises(nixlBind.nixlInvalidParamError, match="lengths"):
        initiator.initialize_xfer(
            "READ", local, initiator.get_xfer_descs([(buf.ctypes.data, 32, 0)], "DRAM"), name)
    with pytest.raises(nixlBind.nixlInvalidParamError, match="op code"):
        initiator.initialize_xfer("COPY", local, local, name)
    with pytest.raises(nixlBind.nixlNotSupportedError, match="DRAM"):
        initiator.get_reg_descs([(1, 8, 0, "")], "VRAM")
    with pytest.raises(nixlBind.nixlInvalidParamError, match="malformed|not metadata"):
        initiator.add_remote_agent(b"garbage")
    with pytest.raises(nixlBind.nixlRemoteDisconnectError):
        initiator.fetch_remote_metadata("x", "127.0.0.1", 1)  # nobody listens there
    with pytest.raises(nixlBind.nixlNotPostedError):
        initiator.check_xfer_state(initiator.initialize_xfer(
            "READ", local, initiator.get_xfer_descs([(buf.ctypes.data, 64, 0)], "DRAM"), name))
    # The target deregisters; a transfer the initiator still holds now ends in "ERR".
    h = initiator.initialize_xfer(
        "READ", local, initiator.get_xfer_descs([(buf.ctypes.data, 64, 0)], "DRAM"), name)
    target.deregister_memory(reg)
    state = initiator.transfer(h)
    if state == "PROC":
        state = wait_done(initiator, h)
    assert state == "ERR"
    with pytest.raises(nixlBind.nixlNotFoundError):
        target.deregister_memory(reg)
    with pytest.raises(nixlBind.nixlNotFoundError):
        initiator.send_notif("nobody", b"x")


def test_descriptor_lists_behave_like_nixls():
    x = nixlBind.nixlXferDList(nixlBind.DRAM_SEG, [(300, 8, 0), (100, 8, 0)], True)
    assert x.isSorted() and x[0] == (100, 8, 0) and x.descCount() == 2 and len(x) == 2
    assert pickle.loads(pickle.dumps(x)) == x
    r = nixlBind.nixlRegDList(nixlBind.DRAM_SEG, [(100, 8, 0, "meta")])
    assert r.trim() == nixlBind.nixlXferDList(nixlBind.DRAM_SEG, [(100, 8, 0)])
    with pytest.raises(nixlBind.nixlInvalidParamError):
        nixlBind.nixlXferDList(nixlBind.DRAM_SEG, [(1, 2)])


TARGET = textwrap.dedent("""
    import sys, time
    import numpy as np
    from nixl._api import nixl_agent
    a = nixl_agent(sys.argv[1])
    buf = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    a.register_memory(a.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    sys.stdout.buffer.write(a.get_agent_metadata().hex().encode() + b" %d\\n" % buf.ctypes.data)
    sys.stdout.flush()
    line = sys.stdin.readline()  # the initiator's metadata, hex
    peer = a.add_remote_agent(bytes.fromhex(line.strip()))
    while not a.check_remote_xfer_done(peer, b"done"):
        time.sleep(0.001)
    print("freed", flush=True)
""")


def test_two_processes_as_vllm_runs_them():
    # NIXL logs INFO to stdout, which this child also answers on: WARN keeps stdout to answers.
    p = subprocess.Popen([sys.executable, "-c", TARGET, uniq("p-target")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=dict(os.environ, NIXL_LOG_LEVEL="WARN"))
    try:
        md_hex, addr = p.stdout.readline().split()
        a = nixl_agent(uniq("p-init"))
        mine = np.zeros(1 << 20, dtype=np.uint8)
        a.register_memory(mine)
        name = a.add_remote_agent(bytes.fromhex(md_hex.decode()))
        p.stdin.write(a.get_agent_metadata().hex().encode() + b"\n")
        p.stdin.flush()
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine.ctypes.data, 1 << 20, 0)], "DRAM")
        remote = a.prep_xfer_dlist(name, [(int(addr), 1 << 20, 0)], "DRAM")
        x = a.make_prepped_xfer("READ", local, [0], remote, [0], b"done")
        a.transfer(x)
        assert wait_done(a, x) == "DONE"
        assert (mine.view(np.uint32) == np.arange(1 << 18, dtype=np.uint32)).all()
        assert p.stdout.readline().strip() == b"freed"
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_the_nixl_kv_block_example_runs():
    here = os.path.dirname(os.path.abspath(__file__))
    example = os.path.join(here, "..", "..", "examples", "python", "kv_blocks_nixl.py")
    out = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all correct" in out.stdout


def test_torch_tensors_as_vllm_registers_them(agents):
    torch = pytest.importorskip("torch")
    target, initiator = agents
    t_cache = [torch.full((16, 64), float(i)) for i in range(3)]
    i_cache = [torch.zeros((16, 64)) for _ in range(3)]
    target.register_memory(t_cache)  # a list of tensors, as NIXL takes them
    initiator.register_memory(initiator.get_reg_descs(i_cache))
    name = initiator.add_remote_agent(target.get_agent_metadata())
    h = initiator.initialize_xfer("READ", initiator.get_xfer_descs(i_cache),
                                  initiator.get_xfer_descs(t_cache), name, b"t")
    initiator.transfer(h)
    assert wait_done(initiator, h) == "DONE"
    assert all(torch.equal(a, b) for a, b in zip(i_cache, t_cache))


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_listener_metadata_exchange_of_nixls_example():
    """NIXL's examples/python flow: the target listens; the initiator fetches its metadata and
    sends its own; both poll check_remote_metadata; invalidation removes it again."""
    port = free_port()
    target = nixl_agent(uniq("lt"), nixl_agent_config(enable_listen_thread=True,
                                                      listen_port=port))
    init_port = free_port()
    initiator = nixl_agent(uniq("li"), nixl_agent_config(enable_listen_thread=True,
                                                         listen_port=init_port))
    buf = np.arange(N, dtype=np.uint8)
    target.register_memory(target.get_reg_descs([(buf.ctypes.data, N, 0, "")], "DRAM"))
    initiator.fetch_remote_metadata(target.name, "127.0.0.1", port)
    initiator.send_local_metadata("127.0.0.1", port)
    deadline = time.time() + 10
    while not (initiator.check_remote_metadata(target.name)
               and target.check_remote_metadata(initiator.name)) and time.time() < deadline:
        time.sleep(0.001)
    assert target.check_remote_metadata(initiator.name)
    mine = np.zeros(N, dtype=np.uint8)
    initiator.register_memory(mine)
    h = initiator.initialize_xfer("READ", initiator.get_xfer_descs([(mine.ctypes.data, N, 0)],
                                                                   "DRAM"),
                                  initiator.get_xfer_descs([(buf.ctypes.data, N, 0)], "DRAM"),
                                  target.name)
    initiator.transfer(h)
    assert wait_done(initiator, h) == "DONE" and (mine == buf).all()
    # The metadata notifications never reach the caller.
    assert target.get_new_notifs() == {}
    with pytest.raises(nixlBind.nixlMismatchError):
        initiator.fetch_remote_metadata("someone-else", "127.0.0.1", port)
    with pytest.raises(nixlBind.nixlNotSupportedError, match="central"):
        initiator.fetch_remote_metadata(target.name)
    # Nobody listening there: nothing to invalidate, no error (NIXL sends it in the background).
    initiator.invalidate_local_metadata("127.0.0.1", free_port())
    initiator.invalidate_local_metadata("127.0.0.1", port)
    deadline = time.time() + 10
    while target.check_remote_metadata(initiator.name) and time.time() < deadline:
        time.sleep(0.001)
    assert not target.check_remote_metadata(initiator.name)


# NIXL's current examples/python/expanded_two_peers.py (which extends basic_two_peers.py), step
# for step: a listening target and an initiator, torch tensors (the CPU stand-in in standins/),
# row tensors as descriptors, prepared READs with reversed remote indices, a WRITE from tuples and
# one from an N x 3 uint64 NumPy array, READs reposted with new notifications, and the results
# printed through nixl.logging. scripts/run-nixl-examples runs NIXL's own files the same way.
EXPANDED_TWO_PEERS = textwrap.dedent("""
    import pickle, random, sys
    import numpy as np
    import torch
    from nixl._api import (nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle,
                       nixl_xfer_handle)
    from nixl.logging import get_logger

    logger = get_logger(__name__)
    mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_default_device("cpu")
    agent = nixl_agent(mode, nixl_agent_config(True, True, port if mode == "target" else 0,
                                               backends=["UCX"]))
    tensor = (torch.ones if mode == "target" else torch.zeros)((16, 32), dtype=torch.float32)
    reg_descs = agent.register_memory(tensor)
    assert reg_descs
    rows = [tensor[i, :] for i in range(tensor.shape[0])]
    row_bytes = int(tensor.shape[1] * tensor.element_size())
    if mode == "target":
        descs = agent.get_xfer_descs(rows)
        while not agent.check_remote_metadata("initiator"):
            pass
        agent.send_notif("initiator", pickle.dumps(
            (agent.get_serialized_descs(descs), (tensor.data_ptr(), row_bytes))))
        reads = {f"Read idx {s},{s + 4},{s + 8}{a}".encode() for s in range(4)
                 for a in ("", " again")}
        writes = 2
        while reads or writes:
            for msg in agent.get_new_notifs().get("initiator", []):
                if msg in reads:
                    reads.remove(msg)
                elif msg.startswith(b"Write"):
                    writes -= 1
        assert torch.any(tensor[12:, :] == 0.0)
        logger.info("Target data verification passed (zeros found in last 4 tensors)")
    else:
        agent.send_local_metadata(ip, port)
        agent.fetch_remote_metadata("target", ip, port)
        notifs = agent.get_new_notifs()
        while not notifs:
            notifs = agent.get_new_notifs()
        ser, (base, rb) = pickle.loads(notifs["target"][0])
        target_descs = agent.deserialize_descs(ser)
        while not agent.check_remote_metadata("target"):
            pass
        local_side = agent.prep_xfer_dlist("", agent.get_xfer_descs(rows))
        remote_side = agent.prep_xfer_dlist("target", target_descs)
        reads = [agent.make_prepped_xfer("READ", local_side, [s, s + 4, s + 8], remote_side,
                                         [s + 8, s + 4, s], f"Read idx {s},{s + 4},{s + 8}".encode())
                 for s in range(4)]
        random.seed(0)
        half = rb // 2
        offs = {r: random.choice((0, half)) for r in range(12, 16)}
        w0 = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(rows[r].data_ptr() + offs[r], half, 0) for r in (12, 13)],
                                 mem_type="cpu"),
            agent.get_xfer_descs([(base + r * rb + offs[r], half, 0) for r in (12, 13)],
                                 mem_type="cpu"), "target", b"Write 12,13")
        w1 = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(np.array([[rows[r].data_ptr() + offs[r], half, 0]
                                           for r in (14, 15)], dtype=np.uint64), mem_type="cpu"),
            agent.get_xfer_descs(np.array([[base + r * rb + offs[r], half, 0]
                                           for r in (14, 15)], dtype=np.uint64), mem_type="cpu"),
            "target", b"Write 14,15")
        def run(handles, notifs=None):
            for i, h in enumerate(handles):
                assert agent.transfer(h, *([notifs[i]] if notifs else [])) != "ERR"
            pending = list(handles)
            while pending:
                for h in list(pending):
                    st = agent.check_xfer_state(h)
                    assert st != "ERR"
                    if st == "DONE":
                        pending.remove(h)
        run(reads)
        run([w0, w1])
        run(reads, [f"Read idx {s},{s + 4},{s + 8} again".encode() for s in range(4)])
        check = torch.zeros_like(tensor)
        check[:12, :] = 1.0
        assert torch.allclose(tensor, check)
        logger.info("Initiator final data verification passed")
        agent.remove_remote_agent("target")
        for h in reads + [w0, w1]:
            agent.release_xfer_handle(h)
        agent.release_dlist_handle(local_side)
        agent.release_dlist_handle(remote_side)
        agent.invalidate_local_metadata(ip, port)
    agent.deregister_memory(reg_descs)
    logger.info("Test Complete.")
""")


def standins_env():
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "") + os.pathsep +
                os.path.join(here, "standins"))


def test_nixls_expanded_two_peers_example_flow():
    port = free_port()
    target = subprocess.Popen([sys.executable, "-c", EXPANDED_TWO_PEERS, "target", "127.0.0.1",
                               str(port)], stdout=subprocess.PIPE, text=True, env=standins_env())
    try:
        # NIXL's logging writes to stdout; the target's first line says the agent is up.
        assert "Initialized NIXL agent: target" in target.stdout.readline()
        init = subprocess.run([sys.executable, "-c", EXPANDED_TWO_PEERS, "initiator",
                               "127.0.0.1", str(port)], capture_output=True, text=True,
                              timeout=60, env=standins_env())
        assert init.returncode == 0, init.stderr
        assert "Initiator final data verification passed" in init.stdout, init.stdout
        assert target.wait(30) == 0
        out = target.stdout.read()
        assert "Target data verification passed" in out and "Test Complete." in out
    finally:
        if target.poll() is None:
            target.kill()


def test_nixl_logging_as_nixls():
    """NIXL's configuration: INFO and above to stdout in NIXL's format, the "nixl" hierarchy not
    propagating, NIXL_LOG_LEVEL's names (TRACE..FATAL), NIXL_DEBUG_LOGGING -> raiseExceptions."""
    from nixl.logging import get_logger
    assert get_logger("_api").name == "nixl.api"
    script = textwrap.dedent("""
        import logging
        from nixl.logging import get_logger
        log = get_logger("__main__")
        log.debug("a debug line")
        log.info("Data verification passed")
        log.warning("a warning")
        print(logging.getLogger("nixl").level, logging.getLogger("nixl").propagate,
              logging.raiseExceptions, log.name)
    """)

    def run(**env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_")}
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=dict(base, **env))

    out = run()
    lines = out.stdout.splitlines()
    assert out.stderr == ""
    assert len(lines) == 3, lines
    # "2026-12-07 11:00:00 NIXL INFO    <string>:6 Data verification passed"
    import re
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d NIXL INFO    <string>:6 "
                        r"Data verification passed", lines[0]), lines[0]
    assert " NIXL WARNING <string>:7 a warning" in lines[1]
    assert lines[2] == "20 False False nixl.main__"
    out = run(NIXL_LOG_LEVEL="trace", NIXL_DEBUG_LOGGING="yes")
    assert "Log level set to TRACE from NIXL_LOG_LEVEL" in out.stdout
    # The logger's level drops to DEBUG; NIXL's console handler stays at INFO, so no debug line.
    assert "a debug line" not in out.stdout
    assert out.stdout.splitlines()[-1].startswith("10 False True")
    out = run(NIXL_LOG_LEVEL="WARN")
    assert "Data verification passed" not in out.stdout and "a warning" in out.stdout
    out = run(NIXL_LOG_LEVEL="loud")
    assert "Invalid NIXL_LOG_LEVEL value 'loud'" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("20 ")


def test_numpy_nx3_descriptor_arrays_as_nixls():
    """NIXL's get_xfer_descs / get_reg_descs take an N x 3 integer array of (addr, len, dev)
    rows with a memory type: N descriptors, not the array's own 48 bytes."""
    a = nixl_agent(uniq("np"), None)
    buf = np.arange(N, dtype=np.uint8)
    rows = np.array([[buf.ctypes.data + i * 4096, 4096, 0] for i in range(4)], dtype=np.uint64)
    x = a.get_xfer_descs(rows, "DRAM")
    assert isinstance(x, nixlBind.nixlXferDList) and len(x) == 4
    assert x[1] == (buf.ctypes.data + 4096, 4096, 0)
    r = a.get_reg_descs(rows, "DRAM")
    assert isinstance(r, nixlBind.nixlRegDList) and r[3] == (buf.ctypes.data + 3 * 4096, 4096,
                                                             0, "")
    assert a.register_memory(rows, "DRAM") is not None
    # Anything else with a memory type is refused as NIXL refuses it: logged, None.
    assert a.get_xfer_descs(np.zeros((4, 4), dtype=np.uint64), "DRAM") is None
    assert a.get_xfer_descs(np.zeros(12, dtype=np.uint64), "DRAM") is None
    with pytest.raises(nixlBind.nixlInvalidParamError, match="integers"):
        a.get_xfer_descs(np.zeros((2, 3), dtype=np.float32), "DRAM")
    # Without a memory type an array is host memory (ferry's reading, as a CPU tensor's).
    one = a.get_xfer_descs(buf)
    assert len(one) == 1 and one[0] == (buf.ctypes.data, N, 0)
    # Indices for make_prepped_xfer may be int32 arrays, as NIXL's signature says.
    h = a.prep_xfer_dlist("", rows, "DRAM")
    self_h = a.prep_xfer_dlist(a.name, rows, "DRAM")
    x = a.make_prepped_xfer("WRITE", h, np.array([0, 1], dtype=np.int32), self_h,
                            np.array([3, 2], dtype=np.int32))
    assert isinstance(x, nixl_xfer_handle)


def test_handles_are_nixls_objects(agents):
    target, initiator = agents
    buf = np.zeros(N, dtype=np.uint8)
    initiator.register_memory(buf)
    h = initiator.prep_xfer_dlist("", [(buf.ctypes.data, 8, 0)], "DRAM")
    assert isinstance(h, nixl_prepped_dlist_handle) and "released=False" in repr(h)
    x = initiator.make_prepped_xfer("WRITE", h, [0], h, [0])
    assert isinstance(x, nixl_xfer_handle)
    x.release()
    initiator.release_xfer_handle(x)  # a second release is nothing, as on NIXL
    with pytest.raises(nixlBind.nixlInvalidParamError):
        initiator.transfer(x)
    initiator.release_dlist_handle(h)
    with pytest.raises(nixlBind.nixlInvalidParamError):
        initiator.make_prepped_xfer("WRITE", h, [0], h, [0])
    # The garbage collector releases what the caller drops.
    h2 = initiator.prep_xfer_dlist("", [(buf.ctypes.data, 8, 0)], "DRAM")
    before = len(initiator._prepped)
    del h2
    assert len(initiator._prepped) == before - 1


def test_partial_metadata_as_nixls_example():
    """NIXL's partial_md_example: the target sends metadata of some registrations only; the
    initiator can reach those and gets nixlNotFoundError for the rest until they are sent."""
    from nixl import _utils as nixl_utils
    tport, iport = free_port(), free_port()
    target = nixl_agent(uniq("t"), nixl_agent_config(True, True, tport))
    init = nixl_agent(uniq("i"), nixl_agent_config(True, True, iport))
    addrs = [nixl_utils.malloc_passthru(256) for _ in range(6)]
    try:
        for a in addrs[:4]:
            nixl_utils.ba_buf(a, 256)
        t1 = target.get_reg_descs([(a, 256, 0, "test") for a in addrs[:2]], "DRAM")
        t2 = target.get_reg_descs([(a, 256, 0, "test") for a in addrs[2:4]], "DRAM")
        mine = init.get_reg_descs([(a, 256, 0, "test") for a in addrs[4:]], "DRAM")
        for agent, descs in ((target, t1), (target, t2), (init, mine)):
            assert agent.register_memory(descs) is not None
        target.send_partial_agent_metadata(t1, True, ["UCX"], "127.0.0.1", iport)
        deadline = time.time() + 10
        while not init.check_remote_metadata(target.name, t1.trim()):
            assert time.time() < deadline
        x = init.initialize_xfer("READ", mine.trim(), t1.trim(), target.name, b"UUID1")
        assert init.transfer(x) != "ERR" and wait_done(init, x) == "DONE"
        nixl_utils.verify_transfer(addrs[0], addrs[4], 256)
        assert not init.check_remote_metadata(target.name, t2.trim())
        with pytest.raises(nixlBind.nixlNotFoundError):
            init.initialize_xfer("READ", mine.trim(), t2.trim(), target.name, b"UUID1")
        target.send_partial_agent_metadata(t2, True, ["UCX"], "127.0.0.1", iport,
                                           label="label_2")
        deadline = time.time() + 10
        while True:  # the example's retry loop: the second half arrives in the background
            try:
                x2 = init.initialize_xfer("READ", mine.trim(), t2.trim(), target.name, b"U2")
                break
            except nixlBind.nixlNotFoundError:
                assert time.time() < deadline
        assert init.transfer(x2) != "ERR" and wait_done(init, x2) == "DONE"
        deadline = time.time() + 10
        while not target.check_remote_xfer_done(init.name, b"U2"):
            assert time.time() < deadline
        # Partial metadata of memory that is not registered is refused, naming it.
        with pytest.raises(nixlBind.nixlNotFoundError, match="not registered"):
            target.get_partial_agent_metadata([(12345, 8, 0, "")], True)
    finally:
        for a in addrs:
            nixl_utils.free_passthru(a)


def test_metadata_sent_under_another_agents_name_is_refused(agents):
    """A peer's metadata notification must describe the peer that sent it: a stranger cannot
    replace what this agent knows of a third agent (its regions would redirect transfers)."""
    target, initiator = agents
    port = free_port()
    victim = nixl_agent(uniq("victim"), nixl_agent_config(True, True, port))
    buf = np.zeros(N, dtype=np.uint8)
    victim.register_memory(buf)
    target.fetch_remote_metadata(victim.name, "127.0.0.1", port)
    known = list(target._remote[victim.name])
    # The initiator sends victim's metadata, with regions of its choosing, as a notification.
    magic = b"ferry-nixl-md/1\n"
    forged = pickle.loads(victim.get_agent_metadata()[len(magic):])
    forged["regions"] = [(1 << 40, 1 << 20, 1)]
    initiator.add_remote_agent(target.get_agent_metadata())
    initiator.agent.notify(target.name, b"\x00ferry-nixl-md\x00" + magic + pickle.dumps(forged))
    initiator.send_notif(target.name, b"marker")  # after the forgery on the same connection
    deadline, got = time.time() + 10, {}
    while not got.get(initiator.name) and time.time() < deadline:
        got = target.get_new_notifs()
    assert got == {initiator.name: [b"marker"]}
    assert target._remote[victim.name] == known


def test_query_memory_as_nixls_posix_plugin(tmp_path):
    a = nixl_agent(uniq("q"), nixl_agent_config(False, False, backends=[]))
    f = tmp_path / "one.txt"
    f.write_bytes(b"Test content for file 0")
    a.create_backend("POSIX", a.get_plugin_params("POSIX"))
    resp = a.query_memory([(0, 0, 0, str(f)), (0, 0, 0, str(tmp_path / "none"))], "POSIX",
                          mem_type="FILE")
    st = os.stat(f)
    assert resp == [{"size": "23", "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))},
                    None]
    with pytest.raises(ValueError, match="Backend 'UCX' not found"):
        a.query_memory([(0, 0, 0, str(f))], "UCX", mem_type="FILE")
    with pytest.raises(nixlBind.nixlNotSupportedError):
        a.register_memory([(0, 0, 0, str(f))], "FILE")


def test_transfer_telemetry(agents):
    target, _ = agents
    a = nixl_agent(uniq("tel"), nixl_agent_config(capture_telemetry=True))
    buf = np.zeros(N, dtype=np.uint8)
    a.register_memory(buf)
    x = a.initialize_xfer("WRITE", [(buf.ctypes.data, 4096, 0), (buf.ctypes.data + 8192, 4096, 0)],
                          [(buf.ctypes.data + 4096, 4096, 0), (buf.ctypes.data + 12288, 4096, 0)],
                          a.name)
    assert a.transfer(x) != "ERR" and wait_done(a, x) == "DONE"
    t = a.get_xfer_telemetry(x)
    assert t.totalBytes == 8192 and t.descCount == 2
    assert t.startTime > 1.7e15 and t.xferDuration >= t.postDuration >= 0
    with pytest.raises(nixlBind.nixlNotAllowedError):
        target.get_xfer_telemetry(x)

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

from nixl._api import nixl_agent, nixl_agent_config
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
    with pytest.raises(nixlBind.nixlInvalidParamError):
        decode.release_dlist_handle(local_h)


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
    p = subprocess.Popen([sys.executable, "-c", TARGET, uniq("p-target")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
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


# NIXL's current examples/python/blocking_send_recv_example.py, step for step (its agent calls,
# names, arguments and the `nixl.logging` import), with numpy arrays where it allocates torch
# tensors: a target process that listens and an initiator that READs from it.
BLOCKING_SEND_RECV = textwrap.dedent("""
    import logging, sys
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl.logging import get_logger

    logging.basicConfig(level=logging.INFO)
    logger = get_logger(__name__)
    mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    listen_port = port if mode == "target" else 0
    config = nixl_agent_config(True, True, listen_port)
    agent = nixl_agent(mode, config)
    if mode == "target":
        tensors = [np.ones(10, dtype=np.float32) for _ in range(2)]
    else:
        tensors = [np.zeros(10, dtype=np.float32) for _ in range(2)]
    reg_descs = agent.register_memory(tensors)
    assert reg_descs
    if mode == "target":
        target_descs = reg_descs.trim()
        target_desc_str = agent.get_serialized_descs(target_descs)
        print("ready", flush=True)
        while not agent.check_remote_metadata("initiator"):
            pass
        agent.send_notif("initiator", target_desc_str)
        while not agent.check_remote_xfer_done("initiator", b"UUID"):
            continue
    else:
        agent.fetch_remote_metadata("target", ip, port)
        agent.send_local_metadata(ip, port)
        notifs = agent.get_new_notifs()
        while len(notifs) == 0:
            notifs = agent.get_new_notifs()
        target_descs = agent.deserialize_descs(notifs["target"][0])
        initiator_descs = reg_descs.trim()
        while not agent.check_remote_metadata("target"):
            pass
        xfer_handle = agent.initialize_xfer("READ", initiator_descs, target_descs, "target",
                                            "UUID")
        assert xfer_handle
        assert agent.transfer(xfer_handle) != "ERR"
        while True:
            state = agent.check_xfer_state(xfer_handle)
            assert state != "ERR"
            if state == "DONE":
                break
        for t in tensors:
            assert (t == np.ones(10, dtype=np.float32)).all()
        logger.info("%s Data verification passed", mode)
    if mode != "target":
        agent.remove_remote_agent("target")
        agent.release_xfer_handle(xfer_handle)
        agent.invalidate_local_metadata(ip, port)
    agent.deregister_memory(reg_descs)
    logger.info("Test Complete.")
    print("complete", logger.name, flush=True)
""")


def test_nixls_blocking_send_recv_example_flow():
    port = free_port()
    target = subprocess.Popen([sys.executable, "-c", BLOCKING_SEND_RECV, "target", "127.0.0.1",
                               str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        init = subprocess.run([sys.executable, "-c", BLOCKING_SEND_RECV, "initiator",
                               "127.0.0.1", str(port)], capture_output=True, text=True,
                              timeout=60)
        assert init.returncode == 0, init.stderr
        assert "complete nixl.main__" in init.stdout  # NIXL strips leading underscores
        assert "initiator Data verification passed" in init.stderr
        assert target.wait(30) == 0
        assert "complete" in target.stdout.read()
    finally:
        if target.poll() is None:
            target.kill()


def test_nixl_logging_as_nixls():
    from nixl.logging import get_logger
    assert get_logger("_api").name == "nixl.api"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import logging
        from nixl.logging import get_logger
        get_logger("x")
        print(logging.getLogger("nixl").level == logging.DEBUG)
    """)], capture_output=True, text=True, env=dict(os.environ, NIXL_LOG_LEVEL="debug"))
    assert out.stdout.strip() == "True", out.stderr

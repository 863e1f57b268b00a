"""Mooncake Transfer Engine's Python API on ferry (python/compat/mooncake), used the way SGLang's
and vLLM's Mooncake connectors use it: initialize with P2PHANDSHAKE, session "host:rpc_port",
register raw addresses, batch_transfer_sync_write/read by remote raw address; then the errors."""

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from mooncake.engine import TransferEngine, TransferOpcode
import mooncake.engine as mc


def engine(protocol="tcp"):
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    return e, f"127.0.0.1:{e.get_rpc_port()}"


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_sglang_style_transfers(protocol):
    server, server_session = engine(protocol)
    client, _ = engine(protocol)
    srv = np.zeros(1 << 20, dtype=np.uint8)
    cli = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[:1 << 20].copy()
    assert server.register_memory(srv.ctypes.data, srv.nbytes) == 0
    assert client.batch_register_memory([cli.ctypes.data], [cli.nbytes]) == 0
    # Three blocks written to other offsets, in one batch (SGLang sends KV page by page).
    src = [cli.ctypes.data + o for o in (0, 4096, 65536)]
    dst = [srv.ctypes.data + o for o in (8192, 0, 131072)]
    assert client.batch_transfer_sync_write(server_session, src, dst, [4096] * 3) == 0
    assert (srv[8192:12288] == cli[0:4096]).all()
    assert (srv[0:4096] == cli[4096:8192]).all()
    assert (srv[131072:135168] == cli[65536:69632]).all()
    # And read back, one block.
    out = np.zeros(4096, dtype=np.uint8)
    assert client.register_memory(out.ctypes.data, out.nbytes) == 0
    assert client.transfer_sync_read(server_session, out.ctypes.data, srv.ctypes.data, 4096) == 0
    assert (out == srv[:4096]).all()
    assert client.transfer_sync(server_session, out.ctypes.data, srv.ctypes.data + 8192, 4096,
                                TransferOpcode.READ) == 0
    assert (out == cli[:4096]).all()
    assert client.get_first_buffer_address(server_session) == srv.ctypes.data


def test_async_batches_and_managed_buffers():
    server, session = engine()
    client, _ = engine()
    buf = server.allocate_managed_buffer(1 << 16)
    assert buf != 0
    assert server.write_bytes_to_buffer(buf, b"hello mooncake", 14) == 0
    assert server.read_bytes_from_buffer(buf, 14) == b"hello mooncake"
    mine = client.allocate_managed_buffer(1 << 16)
    batch = client.batch_transfer_async_read(session, [mine], [buf], [14])
    assert batch > 0
    deadline = time.time() + 10
    while (status := client.transfer_check_status(batch)) == 0 and time.time() < deadline:
        time.sleep(0.001)
    assert status == 1
    assert client.read_bytes_from_buffer(mine, 14) == b"hello mooncake"
    b2 = client.transfer_submit_write(session, mine, buf + 100, 14)
    assert client.get_batch_transfer_status([b2]) == 0
    assert server.read_bytes_from_buffer(buf + 100, 14) == b"hello mooncake"
    assert server.free_managed_buffer(buf, 1 << 16) == 0
    assert server.free_managed_buffer(buf, 1 << 16) == mc.ERR_ADDRESS_NOT_REGISTERED


def test_the_errors_a_mooncake_caller_expects(capfd):
    server, session = engine()
    client, _ = engine()
    srv = np.zeros(1 << 16, dtype=np.uint8)
    cli = np.zeros(1 << 16, dtype=np.uint8)
    assert server.register_memory(srv.ctypes.data, srv.nbytes) == 0
    assert client.register_memory(cli.ctypes.data, cli.nbytes) == 0
    # A remote address outside what the server registered: refused, never sent.
    assert client.transfer_sync_write(session, cli.ctypes.data, srv.ctypes.data + (1 << 16),
                                      16) == mc.ERR_ADDRESS_NOT_REGISTERED
    assert "not inside memory it registered" in capfd.readouterr().err
    # A local one likewise.
    assert client.transfer_sync_write(session, 12345, srv.ctypes.data, 16) == \
        mc.ERR_ADDRESS_NOT_REGISTERED
    assert client.batch_transfer_sync_read(session, [cli.ctypes.data], [], [16]) == \
        mc.ERR_INVALID_ARGUMENT
    assert client.transfer_sync_read("127.0.0.1:1", cli.ctypes.data, srv.ctypes.data, 16) == \
        mc.ERR_SOCKET
    assert server.register_memory(srv.ctypes.data + 8, 16) == mc.ERR_ADDRESS_OVERLAPPED
    assert server.unregister_memory(srv.ctypes.data + 8) == mc.ERR_ADDRESS_NOT_REGISTERED
    # Once the server unregisters, the client's fresh lookup refuses the address.
    assert client.transfer_sync_write(session, cli.ctypes.data, srv.ctypes.data, 16) == 0
    assert server.unregister_memory(srv.ctypes.data) == 0
    assert client.transfer_sync_write(session, cli.ctypes.data, srv.ctypes.data, 16) != 0
    assert TransferEngine().register_memory(1, 1) == mc.ERR_NOT_INITIALIZED
    assert TransferEngine().initialize("127.0.0.1", "redis://x", "tcp", "") == mc.ERR_METADATA


SERVER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from mooncake.engine import TransferEngine
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(1 << 20, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    print(f"127.0.0.1:{e.get_rpc_port()} {buf.ctypes.data}", flush=True)
    sys.stdin.readline()  # the client wrote; check and answer
    print(int(buf[:1 << 20].astype(np.uint64).sum()), flush=True)
""")


def test_two_processes():
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        session, addr = p.stdout.readline().split()
        client, _ = engine()
        data = np.full(1 << 20, 3, dtype=np.uint8)
        assert client.register_memory(data.ctypes.data, data.nbytes) == 0
        assert client.transfer_sync_write(session, data.ctypes.data, int(addr), 1 << 20) == 0
        p.stdin.write("go\n")
        p.stdin.flush()
        assert int(p.stdout.readline()) == 3 << 20
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()

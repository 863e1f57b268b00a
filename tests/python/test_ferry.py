"""`import ferry`: every call of the native API, its errors, two processes, the GIL.

Run by `make test` (ctest python_tests) with Debian's /usr/bin/python3 and python3-pytest;
PYTHONPATH points at build/<preset>/python.
"""

import asyncio
import ctypes
import gc
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ferry

counter = iter(range(1_000_000))


def name(prefix):
    return f"{prefix}-{os.getpid()}-{next(counter)}"


def refresh(a, b):
    """Regions registered after the metadata exchange travel in fresh metadata (as with NIXL)."""
    a.add_peer(b.metadata())


@pytest.fixture
def pair():
    a = ferry.Agent(name("a"))
    b = ferry.Agent(name("b"))
    a.add_peer(b.metadata())
    b.add_peer(a.metadata())
    yield a, b
    a.close()
    b.close()


def test_agent_basics():
    with ferry.Agent(name("basics"), backends=["tcp"]) as a:
        assert a.name.startswith("basics-")
        host, port = a.listen_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert isinstance(a.metadata(), bytes) and len(a.metadata()) > 16
        assert a.epoch != 0
        r = a.allocate(4096)
        assert r.length == 4096 and r.registered and len(r) == 4096
        assert [x.id for x in a.regions()] == [r.id]
        r.buffer[:5] = b"hello"
        assert bytes(r.buffer[:5]) == b"hello"
        a.deregister(r)
        assert not r.registered and a.regions() == []
        with pytest.raises(ferry.FailedPrecondition):
            r.buffer
        assert a.stats()["transfers_posted"] == 0
    with pytest.raises(ferry.FailedPrecondition):
        a.metadata()


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_read_and_write_move_the_bytes(backend):
    a = ferry.Agent(name("rw-a"), backends=[backend])
    b = ferry.Agent(name("rw-b"), backends=[backend])
    peer = a.add_peer(b.metadata())
    assert a.peer_backend(peer) == backend
    src = b.allocate(1 << 20)
    src.buffer[:] = bytes(range(256)) * 4096
    with pytest.raises(ferry.NotFound, match="no region"):
        a.read([(0, 0, 16)], peer, [(src, 0, 16)])  # not in the metadata a has yet
    refresh(a, b)
    local = np.zeros(1 << 20, dtype=np.uint8)
    lr = a.register_memory(local)
    t = a.read([(lr, 0, 1 << 20)], peer, [(src, 0, 1 << 20)])
    t.wait(10)
    assert t.poll() == "done" and t.bytes == 1 << 20 and t.kind == "read"
    assert local.tobytes() == bytes(src.buffer)
    # WRITE back a changed slice, as a single descriptor tuple.
    local[:4096] = 7
    a.write((lr, 0, 4096), peer, (src.id, 8192, 4096)).wait(10)
    assert bytes(src.buffer[8192:8192 + 4096]) == b"\x07" * 4096
    assert a.stats()["transfers_posted"] == 2
    a.close()
    b.close()


def test_strided_descriptors_gather(pair):
    a, b = pair
    src = b.allocate(64 * 16)
    for i in range(16):
        src.buffer[i * 64:(i + 1) * 64] = bytes([i]) * 64
    refresh(a, b)
    dst = bytearray(16 * 8)
    dr = a.register_memory(dst)
    # The first 8 bytes of each of the 16 runs of 64: one strided descriptor.
    d = ferry.Descriptor(src, 0, 8, stride=64, count=16)
    assert d.total_bytes == 128 and "count=16" in repr(d)
    a.read([ferry.Descriptor(dr, 0, 128)], b.name, [d]).wait(10)
    assert dst == b"".join(bytes([i]) * 8 for i in range(16))


def test_every_kind_of_memory_registers(pair):
    a, b = pair
    src = b.allocate(4096)
    src.buffer[:] = b"\xab" * 4096
    refresh(a, b)
    m = mmap.mmap(-1, 4096)
    c = (ctypes.c_char * 4096)()
    for mem in [bytearray(4096), np.zeros(1024, dtype=np.float32), m,
                (ctypes.addressof(c), 4096)]:
        r = a.register_memory(mem)
        assert r.length == 4096
        a.read([(r, 0, 4096)], b.name, [(src, 0, 4096)]).wait(10)
        view = bytes(c) if isinstance(mem, tuple) else bytes(memoryview(mem).cast("B"))
        assert view == b"\xab" * 4096
        a.deregister(r.id)


def test_memory_a_peer_could_write_must_be_writable():
    with ferry.Agent(name("ro")) as a:
        with pytest.raises(ValueError, match="read-only"):
            a.register_memory(b"immutable bytes")
        with pytest.raises(ValueError, match="contiguous"):
            a.register_memory(np.zeros((8, 8))[:, 1])
        with pytest.raises(TypeError):
            a.register_memory(42)
        with pytest.raises(ValueError, match="empty"):
            a.register_memory(bytearray())


def test_registered_buffers_stay_alive_and_cannot_be_resized(pair):
    a, b = pair
    buf = bytearray(4096)
    r = a.register_memory(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # exported while registered: a peer's WRITE can never land freed
    del buf
    gc.collect()
    src = b.allocate(4096)
    src.buffer[:] = b"\x01" * 4096
    refresh(a, b)
    a.read([(r, 0, 4096)], b.name, [(src, 0, 4096)]).wait(10)
    assert bytes(r.owner) == b"\x01" * 4096
    a.deregister(r)
    assert r.owner is None


def test_errors_are_exceptions_named_by_their_code(pair):
    a, b = pair
    lr = a.allocate(4096)
    b_region = b.allocate(4096)
    refresh(a, b)
    with pytest.raises(ferry.NotFound) as e:
        a.read([(lr, 0, 16)], "nobody", [(1, 0, 16)])
    assert isinstance(e.value, ferry.Error) and e.value.code == "NotFound"
    assert "nobody" in e.value.message
    with pytest.raises(ferry.InvalidArgument):
        a.read([(lr, 0, 16)], b.name, [(b_region, 0, 32)])  # lengths differ
    with pytest.raises(ferry.Error):
        a.read([(lr, 0, 8192)], b.name, [(b_region, 0, 8192)])  # beyond both regions
    with pytest.raises(ferry.NotFound):
        a.read([(lr, 0, 16)], b.name, [(999, 0, 16)])  # no such region
    # The target deregisters a region a still knows: the target refuses the READ.
    b.deregister(b_region)
    with pytest.raises(ferry.NotFound):
        a.read([(lr, 0, 16)], b.name, [(b_region.id, 0, 16)], backend="tcp").wait(10)
    with pytest.raises(ferry.NotFound):
        a.deregister(12345)
    with pytest.raises(ferry.InvalidArgument):
        ferry.Agent("bad name with spaces")
    with pytest.raises(ValueError, match="host:port"):
        ferry.Agent(name("x"), listen="nowhere")
    with pytest.raises(TypeError, match="descriptor"):
        a.read(["nope"], b.name, [(1, 0, 16)])
    with pytest.raises(ferry.Unavailable):
        a.connect("127.0.0.1:1", timeout=1)


def test_a_secret_mismatch_is_permission_denied():
    with ferry.Agent(name("s1"), secret="one") as a, ferry.Agent(name("s2"), secret="two") as b:
        with pytest.raises(ferry.PermissionDenied):
            a.connect(b.listen_address, timeout=5)
    with ferry.Agent(name("s3"), secret="k") as a, ferry.Agent(name("s4"), secret="k") as b:
        assert a.connect(b.listen_address) == b.name


def test_notifications_arrive_in_order_and_after_the_bytes(pair):
    a, b = pair
    a.notify(b.name, b"one")
    a.notify(b.name, b"two")
    got = b.wait_notifications(5)
    while len(got) < 2:
        got += b.wait_notifications(5)
    assert got == [(a.name, b"one"), (a.name, b"two")]
    assert b.take_notifications() == []
    src = a.allocate(4096)
    dst = b.allocate(4096)
    refresh(a, b)
    src.buffer[:] = b"\x05" * 4096
    a.write([(src, 0, 4096)], b.name, [(dst, 0, 4096)], notification=b"done").wait(10)
    got = b.wait_notifications(5)
    assert got == [(a.name, b"done")] and bytes(dst.buffer) == b"\x05" * 4096
    with pytest.raises(ferry.NotFound):
        a.notify("nobody", b"x")


def test_named_objects(pair):
    a, b = pair
    obj = b.allocate(4096)
    obj.buffer[:] = b"k" * 4096
    b.publish("kv/req-1", [(obj, 0, 1000), (obj, 2000, 500)])
    small = a.allocate(100)
    assert a.pull_by_key(b.name, "kv/req-1", (small, 0, 100)) == (1500, False)
    big = a.allocate(2000)
    assert a.pull_by_key(b.name, "kv/req-1", (big, 0, 2000)) == (1500, True)
    assert bytes(big.buffer[:1500]) == b"k" * 1500
    b.unpublish("kv/req-1")
    with pytest.raises(ferry.NotFound):
        a.pull_by_key(b.name, "kv/req-1", (big, 0, 2000))


def test_the_gil_is_released_while_waiting(pair):
    a, b = pair
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    before = ticks
    assert b.wait_notifications(0.5) == []  # nothing comes: blocks the whole half second
    progressed = ticks - before
    stop.set()
    t.join()
    assert progressed > 50, f"the other thread ran {progressed} times in 0.5 s"


def test_a_transfer_is_awaitable(pair):
    a, b = pair
    src = b.allocate(1 << 16)
    src.buffer[:] = b"\x09" * (1 << 16)
    refresh(a, b)
    dst = a.allocate(1 << 16)

    async def main():
        t = a.read([(dst, 0, 1 << 16)], b.name, [(src, 0, 1 << 16)])
        await t
        return t.poll()

    assert asyncio.run(main()) == "done"
    assert bytes(dst.buffer) == b"\x09" * (1 << 16)


TARGET = textwrap.dedent("""
    import os, sys, time
    import ferry
    a = ferry.Agent(sys.argv[1], backends=[sys.argv[2]])
    r = a.allocate(1 << 20)
    r.buffer[:] = bytes(i % 251 for i in range(1 << 20))
    print(a.listen_address, r.id, flush=True)
    # Serve until told to stop; answer "ping ADDRESS" at that address (connecting to it first:
    # a peer that connected here is not yet a peer of this agent).
    while True:
        for peer, payload in a.wait_notifications(0.2):
            if payload == b"stop":
                sys.exit(0)
            word, address = payload.decode().split()
            a.connect(address)
            a.notify(peer, word.encode() + b" back")
""")


def stop(pid):
    """SIGSTOP, then wait until every thread of the process is stopped: the signal alone
    returns before the threads have stopped, and one may still answer a request meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.time() + 10
    while time.time() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


@pytest.fixture
def target_process(request):
    backend = getattr(request, "param", "tcp")
    p = subprocess.Popen([sys.executable, "-c", TARGET, name("target"), backend],
                         stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    line = p.stdout.readline().split()
    assert len(line) == 2, "the target process did not start"
    yield p, line[0], int(line[1]), backend
    if p.poll() is None:
        p.kill()
    p.wait()


@pytest.mark.parametrize("target_process", ["tcp", "shm"], indirect=True)
def test_two_processes(target_process):
    p, address, region, backend = target_process
    with ferry.Agent(name("initiator"), backends=[backend]) as a:
        peer = a.connect(address)
        buf = np.zeros(1 << 20, dtype=np.uint8)
        lr = a.register_memory(buf)
        a.read([(lr, 0, 1 << 20)], peer, [(region, 0, 1 << 20)]).wait(10)
        assert buf.tobytes() == bytes(i % 251 for i in range(1 << 20))
        a.notify(peer, b"ping " + a.listen_address.encode())
        got = []
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            got = a.wait_notifications(1)
        assert got == [(peer, b"ping back")]
        a.notify(peer, b"stop")
    assert p.wait(10) == 0


def test_cancel_stops_a_transfer_to_a_stalled_peer(target_process):
    p, address, region, _ = target_process
    with ferry.Agent(name("canceller"), backends=["tcp"]) as a:
        peer = a.connect(address)
        lr = a.allocate(1 << 20)
        stop(p.pid)  # it can no longer answer: the READ cannot finish
        try:
            t = a.read([(lr, 0, 1 << 20)], peer, [(region, 0, 1 << 20)], timeout=30)
            time.sleep(0.1)
            assert t.poll() == "pending"
            t.cancel()
            with pytest.raises(ferry.Cancelled):
                t.wait(5)
            with pytest.raises(ferry.Cancelled):
                t.poll()
        finally:
            os.kill(p.pid, signal.SIGCONT)


def test_a_dead_peer_fails_the_transfer_as_unavailable(target_process):
    p, address, region, _ = target_process
    with ferry.Agent(name("survivor"), backends=["tcp"]) as a:
        peer = a.connect(address)
        lr = a.allocate(1 << 20)
        p.kill()
        p.wait()
        t = a.read([(lr, 0, 1 << 20)], peer, [(region, 0, 1 << 20)], timeout=10)
        with pytest.raises((ferry.Unavailable, ferry.DeadlineExceeded)):
            t.wait(15)
        # The agent keeps working.
        assert a.regions()[0].id == lr.id


def test_wait_with_a_deadline_raises_deadline_exceeded(target_process):
    p, address, region, _ = target_process
    with ferry.Agent(name("patient"), backends=["tcp"]) as a:
        peer = a.connect(address)
        lr = a.allocate(1 << 20)
        stop(p.pid)
        try:
            t = a.read([(lr, 0, 1 << 20)], peer, [(region, 0, 1 << 20)], timeout=30)
            with pytest.raises(ferry.DeadlineExceeded):
                t.wait(0.2)
            t.cancel()
        finally:
            os.kill(p.pid, signal.SIGCONT)


def test_the_kv_block_example_runs():
    here = os.path.dirname(os.path.abspath(__file__))
    example = os.path.join(here, "..", "..", "examples", "python", "kv_blocks_native.py")
    out = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "all correct" in out.stdout


def test_cpu_torch_tensors_register_through_data_ptr(pair):
    torch = pytest.importorskip("torch")  # Debian's python3-torch; not in install-deps (large)
    a, b = pair
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.float32)
    rs = b.register_memory(src)
    rd = a.register_memory(dst)
    assert rs.length == 4096 * 4 and rs.owner is src
    refresh(a, b)
    a.read([(rd, 0, rs.length)], b.name, [(rs, 0, rs.length)]).wait(10)
    assert torch.equal(src, dst)
    with pytest.raises(ValueError, match="contiguous"):
        a.register_memory(torch.zeros(8, 8)[:, 1])


def ferry_bin():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("FERRY_BIN") or os.path.join(here, "..", "..", "build", "release",
                                                       "ferry")


def test_agents_find_each_other_through_the_discovery_store():
    store = subprocess.Popen([ferry_bin(), "discovery", "--listen", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = store.stdout.readline()
        assert "store at " in line, line
        url = line.split("store at ")[1].split()[0]
        with ferry.Agent(name("found"), store=url) as b, \
                ferry.Agent(name("finder"), store=url) as a:
            src = b.allocate(4096)
            src.buffer[:] = b"\x33" * 4096
            deadline = time.time() + 10
            while True:  # b registers in the background, and again as its regions change
                try:
                    peer = a.connect_by_name(b.name)
                    a.read([(a.allocate(4096), 0, 4096)], peer, [(src, 0, 4096)]).wait(10)
                    break
                except (ferry.NotFound, ferry.Unavailable):
                    if time.time() > deadline:
                        raise
                    time.sleep(0.05)
            with pytest.raises(ferry.NotFound):
                a.connect_by_name("nobody-registered-this")
        with ferry.Agent(name("storeless")) as c, pytest.raises(ferry.FailedPrecondition):
            c.connect_by_name("anyone")
    finally:
        store.kill()
        store.wait()


def test_every_status_code_has_its_exception_class():
    names = ["Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
             "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
             "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss"]
    for n in names:
        cls = getattr(ferry, n)
        assert issubclass(cls, ferry.Error) and issubclass(ferry.Error, Exception), n
        assert cls.__name__ == n and n in ferry.__all__
    # Raised ones carry their code, and catching ferry.Error catches all of them.
    with ferry.Agent(name("codes")) as a:
        for call, cls in [(lambda: a.deregister(999), ferry.NotFound),
                          (lambda: a.add_peer(b"junk"), ferry.InvalidArgument),
                          (lambda: a.add_peer(a.metadata()), ferry.AlreadyExists),
                          (lambda: a.unpublish("none"), ferry.NotFound)]:
            with pytest.raises(ferry.Error) as e:
                call()
            assert type(e.value) is cls and e.value.code == cls.__name__, e.value

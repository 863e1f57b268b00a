"""mooncake.engine.TransferEngine on ferry: what vLLM's and SGLang's Mooncake connectors call,
with Mooncake's names, arguments and integer returns (0 or a batch id on success, a negative
Mooncake error code on failure; failures are also logged to stderr, as Mooncake logs them).

Mooncake names remote memory by raw address within a "session" (the peer's "host:rpc_port").
Here the session is the peer agent's listen address, and each engine publishes, as a ferry
named object, the table of its registered buffers (base address, length, region); a remote
address is resolved through the peer's table (fetched once, fetched again on a miss) and one
outside every buffer the peer registered is refused with ERR_ADDRESS_NOT_REGISTERED, never sent.
"""

import ctypes
import enum
import itertools
import json
import os
import sys
import threading

import ferry

# Mooncake's error codes (mooncake-transfer-engine/include/error.h).
ERR_INVALID_ARGUMENT = -1
ERR_TOO_MANY_REQUESTS = -2
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_BATCH_BUSY = -4
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -101
ERR_METADATA = -200
ERR_NOT_INITIALIZED = -300  # ferry's: a call before initialize()

_TABLE_KEY = "mooncake/segments"
_TABLE_BYTES = 1 << 20
_names = itertools.count()


class TransferOpcode(enum.IntEnum):
    READ = 0
    WRITE = 1


def _log(msg):
    print(f"mooncake (ferry): {msg}", file=sys.stderr, flush=True)


class TransferEngine:
    def __init__(self):
        self._agent = None
        self._lock = threading.Lock()
        self._local = []  # (base, length, region)
        self._managed = {}  # base -> region
        self._peers = {}  # session id -> (peer name, [(base, length, region id)])
        self._batches = {}
        self._batch_ids = itertools.count(1)
        self._timeout = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))

    # --- setup ---------------------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name,
                       metadata_type):
        if self._agent is not None:
            _log("initialize: already initialized")
            return ERR_INVALID_ARGUMENT
        host, _, port = str(local_hostname).partition(":")
        host = "127.0.0.1" if host in ("", "localhost") else host
        store = None
        if metadata_server not in ("P2PHANDSHAKE", "p2p", "", None):
            if str(metadata_server).startswith(("http://", "etcd://")):
                store = metadata_server
            else:
                _log(f"initialize: metadata server '{metadata_server}' is not P2PHANDSHAKE, "
                     "http://host:port (ferry's store) or etcd://host:port")
                return ERR_METADATA
        backends = ["tcp"] if protocol == "tcp" else ["shm", "tcp"]
        try:
            self._agent = ferry.Agent(f"mooncake-{os.getpid()}-{next(_names)}",
                                      backends=backends, listen=f"{host}:{port or 0}",
                                      store=store, timeout=self._timeout)
            self._table = self._agent.allocate(_TABLE_BYTES)
            self._scratch = self._agent.allocate(_TABLE_BYTES)
            self._publish()
        except (ferry.Error, ValueError) as e:
            _log(f"initialize: {e}")
            self._agent = None
            return ERR_SOCKET
        return 0

    def get_rpc_port(self):
        if self._agent is None:
            return ERR_NOT_INITIALIZED
        return int(self._agent.listen_address.rsplit(":", 1)[1])

    def get_local_topology(self, device_name=""):
        return json.dumps({"cpu:0": {"preferred_hca": [], "avail_hca": []}})

    # --- memory --------------------------------------------------------------------------

    def _publish(self):
        with self._lock:
            table = [(b, n, r.id) for b, n, r in self._local]
        blob = json.dumps(table).encode()
        if len(blob) > _TABLE_BYTES:
            raise ferry.ResourceExhausted("too many registered buffers for the segment table")
        self._table.buffer[:len(blob)] = blob
        self._agent.publish(_TABLE_KEY, [(self._table, 0, len(blob))])

    def register_memory(self, buffer_addr, capacity):
        if self._agent is None:
            return ERR_NOT_INITIALIZED
        with self._lock:
            for b, n, _ in self._local:
                if buffer_addr < b + n and b < buffer_addr + capacity:
                    _log(f"register_memory: {buffer_addr:#x}+{capacity} overlaps {b:#x}+{n}")
                    return ERR_ADDRESS_OVERLAPPED
        try:
            region = self._agent.register_memory((int(buffer_addr), int(capacity)))
        except (ferry.Error, ValueError, TypeError) as e:
            _log(f"register_memory: {e}")
            return ERR_INVALID_ARGUMENT
        with self._lock:
            self._local.append((int(buffer_addr), int(capacity), region))
        self._publish()
        return 0

    def unregister_memory(self, buffer_addr):
        if self._agent is None:
            return ERR_NOT_INITIALIZED
        with self._lock:
            hit = next((x for x in self._local if x[0] == buffer_addr), None)
            if hit:
                self._local.remove(hit)
        if hit is None:
            _log(f"unregister_memory: nothing registered at {buffer_addr:#x}")
            return ERR_ADDRESS_NOT_REGISTERED
        self._publish()  # peers stop resolving into it before it goes
        self._agent.deregister(hit[2])
        return 0

    def batch_register_memory(self, buffer_addresses, capacities):
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        for a, c in zip(buffer_addresses, capacities):
            ret = self.register_memory(a, c)
            if ret != 0:
                return ret
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        for a in buffer_addresses:
            ret = self.unregister_memory(a)
            if ret != 0:
                return ret
        return 0

    def allocate_managed_buffer(self, length):
        if self._agent is None:
            return 0
        try:
            region = self._agent.allocate(int(length))
        except ferry.Error as e:
            _log(f"allocate_managed_buffer: {e}")
            return 0
        with self._lock:
            self._managed[region.ptr] = region
            self._local.append((region.ptr, region.length, region))
        self._publish()
        return region.ptr

    def free_managed_buffer(self, buffer_addr, length):
        with self._lock:
            region = self._managed.pop(buffer_addr, None)
            if region is not None:
                self._local = [x for x in self._local if x[0] != buffer_addr]
        if region is None:
            return ERR_ADDRESS_NOT_REGISTERED
        self._publish()
        self._agent.deregister(region)
        return 0

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        if not self._inside_local(dest_address, length):
            return ERR_ADDRESS_NOT_REGISTERED
        ctypes.memmove(dest_address, bytes(src_ptr[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        if not self._inside_local(source_address, length):
            return b""
        return ctypes.string_at(source_address, length)

    def _inside_local(self, addr, length):
        with self._lock:
            return any(b <= addr and addr + length <= b + n for b, n, _ in self._local)

    def get_first_buffer_address(self, segment_name):
        peer = self._peer(segment_name, refresh=True)
        if peer is None or not peer[1]:
            return 0
        return peer[1][0][0]

    # --- peers ---------------------------------------------------------------------------

    def _peer(self, session, refresh=False):
        with self._lock:
            known = self._peers.get(session)
        if known and not refresh:
            return known
        try:
            name = known[0] if known else self._agent.connect(session, timeout=5)
            size, copied = self._agent.pull_by_key(name, _TABLE_KEY, (self._scratch, 0,
                                                                      _TABLE_BYTES))
            table = json.loads(bytes(self._scratch.buffer[:size])) if copied else []
        except (ferry.Error, ValueError) as e:
            _log(f"session {session}: {e}")
            return None
        entry = (name, [tuple(map(int, t)) for t in table])
        with self._lock:
            self._peers[session] = entry
        return entry

    def _resolve(self, session, addrs, lengths):
        peer = self._peer(session)
        if peer is None:
            return None, ERR_SOCKET
        out = []
        for refreshed in (False, True):
            if refreshed:
                peer = self._peer(session, refresh=True)
                if peer is None:
                    return None, ERR_SOCKET
            out = []
            for a, n in zip(addrs, lengths):
                hit = next((t for t in peer[1] if t[0] <= a and a + n <= t[0] + t[1]), None)
                if hit is None:
                    break
                out.append((hit[2], a - hit[0], n))
            if len(out) == len(addrs):
                return (peer[0], out), 0
        _log(f"session {session}: remote address {a:#x}+{n} is not inside memory it registered")
        return None, ERR_ADDRESS_NOT_REGISTERED

    # --- transfers -----------------------------------------------------------------------

    def _post(self, session, buffers, peer_addrs, lengths, op):
        if self._agent is None:
            return None, ERR_NOT_INITIALIZED
        if not (len(buffers) == len(peer_addrs) == len(lengths)) or not buffers:
            return None, ERR_INVALID_ARGUMENT
        local = []
        with self._lock:
            regions = list(self._local)
        for a, n in zip(buffers, lengths):
            hit = next(((b, r) for b, m, r in regions if b <= a and a + n <= b + m), None)
            if hit is None:
                _log(f"local address {a:#x}+{n} is not inside registered memory")
                return None, ERR_ADDRESS_NOT_REGISTERED
            local.append((hit[1], a - hit[0], n))
        resolved, err = self._resolve(session, peer_addrs, lengths)
        if err:
            return None, err
        name, remote = resolved
        try:
            post = self._agent.read if op == TransferOpcode.READ else self._agent.write
            return post(local, name, remote), 0
        except ferry.Error as e:
            _log(f"{op.name.lower()} to {session}: {e}")
            return None, ERR_INVALID_ARGUMENT

    def _sync(self, session, buffers, peer_addrs, lengths, op):
        t, err = self._post(session, buffers, peer_addrs, lengths, op)
        if err:
            return err
        try:
            t.wait()
        except ferry.Error as e:
            _log(f"{op.name.lower()} to {session}: {e}")
            return ERR_SOCKET
        return 0

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length],
                          TransferOpcode.WRITE)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length):
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length],
                          TransferOpcode.READ)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode):
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length],
                          TransferOpcode(opcode))

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths):
        return self._sync(target_hostname, list(buffers), list(peer_buffer_addresses),
                          list(lengths), TransferOpcode.WRITE)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses,
                                 lengths):
        return self._sync(target_hostname, list(buffers), list(peer_buffer_addresses),
                          list(lengths), TransferOpcode.READ)

    def _submit(self, target_hostname, buffers, peer_addrs, lengths, op):
        t, err = self._post(target_hostname, buffers, peer_addrs, lengths, op)
        if err:
            return err
        batch = next(self._batch_ids)
        with self._lock:
            self._batches[batch] = t
        return batch

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length):
        return self._submit(target_hostname, [buffer], [peer_buffer_address], [length],
                            TransferOpcode.WRITE)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths):
        return self._submit(target_hostname, list(buffers), list(peer_buffer_addresses),
                            list(lengths), TransferOpcode.WRITE)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths):
        return self._submit(target_hostname, list(buffers), list(peer_buffer_addresses),
                            list(lengths), TransferOpcode.READ)

    def transfer_check_status(self, batch_id):
        """1 done, 0 in progress, -1 failed, -2 timed out (Mooncake's values)."""
        with self._lock:
            t = self._batches.get(batch_id)
        if t is None:
            return -1
        try:
            if t.poll() == "pending":
                return 0
        except ferry.DeadlineExceeded:
            status = -2
        except ferry.Error:
            status = -1
        else:
            status = 1
        with self._lock:
            self._batches.pop(batch_id, None)
        return status

    def get_batch_transfer_status(self, batch_ids):
        """0 when every batch completed, negative when one failed (blocks until they end)."""
        result = 0
        for b in batch_ids:
            with self._lock:
                t = self._batches.pop(b, None)
            if t is None:
                result = ERR_INVALID_ARGUMENT
                continue
            try:
                t.wait()
            except ferry.Error:
                result = -1
        return result

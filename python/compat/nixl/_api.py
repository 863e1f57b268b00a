"""NIXL's Python API (nixl._api: nixl_agent, nixl_agent_config) on ferry's transfer engine.

Written against NIXL's own src/api/python/_api.py and examples/python, call for call: the
names, arguments, return values and states ("DONE", "PROC", "ERR") are NIXL's. What differs
underneath: NIXL names remote memory by raw address; ferry by region and offset. This layer's
metadata (get_agent_metadata) therefore carries, beside ferry's own, the base address and
length of each registered region, and a remote (addr, len, dev) is resolved to the peer's region
that holds it; one outside every region is refused (nixlNotFoundError) rather than sent.

Stricter than NIXL, and loud about it (docs/python.md):
- only DRAM ("DRAM", "cpu") memory: VRAM, files and objects raise nixlNotSupportedError;
- a transfer whose lengths differ on the two sides, or an index outside a prepared list,
  raises nixlInvalidParamError at creation, not later;
- descriptors must lie inside registered memory on both sides;
- NIXL's central metadata server (the calls without ip_addr) raises nixlNotSupportedError; the
  peer-to-peer listener exchange (ip_addr, port) works: metadata is a ferry named object a peer
  fetches, and send/invalidate travel as notifications the receiving layer applies.
"""

import itertools
import pickle
import threading
from typing import Optional

import ferry

from . import _bindings as nixlBind
from ._bindings import translate

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

nixl_backend_handle = int
nixl_prepped_dlist_handle = int
nixl_xfer_handle = int

# ferry's backends under the names NIXL's callers ask for. "UCX" is what NIXL's agent creates
# by default; on ferry it means "the best backend for each peer" (shm on one host, else tcp or
# ucx), which is what a NIXL UCX agent gets from UCX.
_PLUGINS = {"UCX": ["shm", "tcp"], "UCX_MO": ["shm", "tcp"], "TCP": ["tcp"], "SHM": ["shm"]}
_MAGIC = b"ferry-nixl-md/1\n"
# NIXL's listener exchange on ferry: each agent publishes its metadata as a named object (a
# peer fetches it with pull_by_key), and sends it, or its withdrawal, as a notification these
# prefixes mark (the receiving layer applies them and never hands them to the caller).
_MD_KEY = "nixl/metadata"
_MD_NOTIF = b"\x00ferry-nixl-md\x00"
_INVALIDATE_NOTIF = b"\x00ferry-nixl-invalidate\x00"
_MD_BYTES = 1 << 22


class nixl_agent_config:
    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = 0, backends: list[str] = ["UCX"]):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ferry.Error as e:
        raise translate(e) from e


class _Prepped:
    """A prepared descriptor list: each entry resolved to (region id, offset, length)."""

    def __init__(self, agent_name, entries):
        self.agent_name = agent_name
        self.entries = entries


class _Xfer:
    def __init__(self, op, local, remote_agent, remote, notif):
        self.op = op
        self.local = local
        self.remote_agent = remote_agent
        self.remote = remote
        self.notif = notif
        self.transfer: Optional[ferry.Transfer] = None
        self.error: Optional[BaseException] = None


class nixl_agent:
    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False):
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        self.name = agent_name
        self.plugin_list = list(_PLUGINS)
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.notifs: dict[str, list[bytes]] = {}
        wanted = self.plugin_list if instantiate_all else list(nixl_conf.backends)
        ferry_backends = []
        for b in wanted:
            if b not in _PLUGINS:
                print("Skipping backend registration", b, "due to the missing plugin.")
                continue
            for fb in _PLUGINS[b]:
                if fb not in ferry_backends:
                    ferry_backends.append(fb)
        if not ferry_backends:
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        # NIXL's listener (enable_listen_thread) serves metadata on listen_port; ferry's agent
        # always listens (the side channel), on that port when one is given.
        port = nixl_conf.port if nixl_conf.enable_listen else 0
        self.agent = _call(ferry.Agent, agent_name, backends=ferry_backends,
                           listen=f"127.0.0.1:{port}")
        self._lock = threading.Lock()
        self._handles = itertools.count(1)
        self._prepped: dict[int, _Prepped] = {}
        self._xfers: dict[int, _Xfer] = {}
        # Local registrations: (base, length, region).
        self._local: list[tuple[int, int, ferry.Region]] = []
        # Remote agents: name -> [(base, length, region id)].
        self._remote: dict[str, list[tuple[int, int, int]]] = {}
        for b in wanted:
            if b in _PLUGINS:
                self.create_backend(b)
        self._md_region = _call(self.agent.allocate, _MD_BYTES)
        self._md_scratch = _call(self.agent.allocate, _MD_BYTES)
        self._publish_metadata()
        self.nixl_mems = {"DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG,
                          "FILE": nixlBind.FILE_SEG, "BLOCK": nixlBind.BLK_SEG,
                          "OBJ": nixlBind.OBJ_SEG, "cpu": nixlBind.DRAM_SEG,
                          "cuda": nixlBind.VRAM_SEG}
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}

    # --- plugins and backends ------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return ["DRAM"] if backend in _PLUGINS else []

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {} if backend in _PLUGINS else {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return self.backend_options.get(backend, {})

    def create_backend(self, backend: str, initParams: dict[str, str] = {}):
        if backend not in _PLUGINS:
            raise nixlBind.nixlNotFoundError(f"no plugin '{backend}' (ferry has {self.plugin_list})")
        self.backends.setdefault(backend, len(self.backends) + 1)
        self.backend_mems[backend] = ["DRAM"]
        self.backend_options[backend] = dict(initParams)

    # --- descriptors ---------------------------------------------------------------------

    def _mem(self, mem_type):
        if mem_type is None:
            raise nixlBind.nixlInvalidParamError("Please specify a mem type if not using Tensors")
        seg = self.nixl_mems.get(mem_type, mem_type)
        if seg != nixlBind.DRAM_SEG:
            raise nixlBind.nixlNotSupportedError(
                f"memory type {mem_type!r}: ferry moves host memory (DRAM) here")
        return seg

    @staticmethod
    def _tensor_desc(t):
        """(addr, len, dev) of a torch tensor (CPU) or a numpy array."""
        if hasattr(t, "data_ptr"):
            if str(t.device) != "cpu":
                raise nixlBind.nixlNotSupportedError(f"tensor on {t.device}: DRAM only")
            return (t.data_ptr(), t.numel() * t.element_size(), 0)
        if hasattr(t, "__array_interface__"):
            if not t.flags["C_CONTIGUOUS"]:
                raise nixlBind.nixlInvalidParamError("the array is not contiguous")
            return (t.__array_interface__["data"][0], t.nbytes, 0)
        return None

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None, is_sorted: bool = False):
        if isinstance(descs, nixlBind.nixlXferDList):
            return descs
        if isinstance(descs, nixlBind.nixlRegDList):
            print("RegList type detected for transfer, please use XferList")
            return None
        one = self._tensor_desc(descs)
        if one is not None:
            return nixlBind.nixlXferDList(nixlBind.DRAM_SEG, [one], is_sorted)
        descs = list(descs)
        if descs and isinstance(descs[0], tuple):
            return nixlBind.nixlXferDList(self._mem(mem_type), descs, is_sorted)
        if descs and self._tensor_desc(descs[0]) is not None:
            return nixlBind.nixlXferDList(nixlBind.DRAM_SEG,
                                          [self._tensor_desc(t) for t in descs], is_sorted)
        return None

    def get_reg_descs(self, descs, mem_type: Optional[str] = None, is_sorted: bool = False):
        if isinstance(descs, nixlBind.nixlRegDList):
            return descs
        if isinstance(descs, nixlBind.nixlXferDList):
            print("XferList type detected for registration, please use RegList")
            return None
        one = self._tensor_desc(descs)
        if one is not None:
            return nixlBind.nixlRegDList(nixlBind.DRAM_SEG, [one + ("",)], is_sorted)
        descs = list(descs)
        if descs and isinstance(descs[0], tuple):
            if len(descs[0]) == 3:  # NIXL wants 4-tuples; (addr, len, dev) is taken as meta ""
                descs = [d + ("",) for d in descs]
            return nixlBind.nixlRegDList(self._mem(mem_type), descs, is_sorted)
        if descs and self._tensor_desc(descs[0]) is not None:
            return nixlBind.nixlRegDList(nixlBind.DRAM_SEG,
                                         [self._tensor_desc(t) + ("",) for t in descs], is_sorted)
        return None

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)

    # --- memory --------------------------------------------------------------------------

    def register_memory(self, reg_list, mem_type: Optional[str] = None, is_sorted: bool = False,
                        backends: list[str] = []):
        reg_descs = self.get_reg_descs(reg_list, mem_type, is_sorted)
        if reg_descs is None:
            raise nixlBind.nixlInvalidParamError("register_memory: nothing to register")
        done = []
        try:
            for addr, length, _dev, _meta in reg_descs:
                region = _call(self.agent.register_memory, (addr, length))
                done.append((addr, length, region))
        except BaseException:
            for _, _, r in done:
                self.agent.deregister(r)
            raise
        with self._lock:
            self._local.extend(done)
        self._publish_metadata()
        return reg_descs

    def deregister_memory(self, dereg_list, backends: list[str] = []):
        for addr, length, _dev, _meta in dereg_list:
            with self._lock:
                hit = next((x for x in self._local if x[0] == addr and x[1] == length), None)
                if hit:
                    self._local.remove(hit)
            if hit is None:
                raise nixlBind.nixlNotFoundError(f"no registration at {addr:#x}+{length}")
            _call(self.agent.deregister, hit[2])
        self._publish_metadata()

    def _resolve_local(self, addr, length):
        with self._lock:
            for base, blen, region in self._local:
                if base <= addr and addr + length <= base + blen:
                    return (region.id, addr - base, length)
        raise nixlBind.nixlNotFoundError(
            f"local descriptor {addr:#x}+{length} is not inside registered memory")

    def _resolve_remote(self, agent, addr, length):
        with self._lock:
            regions = self._remote.get(agent)
        if regions is None:
            raise nixlBind.nixlNotFoundError(f"no metadata for remote agent '{agent}'")
        for base, blen, rid in regions:
            if base <= addr and addr + length <= base + blen:
                return (rid, addr - base, length)
        raise nixlBind.nixlNotFoundError(
            f"remote descriptor {addr:#x}+{length} is not inside memory '{agent}' registered")

    # --- metadata ------------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        with self._lock:
            regions = [(base, length, r.id) for base, length, r in self._local]
        return _MAGIC + pickle.dumps({"ferry": self.agent.metadata(), "regions": regions,
                                      "name": self.name})

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False,
                                   backends: list[str] = []) -> bytes:
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        if not isinstance(metadata, (bytes, bytearray)) or not metadata.startswith(_MAGIC):
            raise nixlBind.nixlInvalidParamError(
                "add_remote_agent: not metadata of a ferry NIXL agent (get_agent_metadata)")
        try:
            md = pickle.loads(bytes(metadata[len(_MAGIC):]))
            ferry_md, regions = md["ferry"], [tuple(map(int, r)) for r in md["regions"]]
        except Exception as e:  # noqa: BLE001 - anything malformed is one error
            raise nixlBind.nixlInvalidParamError(f"add_remote_agent: malformed metadata: {e}")
        name = _call(self.agent.add_peer, ferry_md)
        with self._lock:
            self._remote[name] = regions
        return name

    def remove_remote_agent(self, agent: str):
        with self._lock:
            self._remote.pop(agent, None)
        _call(self.agent.remove_peer, agent)

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        self._drain(self.notifs)  # applies metadata that peers sent (send_local_metadata)
        with self._lock:
            regions = self._remote.get(agent)
        if regions is None:
            return False
        if descs is None:
            return True
        try:
            for addr, length, _dev in descs:
                self._resolve_remote(agent, addr, length)
        except nixlBind.nixlNotFoundError:
            return False
        return True

    def _publish_metadata(self):
        blob = self.get_agent_metadata()
        if len(blob) > _MD_BYTES:
            raise nixlBind.nixlBackendError("metadata larger than 4 MiB: too many registrations")
        self._md_region.buffer[:len(blob)] = blob
        _call(self.agent.publish, _MD_KEY, [(self._md_region, 0, len(blob))])

    def _central(self, what):
        raise nixlBind.nixlNotSupportedError(
            f"{what}: NIXL's central metadata server is not part of ferry's NIXL layer; give "
            "ip_addr (the peer's listener), or pass get_agent_metadata() out of band")

    def _connect(self, ip_addr, port):
        return _call(self.agent.connect, f"{ip_addr}:{port}", 5.0)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        if not ip_addr:
            self._central("send_local_metadata")
        peer = self._connect(ip_addr, port)
        _call(self.agent.notify, peer, _MD_NOTIF + self.get_agent_metadata())

    def send_partial_agent_metadata(self, descs, inc_conn_info: bool = False,
                                    backends: list[str] = [], ip_addr: str = "",
                                    port: int = DEFAULT_COMM_PORT):
        self.send_local_metadata(ip_addr, port)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT):
        if not ip_addr:
            self._central("fetch_remote_metadata")
        peer = self._connect(ip_addr, port)
        if remote_agent and peer != remote_agent:
            raise nixlBind.nixlMismatchError(
                f"fetch_remote_metadata: {ip_addr}:{port} is '{peer}', not '{remote_agent}'")
        size, copied = _call(self.agent.pull_by_key, peer, _MD_KEY,
                             (self._md_scratch, 0, _MD_BYTES))
        if not copied:
            raise nixlBind.nixlBackendError(f"metadata of '{peer}' is {size} bytes, over 4 MiB")
        self.add_remote_agent(bytes(self._md_scratch.buffer[:size]))

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        # Best effort, as NIXL's (its listener thread sends it; the caller never hears how it
        # went): a peer that is gone, as the target of NIXL's blocking_send_recv example may be
        # by now, has nothing to invalidate.
        if ip_addr:
            try:
                peers = [self._connect(ip_addr, port)]
            except nixlBind.nixlError:
                return
        else:
            with self._lock:
                peers = list(self._remote)
        for peer in peers:
            try:
                self.agent.notify(peer, _INVALIDATE_NOTIF + self.name.encode())
            except ferry.Error:
                pass  # a peer that is gone has nothing to invalidate

    def make_connection(self, remote_agent: str, backends: list[str] = []):
        with self._lock:
            known = remote_agent in self._remote
        if not known:
            raise nixlBind.nixlNotFoundError(f"no metadata for remote agent '{remote_agent}'")

    # --- transfers -----------------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None,
                        is_sorted: bool = False, backends: list[str] = []) -> int:
        descs = self.get_xfer_descs(xfer_list, mem_type, is_sorted)
        if descs is None:
            raise nixlBind.nixlInvalidParamError("prep_xfer_dlist: no descriptors")
        local = agent_name in ("NIXL_INIT_AGENT", "", nixlBind.NIXL_INIT_AGENT)
        target = self.name if local else agent_name
        if local or agent_name == self.name:
            entries = [self._resolve_local(a, n) for a, n, _ in descs]
        else:
            entries = [self._resolve_remote(agent_name, a, n) for a, n, _ in descs]
        handle = next(self._handles)
        with self._lock:
            self._prepped[handle] = _Prepped(target, entries)
        return handle

    def _xfer_handle(self, xfer):
        handle = next(self._handles)
        with self._lock:
            self._xfers[handle] = xfer
        return handle

    def make_prepped_xfer(self, operation: str, local_xfer_side: int, local_indices: list[int],
                          remote_xfer_side: int, remote_indices: list[int],
                          notif_msg: bytes = b"", backends: list[str] = [],
                          skip_desc_merge: bool = False) -> int:
        op = self._op(operation)
        with self._lock:
            lp = self._prepped.get(local_xfer_side)
            rp = self._prepped.get(remote_xfer_side)
        if lp is None or rp is None:
            raise nixlBind.nixlInvalidParamError("make_prepped_xfer: unknown prepared list handle")
        try:
            local = [lp.entries[i] for i in local_indices]
            remote = [rp.entries[i] for i in remote_indices]
        except (IndexError, TypeError):
            raise nixlBind.nixlInvalidParamError("make_prepped_xfer: index outside the list")
        self._check_lengths(local, remote)
        return self._xfer_handle(_Xfer(op, local, rp.agent_name, remote, notif_msg))

    def initialize_xfer(self, operation: str, local_descs, remote_descs, remote_agent: str,
                        notif_msg: bytes = b"", backends: list[str] = []) -> int:
        op = self._op(operation)
        local = [self._resolve_local(a, n) for a, n, _ in local_descs]
        if remote_agent == self.name:
            remote = [self._resolve_local(a, n) for a, n, _ in remote_descs]
        else:
            remote = [self._resolve_remote(remote_agent, a, n) for a, n, _ in remote_descs]
        self._check_lengths(local, remote)
        return self._xfer_handle(_Xfer(op, local, remote_agent, remote, notif_msg))

    def _op(self, operation):
        if operation not in self.nixl_ops:
            raise nixlBind.nixlInvalidParamError("Invalid op code")
        return operation

    @staticmethod
    def _check_lengths(local, remote):
        if len(local) != len(remote) or any(l[2] != r[2] for l, r in zip(local, remote)):
            raise nixlBind.nixlInvalidParamError(
                "the local and remote descriptors differ in number or lengths")

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        with self._lock:
            x = self._xfers.get(handle)
        if x is None:
            raise nixlBind.nixlInvalidParamError("transfer: unknown transfer handle")
        if x.transfer is not None and self._state(x) == "PROC":
            raise nixlBind.nixlRepostActiveError("transfer: the transfer is still active")
        msg = notif_msg or x.notif
        if isinstance(msg, str):
            msg = msg.encode()
        post = self.agent.read if x.op == "READ" else self.agent.write
        x.error = None
        try:
            x.transfer = post(x.local, x.remote_agent, x.remote, notification=msg or None)
        except ferry.Error as e:
            x.transfer, x.error = None, e
            return "ERR"
        return self._state(x)

    def _state(self, x):
        if x.transfer is None:
            return "ERR" if x.error is not None else "PROC"
        try:
            return "DONE" if x.transfer.poll() == "done" else "PROC"
        except ferry.Error as e:
            x.error = e
            return "ERR"

    def check_xfer_state(self, handle: int) -> str:
        with self._lock:
            x = self._xfers.get(handle)
        if x is None:
            raise nixlBind.nixlInvalidParamError("check_xfer_state: unknown transfer handle")
        if x.transfer is None and x.error is None:
            raise nixlBind.nixlNotPostedError("check_xfer_state: the transfer was not posted")
        return self._state(x)

    def query_xfer_backend(self, handle: int) -> str:
        with self._lock:
            x = self._xfers.get(handle)
        if x is None:
            raise nixlBind.nixlInvalidParamError("query_xfer_backend: unknown transfer handle")
        return "UCX" if "UCX" in self.backends else next(iter(self.backends))

    def release_xfer_handle(self, handle: int):
        with self._lock:
            x = self._xfers.pop(handle, None)
        if x is None:
            raise nixlBind.nixlInvalidParamError("release_xfer_handle: unknown transfer handle")
        if x.transfer is not None:
            try:
                if x.transfer.poll() == "pending":
                    x.transfer.cancel()
            except ferry.Error:
                pass

    def release_dlist_handle(self, handle: int):
        with self._lock:
            if self._prepped.pop(handle, None) is None:
                raise nixlBind.nixlInvalidParamError("release_dlist_handle: unknown handle")

    # --- notifications -------------------------------------------------------------------

    def _drain(self, into):
        for peer, payload in self.agent.take_notifications():
            if payload.startswith(_MD_NOTIF):
                try:
                    self.add_remote_agent(payload[len(_MD_NOTIF):])
                except nixlBind.nixlError as e:
                    print(f"nixl (ferry): metadata from {peer} refused: {e}")
                continue
            if payload.startswith(_INVALIDATE_NOTIF):
                with self._lock:
                    self._remote.pop(peer, None)
                try:
                    self.agent.remove_peer(peer)
                except ferry.Error:
                    pass
                continue
            into.setdefault(peer, []).append(payload)
        return into

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        return self._drain({})

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        self._drain(self.notifs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: list[str] = [], tag_is_prefix=True) -> bool:
        self._drain(self.notifs)
        for msg in self.notifs.get(remote_agent_name, []):
            if (tag_is_prefix and msg.startswith(lookup_tag)) or (
                    not tag_is_prefix and lookup_tag in msg):
                self.notifs[remote_agent_name].remove(msg)
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes,
                   backend: Optional[str] = None):
        if isinstance(notif_msg, str):
            notif_msg = notif_msg.encode()
        _call(self.agent.notify, remote_agent_name, notif_msg)

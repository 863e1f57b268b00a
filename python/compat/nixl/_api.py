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
import os
import pickle
import sys
import threading
import time
from enum import Enum
from typing import Optional

import ferry

from . import _bindings as nixlBind
from ._bindings import translate
from .logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

nixl_backend_handle = int

# ferry's backends under the names NIXL's callers ask for. "UCX" is what NIXL's agent creates
# by default; on ferry it means "the best backend for each peer" (shm on one host, else tcp or
# ucx), which is what a NIXL UCX agent gets from UCX.
_PLUGINS = {"UCX": ["shm", "tcp"], "UCX_MO": ["shm", "tcp"], "TCP": ["tcp"], "SHM": ["shm"]}
# Storage plugins: POSIX answers query_memory (a stat of each file, as NIXL's queryFileInfo);
# registering FILE memory for transfers is not served by this layer (ferry's own API moves
# files, docs/python.md).
_STORAGE = {"POSIX": ["DRAM", "FILE"]}
_MAGIC = b"ferry-nixl-md/1\n"
# NIXL's listener exchange on ferry: each agent publishes its metadata as a named object (a
# peer fetches it with pull_by_key), and sends it, or its withdrawal, as a notification these
# prefixes mark (the receiving layer applies them and never hands them to the caller).
_MD_KEY = "nixl/metadata"
_MD_NOTIF = b"\x00ferry-nixl-md\x00"
_INVALIDATE_NOTIF = b"\x00ferry-nixl-invalidate\x00"
_MD_BYTES = 1 << 22


def _is_ndarray(obj) -> bool:
    """True for a NumPy array, without importing NumPy when the caller has not (as NIXL, which
    consults sys.modules for torch)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(obj, np.ndarray)


class _Handle:
    """NIXL's opaque handle objects: release() frees, and so does the garbage collector."""

    __slots__ = ("_handle", "_agent", "_released")
    _kind = "handle"

    def __init__(self, agent, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{self._handle:x}, released={self._released})"

    def __index__(self) -> int:
        return self._handle

    def release(self):
        if not self._released:
            self._agent._release(self._kind, self._handle)
            self._released = True

    def __del__(self):
        if not self._released:
            try:
                self._agent._release(self._kind, self._handle, quiet=True)
            except Exception:  # noqa: BLE001 - finalizers never raise, as NIXL's
                pass


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (prep_xfer_dlist)."""

    __slots__ = ()
    _kind = "dlist"


class nixl_xfer_handle(_Handle):
    """A transfer request (initialize_xfer, make_prepped_xfer); release() cancels a pending one."""

    __slots__ = ()
    _kind = "xfer"


class nixl_thread_sync_t(Enum):
    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """NIXL's agent configuration, argument for argument. On ferry the progress thread, thread
    count and sync mode are the engine's own (it is thread-safe and progresses on its own);
    capture_telemetry enables get_xfer_telemetry."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: list[str] = ["UCX"],
                 sync_mode: Optional[nixl_thread_sync_t] = None):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.sync_mode = sync_mode


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
        self.start_us = self.post_us = 0
        self.done_us: Optional[int] = None


class nixl_agent:
    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning(
                "Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        self.name = agent_name
        self.plugin_list = list(_PLUGINS) + list(_STORAGE)
        self._telemetry = bool(nixl_conf.capture_telemetry)
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.notifs: dict[str, list[bytes]] = {}
        self._pending: dict[str, list[bytes]] = {}
        wanted = self.plugin_list if instantiate_all else list(nixl_conf.backends)
        ferry_backends = []
        for b in wanted:
            if b not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
                continue
            for fb in _PLUGINS.get(b, []):
                if fb not in ferry_backends:
                    ferry_backends.append(fb)
        # An agent with no network backend yet (NIXL's backends=[], then create_backend) still
        # has ferry's engine underneath, with its default links.
        ferry_backends = ferry_backends or ["shm", "tcp"]
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
            if b in self.plugin_list:
                self.create_backend(b)
        self._md_region = _call(self.agent.allocate, _MD_BYTES)
        self._md_scratch = _call(self.agent.allocate, _MD_BYTES)
        self._publish_metadata()
        self.nixl_mems = {"DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG,
                          "FILE": nixlBind.FILE_SEG, "BLOCK": nixlBind.BLK_SEG,
                          "OBJ": nixlBind.OBJ_SEG, "cpu": nixlBind.DRAM_SEG,
                          "cuda": nixlBind.VRAM_SEG}
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        logger.info("Initialized NIXL agent: %s", agent_name)

    # --- plugins and backends ------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend in _STORAGE:
            return list(_STORAGE[backend])
        return ["DRAM"] if backend in _PLUGINS else []

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return self.backend_options.get(backend, {})

    def create_backend(self, backend: str, initParams: dict[str, str] = {}):
        if backend not in self.plugin_list:
            raise nixlBind.nixlNotFoundError(f"no plugin '{backend}' (ferry has {self.plugin_list})")
        self.backends.setdefault(backend, len(self.backends) + 1)
        self.backend_mems[backend] = self.get_plugin_mem_types(backend)
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

    def _desc_list(self, cls, descs, mem_type, width, is_sorted):
        """NIXL's get_xfer_descs / get_reg_descs, case for case: a list of tuples with a memory
        type; an N x 3 NumPy array of (addr, len, dev) rows with a memory type; a tensor; a
        list of tensors. What NIXL refuses it logs and answers None, as NIXL does. One ferry
        extension: a NumPy array given without a memory type is memory (a host tensor), and so
        is a list of them (NIXL's examples allocate torch tensors; NumPy's are the same to
        ferry). A 2-D array with three integer columns and a memory type is always a list of
        descriptors, as on NIXL."""
        if isinstance(descs, (list, tuple)) and not descs:
            logger.error("an empty descriptor list")
            return None
        if isinstance(descs, (list, tuple)) and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(descs[0]) != width and not (width == 4 and len(descs[0]) == 3):
                logger.error("%d-tuple list needed for %s", width,
                             "registration" if width == 4 else "transfer")
                return None
            if width == 4 and len(descs[0]) == 3:  # ferry accepts (addr, len, dev): meta ""
                descs = [d + ("",) for d in descs]
            return cls(self._mem(mem_type), descs, is_sorted)
        if _is_ndarray(descs) and mem_type is not None:
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for transfer descriptor list from numpy array")
                return None
            return cls(self._mem(mem_type), descs, is_sorted)
        extra = ("",) if width == 4 else ()
        one = self._tensor_desc(descs)
        if one is not None:
            return cls(nixlBind.DRAM_SEG, [one + extra], is_sorted)
        if isinstance(descs, (list, tuple)) and self._tensor_desc(descs[0]) is not None:
            return cls(nixlBind.DRAM_SEG, [self._tensor_desc(t) + extra for t in descs], is_sorted)
        return None

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None, *, is_sorted: bool = False):
        if isinstance(descs, nixlBind.nixlXferDList):
            return descs
        if isinstance(descs, nixlBind.nixlRegDList):
            logger.error("RegList type detected for transfer, please use XferList")
            return None
        return self._desc_list(nixlBind.nixlXferDList, descs, mem_type, 3, is_sorted)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None, *, is_sorted: bool = False):
        if isinstance(descs, nixlBind.nixlRegDList):
            return descs
        if isinstance(descs, nixlBind.nixlXferDList):
            logger.error("XferList type detected for registration, please use RegList")
            return None
        return self._desc_list(nixlBind.nixlRegDList, descs, mem_type, 4, is_sorted)

    def get_remote_descs(self, descs, mem_type: Optional[str] = None):
        """(addr, len, dev, agent name) tuples: NIXL's remote view, for prep_mem_view (VRAM
        only on NIXL, so not served here: ferry takes the list and refuses the view)."""
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if not descs or not isinstance(descs[0], tuple):
            return None
        if mem_type is None:
            logger.error("Please specify a mem type")
            return None
        if len(descs[0]) != 4:
            logger.error("4-tuple list (addr, len, dev_id, agent_name) needed for remote "
                         "descriptors")
            return None
        return nixlBind.nixlRemoteDList(self._mem(mem_type), descs)

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)

    # --- memory --------------------------------------------------------------------------

    def register_memory(self, reg_list, mem_type: Optional[str] = None,
                        backends: list[str] = [], *, is_sorted: bool = False):
        reg_descs = self.get_reg_descs(reg_list, mem_type, is_sorted=is_sorted)
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

    def query_memory(self, reg_list, backend: str,
                     mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        """NIXL's queryMem: on the POSIX plugin, for FILE descriptors (addr, len, dev, path),
        each file's size, mode and mtime as strings (NIXL's queryFileInfo), or None for a file
        that does not exist. Other plugins and memory types answer nixlNotSupportedError."""
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: "
                             f"{list(self.backends.keys())}")
        if isinstance(reg_list, nixlBind.nixlRegDList):
            seg, descs = reg_list.getType(), list(reg_list)
        else:
            seg, descs = self.nixl_mems.get(mem_type, mem_type), list(reg_list)
        if backend not in _STORAGE or seg != nixlBind.FILE_SEG:
            raise nixlBind.nixlNotSupportedError(
                f"query_memory: {backend} answers FILE queries only on POSIX here")
        out: list[Optional[dict[str, str]]] = []
        for d in descs:
            if len(d) != 4 or not isinstance(d[3], str):
                raise nixlBind.nixlInvalidParamError(
                    f"query_memory: a FILE descriptor is (addr, len, dev, path), not {d!r}")
            try:
                st = os.stat(d[3])
            except OSError:
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode),
                        "mtime": str(int(st.st_mtime))})
        return out

    def _resolve_local(self, addr, length):
        with self._lock:
            for base, blen, region in self._local:
                if base <= addr and addr + length <= base + blen:
                    return (region.id, addr - base, length)
        raise nixlBind.nixlNotFoundError(
            f"local descriptor {addr:#x}+{length} is not inside registered memory")

    def _resolve_remote(self, agent, addr, length, pumped=False):
        with self._lock:
            regions = self._remote.get(agent)
        hit = next((r for r in (regions or []) if r[0] <= addr and addr + length <= r[0] + r[1]),
                   None)
        if hit is None and not pumped:  # metadata a peer sent may be waiting to be applied
            self._pump()
            return self._resolve_remote(agent, addr, length, pumped=True)
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
        """Metadata of only the registrations that hold `descs` (a registration list, or none
        for the connection alone). A receiver adds these regions to what it knows of this
        agent; the rest stay unknown to it (nixlNotFoundError), as on NIXL."""
        reg = self.get_reg_descs(descs, "DRAM") if descs and not isinstance(
            descs, nixlBind.nixlRegDList) else descs
        wanted = []
        for d in (reg or []):
            addr, length = int(d[0]), int(d[1])
            with self._lock:
                hit = next(((b, n, r.id) for b, n, r in self._local
                            if b <= addr and addr + length <= b + n), None)
            if hit is None:
                raise nixlBind.nixlNotFoundError(
                    f"get_partial_agent_metadata: {addr:#x}+{length} is not registered")
            if hit not in wanted:
                wanted.append(hit)
        if not wanted and not inc_conn_info:
            raise nixlBind.nixlInvalidParamError(
                "get_partial_agent_metadata: no descriptors and no connection info: nothing")
        return _MAGIC + pickle.dumps({"ferry": self.agent.metadata(), "regions": wanted,
                                      "name": self.name, "partial": True})

    def add_remote_agent(self, metadata: bytes) -> str:
        if not isinstance(metadata, (bytes, bytearray)) or not metadata.startswith(_MAGIC):
            raise nixlBind.nixlInvalidParamError(
                "add_remote_agent: not metadata of a ferry NIXL agent (get_agent_metadata)")
        try:
            md = pickle.loads(bytes(metadata[len(_MAGIC):]))
            ferry_md, regions = md["ferry"], [tuple(map(int, r)) for r in md["regions"]]
            partial = bool(md.get("partial", False))
        except Exception as e:  # noqa: BLE001 - anything malformed is one error
            raise nixlBind.nixlInvalidParamError(f"add_remote_agent: malformed metadata: {e}")
        name = _call(self.agent.add_peer, ferry_md)
        with self._lock:
            if partial:  # adds to what is known of the agent, as NIXL's loadRemoteMD
                known = self._remote.setdefault(name, [])
                known.extend(r for r in regions if r not in known)
            else:
                self._remote[name] = regions
        return name

    def remove_remote_agent(self, agent: str):
        with self._lock:
            self._remote.pop(agent, None)
        _call(self.agent.remove_peer, agent)

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        self._pump()  # applies metadata that peers sent (send_local_metadata)
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
                                    port: int = DEFAULT_COMM_PORT, label: str = ""):
        if not ip_addr:
            self._central("send_partial_agent_metadata")
        blob = self.get_partial_agent_metadata(descs, inc_conn_info, backends)
        peer = self._connect(ip_addr, port)
        _call(self.agent.notify, peer, _MD_NOTIF + blob)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = ""):
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
                        backends: list[str] = [], *,
                        is_sorted: bool = False) -> nixl_prepped_dlist_handle:
        descs = self.get_xfer_descs(xfer_list, mem_type, is_sorted=is_sorted)
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
        return nixl_prepped_dlist_handle(self, handle)

    def _xfer_handle(self, xfer):
        handle = next(self._handles)
        with self._lock:
            self._xfers[handle] = xfer
        return nixl_xfer_handle(self, handle)

    @staticmethod
    def _hid(handle) -> int:
        """The number behind a handle object (or a bare number, as older NIXL returned)."""
        if isinstance(handle, _Handle):
            return handle._handle
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
        raise nixlBind.nixlInvalidParamError(f"not a NIXL handle: {handle!r}")

    def make_prepped_xfer(self, operation: str, local_xfer_side, local_indices,
                          remote_xfer_side, remote_indices,
                          notif_msg: bytes = b"", backends: list[str] = [],
                          skip_desc_merge: bool = False) -> nixl_xfer_handle:
        op = self._op(operation)
        if _is_ndarray(local_indices):
            local_indices = local_indices.tolist()
        if _is_ndarray(remote_indices):
            remote_indices = remote_indices.tolist()
        with self._lock:
            lp = self._prepped.get(self._hid(local_xfer_side))
            rp = self._prepped.get(self._hid(remote_xfer_side))
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
                        notif_msg: bytes = b"", backends: list[str] = []) -> nixl_xfer_handle:
        op = self._op(operation)
        if local_descs is None or remote_descs is None:
            raise nixlBind.nixlInvalidParamError("initialize_xfer: no descriptor list (None)")
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

    def transfer(self, handle, notif_msg: bytes = b"") -> str:
        with self._lock:
            x = self._xfers.get(self._hid(handle))
        if x is None:
            raise nixlBind.nixlInvalidParamError("transfer: unknown transfer handle")
        if x.transfer is not None and self._state(x) == "PROC":
            raise nixlBind.nixlRepostActiveError("transfer: the transfer is still active")
        msg = notif_msg or x.notif
        if isinstance(msg, str):
            msg = msg.encode()
        post = self.agent.read if x.op == "READ" else self.agent.write
        x.error = None
        x.start_us, x.done_us = time.time_ns() // 1000, None
        try:
            x.transfer = post(x.local, x.remote_agent, x.remote, notification=msg or None)
        except ferry.Error as e:
            x.transfer, x.error = None, e
            logger.error("posting the transfer failed: %s", e)
            return "ERR"
        x.post_us = time.time_ns() // 1000 - x.start_us
        return self._state(x)

    def _state(self, x):
        if x.transfer is None:
            return "ERR" if x.error is not None else "PROC"
        try:
            if x.transfer.poll() != "done":
                return "PROC"
        except ferry.Error as e:
            x.error = e
            return "ERR"
        if x.done_us is None:
            x.done_us = time.time_ns() // 1000
        return "DONE"

    def check_xfer_state(self, handle) -> str:
        with self._lock:
            x = self._xfers.get(self._hid(handle))
        if x is None:
            raise nixlBind.nixlInvalidParamError("check_xfer_state: unknown transfer handle")
        if x.transfer is None and x.error is None:
            raise nixlBind.nixlNotPostedError("check_xfer_state: the transfer was not posted")
        return self._state(x)

    def get_xfer_telemetry(self, handle) -> nixlBind.nixlXferTelemetry:
        """NIXL's per-transfer telemetry (an agent made with capture_telemetry=True): when the
        last post started, how long posting and the whole transfer took (microseconds; the
        transfer's end is when this layer first saw it done), bytes and descriptors."""
        if not self._telemetry:
            raise nixlBind.nixlNotAllowedError(
                "get_xfer_telemetry: the agent was made without capture_telemetry")
        with self._lock:
            x = self._xfers.get(self._hid(handle))
        if x is None:
            raise nixlBind.nixlInvalidParamError("get_xfer_telemetry: unknown transfer handle")
        if x.transfer is None or self._state(x) != "DONE":
            raise nixlBind.nixlNotPostedError("get_xfer_telemetry: the transfer is not done")
        return nixlBind.nixlXferTelemetry(x.start_us, x.post_us, x.done_us - x.start_us,
                                          sum(e[2] for e in x.local), len(x.local))

    def estimate_xfer_cost(self, req_handle):
        raise nixlBind.nixlNotSupportedError(
            "estimate_xfer_cost: no backend here has an analytical cost model")

    def query_xfer_backend(self, handle) -> str:
        with self._lock:
            x = self._xfers.get(self._hid(handle))
        if x is None:
            raise nixlBind.nixlInvalidParamError("query_xfer_backend: unknown transfer handle")
        return "UCX" if "UCX" in self.backends else next(iter(self.backends))

    def _release(self, kind, handle: int, quiet: bool = False):
        with self._lock:
            table = self._xfers if kind == "xfer" else self._prepped
            x = table.pop(handle, None)
        if x is None:
            if quiet:
                return
            raise nixlBind.nixlInvalidParamError(f"release: unknown {kind} handle {handle:#x}")
        if kind == "xfer" and x.transfer is not None:
            try:
                if x.transfer.poll() == "pending":
                    x.transfer.cancel()
            except ferry.Error:
                pass

    def release_xfer_handle(self, handle):
        if isinstance(handle, _Handle):
            handle.release()
        else:
            self._release("xfer", self._hid(handle))

    def release_dlist_handle(self, handle):
        if isinstance(handle, _Handle):
            handle.release()
        else:
            self._release("dlist", self._hid(handle))

    # --- notifications -------------------------------------------------------------------

    def _pump(self):
        """Takes what peers sent: metadata and its withdrawal are applied at once (NIXL's
        listener thread does it in the background), other notifications wait in _pending for
        get_new_notifs / update_notifs, so no call that merely checks metadata swallows one."""
        for peer, payload in self.agent.take_notifications():
            if payload.startswith(_MD_NOTIF):
                blob = payload[len(_MD_NOTIF):]
                try:
                    claimed = pickle.loads(blob[len(_MAGIC):]).get("name") if blob.startswith(
                        _MAGIC) else None
                except Exception:  # noqa: BLE001 - add_remote_agent names what is wrong
                    claimed = peer
                if claimed is not None and claimed != peer:
                    logger.error("metadata from %s refused: it names agent '%s'", peer, claimed)
                    continue
                try:
                    self.add_remote_agent(blob)
                except nixlBind.nixlError as e:
                    logger.error("metadata from %s refused: %s", peer, e)
                continue
            if payload.startswith(_INVALIDATE_NOTIF):
                with self._lock:
                    self._remote.pop(peer, None)
                try:
                    self.agent.remove_peer(peer)
                except ferry.Error:
                    pass
                continue
            with self._lock:
                self._pending.setdefault(peer, []).append(payload)

    def _drain(self, into):
        self._pump()
        with self._lock:
            pending, self._pending = self._pending, {}
        for peer, msgs in pending.items():
            into.setdefault(peer, []).extend(msgs)
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

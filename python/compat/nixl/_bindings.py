"""What NIXL's native module (nixl._bindings) exposes to its Python API, on ferry: the memory
and operation constants, the descriptor lists, and the exception classes, with NIXL's names.
"""

import ferry

DEFAULT_COMM_PORT = 8888  # NIXL's default listener port
NIXL_INIT_AGENT = ""

# Memory segment types (nixl_mem_t).
DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = 0, 1, 2, 3, 4
SEG_NAMES = {DRAM_SEG: "DRAM", VRAM_SEG: "VRAM", BLK_SEG: "BLOCK", OBJ_SEG: "OBJ",
             FILE_SEG: "FILE"}
# Operations (nixl_xfer_op_t).
NIXL_READ, NIXL_WRITE = 0, 1
# Statuses (nixl_status_t).
NIXL_IN_PROG = 1
NIXL_SUCCESS = 0
NIXL_ERR_NOT_POSTED = -1
NIXL_ERR_INVALID_PARAM = -2
NIXL_ERR_BACKEND = -3
NIXL_ERR_NOT_FOUND = -4
NIXL_ERR_MISMATCH = -5
NIXL_ERR_NOT_ALLOWED = -6
NIXL_ERR_REPOST_ACTIVE = -7
NIXL_ERR_UNKNOWN = -8
NIXL_ERR_NOT_SUPPORTED = -9
NIXL_ERR_REMOTE_DISCONNECT = -10
NIXL_ERR_CANCELED = -11
# Thread sync modes (nixl_thread_sync_t), cost methods (nixl_cost_t).
NIXL_THREAD_SYNC_NONE, NIXL_THREAD_SYNC_STRICT, NIXL_THREAD_SYNC_RW = 0, 1, 2
NIXL_THREAD_SYNC_DEFAULT = 3
NIXL_COST_ANALYTICAL_BACKEND = 0


class nixlError(RuntimeError):
    """The base of the classes below (NIXL raises them from its bindings)."""


class nixlNotPostedError(nixlError): ...
class nixlInvalidParamError(nixlError): ...
class nixlBackendError(nixlError): ...
class nixlNotFoundError(nixlError): ...
class nixlMismatchError(nixlError): ...
class nixlNotAllowedError(nixlError): ...
class nixlRepostActiveError(nixlError): ...
class nixlUnknownError(nixlError): ...
class nixlNotSupportedError(nixlError): ...
class nixlRemoteDisconnectError(nixlError): ...
class nixlCancelledError(nixlError): ...


# ferry's status codes -> the NIXL exception a NIXL caller expects.
_BY_CODE = {
    "InvalidArgument": nixlInvalidParamError,
    "OutOfRange": nixlInvalidParamError,
    "NotFound": nixlNotFoundError,
    "AlreadyExists": nixlNotAllowedError,
    "PermissionDenied": nixlNotAllowedError,
    "FailedPrecondition": nixlNotAllowedError,
    "Unavailable": nixlRemoteDisconnectError,
    "Cancelled": nixlCancelledError,
    "Unimplemented": nixlNotSupportedError,
    "DeadlineExceeded": nixlBackendError,
    "ResourceExhausted": nixlBackendError,
}


def translate(e: "ferry.Error") -> nixlError:
    """The NIXL exception for a ferry error, message kept."""
    cls = _BY_CODE.get(getattr(e, "code", ""), nixlBackendError)
    return cls(f"{getattr(e, 'code', 'Error')}: {getattr(e, 'message', str(e))}")


def status_of(e: "ferry.Error") -> int:
    return {
        nixlInvalidParamError: NIXL_ERR_INVALID_PARAM,
        nixlNotFoundError: NIXL_ERR_NOT_FOUND,
        nixlNotAllowedError: NIXL_ERR_NOT_ALLOWED,
        nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT,
        nixlCancelledError: NIXL_ERR_CANCELED,
        nixlNotSupportedError: NIXL_ERR_NOT_SUPPORTED,
    }.get(type(translate(e)), NIXL_ERR_BACKEND)


class nixlXferTelemetry:
    """What get_xfer_telemetry reports of one transfer: startTime (microseconds since the
    epoch), postDuration and xferDuration (microseconds), totalBytes, descCount."""

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration="
                f"{self.postDuration}, xferDuration={self.xferDuration}, totalBytes="
                f"{self.totalBytes}, descCount={self.descCount})")


def _rows(descs, width):
    """The descriptors of `descs`: an iterable of tuples, or NIXL's N x 3 NumPy array (one
    (addr, len, dev) row each; a registration list gets empty meta, as NIXL's bindings do)."""
    shape = getattr(descs, "shape", None)
    if shape is not None and hasattr(descs, "tolist"):
        if len(shape) != 2 or shape[1] != 3:
            raise nixlInvalidParamError(
                f"an array of descriptors is N x 3 (addr, len, dev), not {tuple(shape)}")
        if getattr(descs, "dtype", None) is not None and descs.dtype.kind not in "iu":
            raise nixlInvalidParamError(
                f"an array of descriptors holds integers, not {descs.dtype}")
        extra = ("",) * (width - 3)
        return [tuple(r) + extra for r in descs.tolist()]
    return [tuple(d) for d in descs]


class _DList:
    """A descriptor list: (addr, len, dev_id) for transfers, (addr, len, dev_id, meta) for
    registration, (addr, len, dev_id, agent) for a remote view, all of one memory type.
    Picklable, as NIXL's lists are."""

    _width = 3

    def __init__(self, mem_type=DRAM_SEG, descs=(), is_sorted=False):
        self._type = mem_type
        self._descs = []
        for d in _rows(descs, self._width):
            if len(d) != self._width:
                raise nixlInvalidParamError(
                    f"{type(self).__name__}: a descriptor is a {self._width}-tuple, not {d!r}")
            addr, length, dev = int(d[0]), int(d[1]), int(d[2])
            if addr < 0 or length < 0 or dev < 0:
                raise nixlInvalidParamError(f"{type(self).__name__}: negative field in {d!r}")
            self._descs.append((addr, length, dev) + tuple(d[3:]))
        self._sorted = bool(is_sorted)
        if is_sorted:
            self._descs.sort(key=lambda d: (d[2], d[0], d[1]))

    def getType(self):
        return self._type

    def descCount(self):
        return len(self._descs)

    def isSorted(self):
        return self._sorted

    def isEmpty(self):
        return not self._descs

    def __len__(self):
        return len(self._descs)

    def __getitem__(self, i):
        return self._descs[i]

    def __iter__(self):
        return iter(self._descs)

    def __eq__(self, other):
        return (type(self) is type(other) and self._type == other._type
                and self._descs == other._descs)

    def __repr__(self):
        return f"{type(self).__name__}({SEG_NAMES.get(self._type, self._type)}, {self._descs!r})"


class nixlXferDList(_DList):
    _width = 3


class nixlRegDList(_DList):
    _width = 4

    def trim(self):
        return nixlXferDList(self._type, [d[:3] for d in self._descs], self._sorted)


class nixlRemoteDList(_DList):
    _width = 4

    def trim(self):
        return nixlXferDList(self._type, [d[:3] for d in self._descs], self._sorted)

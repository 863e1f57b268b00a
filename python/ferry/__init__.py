"""ferry: disaggregated LLM serving's transfer engine, from Python.

    import ferry
    with ferry.Agent("decode-0") as a:
        buf = bytearray(1 << 20)
        region = a.register_memory(buf)          # any writable buffer, a CPU torch tensor,
                                                 # or a (ptr, length) tuple
        peer = a.connect("127.0.0.1:5555")       # or a.add_peer(metadata_bytes)
        a.read([(region, 0, 4096)], peer, [(remote_region_id, 0, 4096)]).wait(5)

Errors are exceptions: ferry.Error (with .code and .message) and one subclass per status
code (ferry.NotFound, ferry.Unavailable, ferry.PermissionDenied, ...). Calls that block or
copy release the GIL. docs/python.md has the whole API.
"""

from ferry._native import (  # noqa: F401
    Aborted,
    Agent,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Descriptor,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    Region,
    ResourceExhausted,
    Transfer,
    Unavailable,
    Unimplemented,
    Unknown,
)

__all__ = [
    "Agent", "Descriptor", "Region", "Transfer", "Error", "Cancelled", "Unknown",
    "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
    "Internal", "Unavailable", "DataLoss",
]

"""NIXL's `nixl._utils` (its src/bindings/python/nixl_utils.cpp), which NIXL's examples use for
raw host buffers: malloc_passthru (4 KiB-aligned), free_passthru, ba_buf (fills with 0xba) and
verify_transfer (asserts two buffers are equal), on ctypes."""

import ctypes as _ctypes

_IO_SIZE = 4096
_libc = _ctypes.CDLL(None)
_libc.aligned_alloc.restype = _ctypes.c_void_p
_libc.aligned_alloc.argtypes = [_ctypes.c_size_t, _ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [_ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """A buffer of `size` bytes aligned to 4 KiB (aligned_alloc rounds the size up to it)."""
    if size < 0:
        raise ValueError(f"malloc_passthru: negative size {size}")
    rounded = (size + _IO_SIZE - 1) // _IO_SIZE * _IO_SIZE or _IO_SIZE
    addr = _libc.aligned_alloc(_IO_SIZE, rounded)
    if not addr:
        raise MemoryError(f"malloc_passthru: {size} bytes")
    return addr


def free_passthru(buf: int) -> None:
    _libc.free(buf)


def ba_buf(addr: int, size: int) -> None:
    _ctypes.memset(addr, 0xBA, size)


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    assert _ctypes.string_at(addr1, size) == _ctypes.string_at(addr2, size)

"""A stand-in for CPU `torch`, as far as NIXL's examples/python use it (tensors from ones / zeros
/ zeros_like / full, row views, data_ptr, element_size, numel, get_device, is_contiguous, allclose,
any, set_default_device). Debian's python3-torch pulls in 227 packages; this lets the NIXL
examples run unchanged in ferry's tests and in scripts/run-nixl-examples. Only "cpu" exists:
set_default_device("cuda...") raises, as torch does on a machine without CUDA.
Not part of ferry: it is never installed."""

import numpy as _np

float32 = float = _np.float32
float16 = half = _np.float16
int8 = _np.int8
uint8 = _np.uint8
int32 = _np.int32
int64 = long = _np.int64


class device:
    def __init__(self, kind="cpu"):
        self.type = str(kind)

    def __str__(self):
        return self.type

    def __repr__(self):
        return f"device(type='{self.type}')"

    def __eq__(self, other):
        return str(self) == str(other)

    def __hash__(self):
        return hash(self.type)


class Tensor(_np.ndarray):
    """An ndarray with torch's pointer and device accessors."""

    @property
    def device(self):
        return device("cpu")

    def data_ptr(self):
        return self.__array_interface__["data"][0]

    def element_size(self):
        return self.itemsize

    def numel(self):
        return int(self.size)

    def get_device(self):
        return -1  # torch's answer for a CPU tensor

    def is_contiguous(self):
        return bool(self.flags["C_CONTIGUOUS"])

    def contiguous(self):
        return _np.ascontiguousarray(self).view(Tensor)


def _tensor(a):
    return _np.ascontiguousarray(a).view(Tensor)


def set_default_device(dev):
    if not str(dev).startswith("cpu"):
        raise RuntimeError(f"the torch stand-in has no device {dev!r} (CPU only)")


def ones(shape, dtype=float32, device=None):
    return _tensor(_np.ones(shape, dtype=dtype))


def zeros(shape, dtype=float32, device=None):
    return _tensor(_np.zeros(shape, dtype=dtype))


def full(shape, value, dtype=float32, device=None):
    return _tensor(_np.full(shape, value, dtype=dtype))


def arange(*args, dtype=None, device=None):
    return _tensor(_np.arange(*args, dtype=dtype))


def zeros_like(t):
    return _tensor(_np.zeros_like(t))


def ones_like(t):
    return _tensor(_np.ones_like(t))


def allclose(a, b, rtol=1e-05, atol=1e-08):
    return bool(_np.allclose(a, b, rtol=rtol, atol=atol))


def equal(a, b):
    return bool(_np.array_equal(a, b))


def any(t):  # noqa: A001 - torch's name
    return bool(_np.any(t))


def all(t):  # noqa: A001 - torch's name
    return bool(_np.all(t))

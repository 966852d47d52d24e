"""Large CPU output tensors from a cache of reused buffers (csrc/mx_cache.c).

glibc gives every large block a fresh mmap, so a new 32 MiB output costs ~8k page faults and
the zeroing of every page: on this kind of machine four times the quantization itself. The
native kernels (MX's CPU backend, MegaMHC, the DVM's large outputs) therefore take outputs of at
least ``MIN_BYTES`` from a cache of buffers that earlier outputs gave back when PyTorch freed them
(as PyTorch's caching allocator does on GPU). The tensors are ordinary PyTorch tensors (made
through DLPack); only their memory comes from here. The cache's C code is built into the MX
library (``hyperparallel._mx_native``), whose other functions this module does not use.

The cache keeps at most ``HYPERPARALLEL_MX_CACHE_MB`` MiB of free buffers (default 1024; 0
turns it off), changeable at run time with ``set_limit``; ``empty_cache`` returns them all.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch
from torch.utils.dlpack import from_dlpack

from hyperparallel.errors import ConfigError
from hyperparallel.kernels import native

LIB = native.load("hyperparallel._mx_native", {
    "hp_cache_tensor": ([ctypes.c_int64], ctypes.c_void_p),
    "hp_cache_discard": ([ctypes.c_void_p], None),
    "hp_cache_set_limit": ([ctypes.c_int64], ctypes.c_int64),
    "hp_cache_free_bytes": ([], ctypes.c_int64),
})

MIN_BYTES = 1 << 20  # below this glibc serves blocks from its heap: no faults to save

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _limit_from_env() -> int:
    raw = os.environ.get("HYPERPARALLEL_MX_CACHE_MB", "1024")
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ConfigError(f"HYPERPARALLEL_MX_CACHE_MB must be a whole number of MiB >= 0, got {raw!r}")
    return mib << 20


def set_limit(nbytes: int) -> int:
    """Keep at most `nbytes` of free buffers (0: none); returns the bytes held now."""
    global _limit
    if nbytes < 0:
        raise ValueError(f"the cache limit must be >= 0 bytes, got {nbytes}")
    if LIB is None:  # not built: every output from torch.empty
        return 0
    _limit = nbytes
    return LIB.hp_cache_set_limit(nbytes)


def limit() -> int:
    """The bytes of free buffers the cache may keep."""
    return _limit


def empty_cache() -> None:
    """Return every free buffer to the system; the limit stays as it was."""
    limit = _limit
    set_limit(0)
    set_limit(limit)


def free_bytes() -> int:
    """Bytes of free buffers the cache holds now."""
    return LIB.hp_cache_free_bytes() if LIB is not None else 0


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor; large ones reuse a cached buffer."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or _limit == 0:
        return torch.empty(shape, dtype=dtype)
    handle = LIB.hp_cache_tensor(nbytes)
    if not handle:
        raise MemoryError(f"cannot allocate {nbytes} bytes for a native kernel's output of shape {tuple(shape)}")
    try:
        flat = from_dlpack(_capsule_new(handle, b"dltensor", None))
    except BaseException:
        LIB.hp_cache_discard(handle)
        raise
    return flat.view(dtype).view(shape)


_limit = 0
if LIB is not None:
    _limit = _limit_from_env()
    LIB.hp_cache_set_limit(_limit)

"""The native library of csrc/ (``hyperparallel/_mx_native*.so``), loaded with ctypes.

It is plain C with no Python or PyTorch headers; the package build (setup.py) makes it. ``LIB``
is None when it has not been built, and the CPU backend then reports itself unavailable.
"""

from __future__ import annotations

import ctypes
import importlib.util

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SIGNATURES = {
    # kernels (csrc/mx_quant.c)
    "hp_mx_quant_rows": ([_P, _INT, _I64, _I64, _P, _P, _INT, _INT, _INT], None),
    "hp_mx_quant_cols": ([_P, _INT, _I64, _I64, _P, _P, _P, _P, _P, _INT, _INT, _INT], None),
    "hp_mx_quant_dual": ([_P, _INT, _I64, _I64, _P, _P, _P, _P, _INT, _INT, _INT], None),
    "hp_mx_dequant_rows": ([_P, _P, _I64, _I64, _INT, _P, _INT, _INT], None),
    "hp_mx_dequant_cols": ([_P, _P, _I64, _I64, _P, _P, _P, _INT, _P, _INT, _INT], None),
    "hp_mx_set_isa": ([_INT], ctypes.c_char_p),
    "hp_mx_isa": ([], ctypes.c_char_p),
    # output buffer cache (csrc/mx_cache.c)
    "hp_cache_tensor": ([_I64], _P),
    "hp_cache_discard": ([_P], None),
    "hp_cache_set_limit": ([_I64], _I64),
    "hp_cache_free_bytes": ([], _I64),
}


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("hyperparallel._mx_native")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


LIB = _load()

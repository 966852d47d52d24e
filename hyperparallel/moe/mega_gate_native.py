"""The native MegaGate kernels of csrc/mega_gate.c (``hyperparallel/_mega_gate_native*.so``),
loaded with ctypes.

Plain C with no Python or PyTorch headers, built by the package build (setup.py). ``LIB`` is None
when it has not been built; MegaGate then runs its pure-torch reference on CPU tensors.
"""

from __future__ import annotations

import ctypes
import importlib.util

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
_SIGNATURES = {
    # logits, T, E, bias, hash, score, k, groups, top_groups, norm, scale, eps,
    # weights, indices, counts, prob_sum, threads
    "hp_mega_gate_forward": ([_P, _I64, _I64, _P, _P, _INT, _INT, _INT, _INT, _INT, _F32, _F32,
                              _P, _P, _P, _P, _INT], _INT),
    # logits, T, E, indices, grad_weights, grad_prob_sum, score, k, norm, scale, eps, grad_logits, threads
    "hp_mega_gate_backward": ([_P, _I64, _I64, _P, _P, _P, _INT, _INT, _INT, _F32, _F32, _P, _INT], _INT),
    "hp_mega_gate_version": ([], _INT),
}

# The kernels' status codes (csrc/mega_gate.c)
OK, BAD_HASH_INDEX, NO_MEMORY = 0, -1, -2
# The version this module was written against: an older library (a stale build) is not used.
VERSION = 1


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("hyperparallel._mega_gate_native")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    if not hasattr(lib, "hp_mega_gate_forward"):
        return None  # the stub of an earlier build
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib if lib.hp_mega_gate_version() == VERSION else None


LIB = _load()

"""MegaGate's native kernels of csrc/mega_gate.c (``hyperparallel._mega_gate_native``), loaded by
kernels' loader. ``LIB`` is None when the library is not built or is a stale build; MegaGate then
runs its reference on CPU tensors.
"""

from __future__ import annotations

import ctypes

from hyperparallel.kernels import native

MODULE = "hyperparallel._mega_gate_native"
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
}

# The kernels' status codes (csrc/mega_gate.c)
OK, BAD_HASH_INDEX, NO_MEMORY = 0, -1, -2

LIB = native.load(MODULE, _SIGNATURES, isa="hp_mega_gate")

"""MegaMHC's native kernels of csrc/mega_mhc.c (``hyperparallel._mega_mhc_native``), loaded by
kernels' loader. ``LIB`` is None when the library is not built or is a stale build; MegaMHC then
runs its reference on CPU tensors.
"""

from __future__ import annotations

import ctypes

from hyperparallel.kernels import native

MODULE = "hyperparallel._mega_mhc_native"
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
_SIGNATURES = {
    # x, x_dt, T, n, D, fn, base, scale, head, iters, hc_eps, norm_eps, z, r, post, comb, collapsed, col_dt, threads
    "hp_mega_mhc_pre_forward": ([_P, _INT, _I64, _INT, _I64, _P, _P, _P, _INT, _INT, _F32, _F32,
                                 _P, _P, _P, _P, _P, _INT, _INT], _INT),
    # x, x_dt, T, n, D, z, r, base, scale, head, iters, hc_eps, g_post, g_comb, g_col, g_dt, gu, pre, threads
    "hp_mega_mhc_pre_backward_weights": ([_P, _INT, _I64, _INT, _I64, _P, _P, _P, _P, _INT, _INT, _F32,
                                          _P, _P, _P, _INT, _P, _P, _INT], _INT),
    # x, x_dt, T, n, D, fn, M, gz, coef, pre, g_col, g_dt, grad_x, gx_dt, grad_fn, threads
    "hp_mega_mhc_pre_backward_inputs": ([_P, _INT, _I64, _INT, _I64, _P, _INT, _P, _P, _P, _P, _INT,
                                         _P, _INT, _P, _INT], _INT),
    # block_out, bo_dt, x, x_dt, T, n, D, post, comb, out, out_dt, threads
    "hp_mega_mhc_post_forward": ([_P, _INT, _P, _INT, _I64, _INT, _I64, _P, _P, _P, _INT, _INT], _INT),
    # g, g_dt, block_out, bo_dt, x, x_dt, T, n, D, post, comb, g_bo, gbo_dt, g_x, gx_dt, g_post, g_comb, threads
    "hp_mega_mhc_post_backward": ([_P, _INT, _P, _INT, _P, _INT, _I64, _INT, _I64, _P, _P, _P, _INT, _P, _INT,
                                   _P, _P, _INT], _INT),
}

# The kernels' status codes and dtype codes (csrc/mega_mhc.c)
OK, BAD_ARGUMENT, NO_MEMORY = 0, -1, -2
DTYPE_CODES = {"float32": 0, "bfloat16": 1}
# The most streams the kernels take (MAX_STREAMS).
MAX_STREAMS = 8

LIB = native.load(MODULE, _SIGNATURES, isa="hp_mega_mhc")

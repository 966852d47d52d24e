"""MegaMHC in C (csrc/mega_mhc.c, built as ``hyperparallel._mega_mhc_native``): the table of its
functions kernels' loader types, its status and dtype codes, and ``LIB``. Unbuilt or stale, the
library is never called (``LIB`` is None) and MegaMHC takes its reference path on CPU tensors.
"""

from __future__ import annotations

from hyperparallel.kernels.native import F32, I64, INT, PTR, load

MODULE = "hyperparallel._mega_mhc_native"
_SIGNATURES = {
    # x, x_dt, T, n, D, fn, base, scale, head, iters, hc_eps, norm_eps, z, r, post, comb, collapsed, col_dt, threads
    "hp_mega_mhc_pre_forward": ([PTR, INT, I64, INT, I64, PTR, PTR, PTR, INT, INT, F32, F32,
                                 PTR, PTR, PTR, PTR, PTR, INT, INT], INT),
    # x, x_dt, T, n, D, z, r, base, scale, head, iters, hc_eps, g_post, g_comb, g_col, g_dt, gu, pre, threads
    "hp_mega_mhc_pre_backward_weights": ([PTR, INT, I64, INT, I64, PTR, PTR, PTR, PTR, INT, INT, F32,
                                          PTR, PTR, PTR, INT, PTR, PTR, INT], INT),
    # x, x_dt, T, n, D, fn, M, gz, coef, pre, g_col, g_dt, grad_x, gx_dt, grad_fn, threads
    "hp_mega_mhc_pre_backward_inputs": ([PTR, INT, I64, INT, I64, PTR, INT, PTR, PTR, PTR, PTR, INT,
                                         PTR, INT, PTR, INT], INT),
    # block_out, bo_dt, x, x_dt, T, n, D, post, comb, out, out_dt, threads
    "hp_mega_mhc_post_forward": ([PTR, INT, PTR, INT, I64, INT, I64, PTR, PTR, PTR, INT, INT], INT),
    # g, g_dt, block_out, bo_dt, x, x_dt, T, n, D, post, comb, g_bo, gbo_dt, g_x, gx_dt, g_post, g_comb, threads
    "hp_mega_mhc_post_backward": ([PTR, INT, PTR, INT, PTR, INT, I64, INT, I64, PTR, PTR, PTR, INT, PTR, INT,
                                   PTR, PTR, INT], INT),
}

# The kernels' status codes and dtype codes (csrc/mega_mhc.c)
OK, BAD_ARGUMENT, NO_MEMORY = 0, -1, -2
DTYPE_CODES = {"float32": 0, "bfloat16": 1}
# The most streams the kernels take (MAX_STREAMS).
MAX_STREAMS = 8

LIB = load(MODULE, _SIGNATURES, isa="hp_mega_mhc")

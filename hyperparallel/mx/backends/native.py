"""The MX kernels of csrc/mx_*.c (``hyperparallel._mx_native``), loaded by kernels' loader.

``LIB`` is None when the library is not built (or is a stale build); the CPU backend then reports
itself unavailable with the loader's reason.
"""

from __future__ import annotations

import ctypes

from hyperparallel.kernels import native

MODULE = "hyperparallel._mx_native"
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
}

LIB = native.load(MODULE, _SIGNATURES, isa="hp_mx")

"""The MX kernels of csrc/mx_*.c (``hyperparallel._mx_native``), loaded by kernels' loader.

``LIB`` is None when the library is not built (or is a stale build); the CPU backend then reports
itself unavailable with the loader's reason.
"""

from __future__ import annotations

from hyperparallel.kernels.native import I64, INT, PTR, load

MODULE = "hyperparallel._mx_native"
_SIGNATURES = {
    # kernels (csrc/mx_quant.c)
    "hp_mx_quant_rows": ([PTR, INT, I64, I64, PTR, PTR, INT, INT, INT], None),
    "hp_mx_quant_cols": ([PTR, INT, I64, I64, PTR, PTR, PTR, PTR, PTR, INT, INT, INT], None),
    "hp_mx_quant_dual": ([PTR, INT, I64, I64, PTR, PTR, PTR, PTR, INT, INT, INT], None),
    "hp_mx_dequant_rows": ([PTR, PTR, I64, I64, INT, PTR, INT, INT], None),
    "hp_mx_dequant_cols": ([PTR, PTR, I64, I64, PTR, PTR, PTR, INT, PTR, INT, INT], None),
}

LIB = load(MODULE, _SIGNATURES, isa="hp_mx")

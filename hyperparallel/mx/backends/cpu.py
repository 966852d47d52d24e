"""CPU backend: the native C kernels of csrc/ (OpenMP, AVX-512 or portable SIMD).

The shared library is built by the package build (setup.py) as ``hyperparallel/_mx_native*.so``
and loaded with ctypes: it is plain C, with no Python or PyTorch headers. Each operator is a
``torch.library`` custom op with a fake implementation, so torch.compile can trace through it.
"""

from __future__ import annotations

import ctypes
import importlib.util

import torch

from hyperparallel.mx.format import BLOCK_SIZE, num_blocks
from hyperparallel.mx.groups import batched_blocks, grouped_blocks, grouped_scale_rows

_IN_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ELEM_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_MODE_CODES = {"rceil": 0, "floor": 1}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SIGNATURES = {
    "hp_mx_quant_rows": [_P, _INT, _I64, _I64, _P, _P, _INT, _INT, _INT],
    "hp_mx_quant_cols": [_P, _INT, _I64, _I64, _P, _P, _P, _P, _P, _INT, _INT, _INT],
    "hp_mx_quant_dual": [_P, _INT, _I64, _I64, _P, _P, _P, _P, _INT, _INT, _INT],
    "hp_mx_dequant_rows": [_P, _P, _I64, _I64, _INT, _P, _INT, _INT],
    "hp_mx_dequant_cols": [_P, _P, _I64, _I64, _P, _P, _P, _INT, _P, _INT, _INT],
    "hp_mx_set_isa": [_INT],
    "hp_mx_isa": [],
}
_RESTYPES = {"hp_mx_set_isa": ctypes.c_char_p, "hp_mx_isa": ctypes.c_char_p}


def _load_library() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("hyperparallel._mx_native")
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name)
    return lib


_LIB = _load_library()


def _library() -> ctypes.CDLL:
    return _LIB


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "the cpu backend takes CPU tensors only"
    if _LIB is None:
        return "the native library hyperparallel._mx_native is not built (run `make setup`)"
    return None


def isa() -> str:
    """The instruction set the kernels run with: 'avx512' or 'generic'."""
    return _library().hp_mx_isa().decode()


def use_best_isa(best: bool = True) -> str:
    """Use the best kernels for this processor (default) or force the portable ones (tests)."""
    return _library().hp_mx_set_isa(int(best)).decode()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def _block_table(start, length, scale_row):
    return _ptr(start), _ptr(length), _ptr(scale_row)


@torch.library.custom_op("hyperparallel::mx_quantize_cpu", mutates_args=())
def _quantize(x: torch.Tensor, axis: int, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    shape = list(x.shape)
    n = shape[axis]
    outer = 1
    for d in shape[:axis]:
        outer *= d
    inner = x.numel() // max(outer * n, 1) if n else 1
    data = torch.empty(shape, dtype=elem_dtype)
    scale = torch.empty(shape[:axis] + [num_blocks(n)] + shape[axis + 1 :], dtype=torch.uint8)
    if x.numel() == 0:
        return data, scale.view(torch.float8_e8m0fnu)
    lib = _library()
    args = (_IN_CODES[x.dtype],)
    codes = (_ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads())
    if axis == len(shape) - 1 or inner == 1:
        lib.hp_mx_quant_rows(_ptr(x), *args, outer, n, _ptr(data), _ptr(scale), *codes)
    else:
        blocks = batched_blocks(outer, n)
        lib.hp_mx_quant_cols(_ptr(x), *args, inner, len(blocks[0]), *_block_table(*blocks), _ptr(data), _ptr(scale), *codes)
    return data, scale.view(torch.float8_e8m0fnu)


@_quantize.register_fake
def _(x, axis, elem_dtype, scale_mode):
    shape = list(x.shape)
    scale_shape = shape[:axis] + [num_blocks(shape[axis])] + shape[axis + 1 :]
    return x.new_empty(shape, dtype=elem_dtype), x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("hyperparallel::mx_quantize_dual_cpu", mutates_args=())
def _quantize_dual(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    M, K = x.shape
    row_data = torch.empty(M, K, dtype=elem_dtype)
    row_scale = torch.empty(M, num_blocks(K), dtype=torch.uint8)
    col_data = torch.empty(M, K, dtype=elem_dtype)
    col_scale = torch.empty(num_blocks(M), K, dtype=torch.uint8)
    if x.numel():
        _library().hp_mx_quant_dual(
            _ptr(x), _IN_CODES[x.dtype], M, K, _ptr(row_data), _ptr(row_scale), _ptr(col_data),
            _ptr(col_scale), _ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads(),
        )
    e8m0 = torch.float8_e8m0fnu
    return row_data, row_scale.view(e8m0), col_data, col_scale.view(e8m0)


@_quantize_dual.register_fake
def _(x, elem_dtype, scale_mode):
    M, K = x.shape
    e8m0 = torch.float8_e8m0fnu
    return (
        x.new_empty(M, K, dtype=elem_dtype), x.new_empty(M, num_blocks(K), dtype=e8m0),
        x.new_empty(M, K, dtype=elem_dtype), x.new_empty(num_blocks(M), K, dtype=e8m0),
    )


@torch.library.custom_op("hyperparallel::mx_quantize_grouped_cpu", mutates_args=())
def _quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    M, K = x.shape
    data = torch.empty(M, K, dtype=elem_dtype)
    scale = torch.zeros(grouped_scale_rows(M, len(offsets)), K, dtype=torch.uint8)
    blocks = grouped_blocks(offsets)
    if x.numel():
        _library().hp_mx_quant_cols(
            _ptr(x), _IN_CODES[x.dtype], K, len(blocks[0]), *_block_table(*blocks), _ptr(data),
            _ptr(scale), _ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads(),
        )
    return data, scale.view(torch.float8_e8m0fnu)


@_quantize_grouped.register_fake
def _(x, offsets, elem_dtype, scale_mode):
    M, K = x.shape
    return x.new_empty(M, K, dtype=elem_dtype), x.new_empty(grouped_scale_rows(M, offsets.shape[0]), K, dtype=torch.float8_e8m0fnu)


@torch.library.custom_op("hyperparallel::mx_dequantize_cpu", mutates_args=())
def _dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int, group_offsets: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype if dtype in _OUT_CODES else torch.float32
    shape = list(data.shape)
    out = torch.empty(shape, dtype=out_dtype)
    if data.numel():
        lib = _library()
        q, s = data.view(torch.uint8), scale.view(torch.uint8)
        elem, code, nt = _ELEM_CODES[data.dtype], _OUT_CODES[out_dtype], _threads()
        n = shape[axis]
        outer = 1
        for d in shape[:axis]:
            outer *= d
        inner = data.numel() // (outer * n)
        if group_offsets is None and inner == 1:
            lib.hp_mx_dequant_rows(_ptr(q), _ptr(s), outer, n, elem, _ptr(out), code, nt)
        else:
            blocks = grouped_blocks(group_offsets) if group_offsets is not None else batched_blocks(outer, n)
            lib.hp_mx_dequant_cols(_ptr(q), _ptr(s), inner, len(blocks[0]), *_block_table(*blocks), elem, _ptr(out), code, nt)
    return out if out_dtype == dtype else out.to(dtype)


@_dequantize.register_fake
def _(data, scale, axis, group_offsets, dtype):
    return data.new_empty(data.shape, dtype=dtype)


def quantize(x, axis, elem_dtype, scale_mode):
    return _quantize(x, axis, elem_dtype, scale_mode)


def quantize_dual(x, elem_dtype, scale_mode):
    return _quantize_dual(x, elem_dtype, scale_mode)


def quantize_grouped(x, offsets, elem_dtype, scale_mode):
    return _quantize_grouped(x, offsets, elem_dtype, scale_mode)


def dequantize(data, scale, axis, group_offsets, dtype):
    if dtype == torch.float64:  # float32 cannot hold every scaled value; the reference can
        from hyperparallel.mx import reference

        return reference.dequantize(data, scale, axis, group_offsets, dtype)
    transposed_view = data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous()
    if transposed_view or (group_offsets is not None and axis == 1):
        # MXTensor.t(): work on the untransposed storage (grouped blocks run along its rows)
        return _dequantize(data.t().contiguous(), scale.t().contiguous(), 1 - axis, group_offsets, dtype).t()
    return _dequantize(data.contiguous(), scale.contiguous(), axis, group_offsets, dtype)


__all__ = ["quantize", "quantize_dual", "quantize_grouped", "dequantize", "isa", "use_best_isa", "BLOCK_SIZE"]

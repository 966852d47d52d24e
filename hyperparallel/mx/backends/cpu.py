"""CPU backend: the native C kernels of csrc/ (OpenMP; AVX-512 intrinsics, or portable C for AVX2
or baseline x86-64, at the level `hyperparallel.kernels.use_isa` chooses).

The kernels live in the native library (see ``native``). Each operator is a ``torch.library``
custom op with a fake implementation, so torch.compile can trace through it. Large outputs come
from a cache of reused buffers (``hyperparallel.kernels.host_cache``): fresh pages would cost
more than the kernels.
"""

from __future__ import annotations

import torch

from hyperparallel.kernels import native as _loader
from hyperparallel.kernels.host_cache import empty as _empty
from hyperparallel.mx import outputs
from hyperparallel.mx.backends.native import LIB as _LIB
from hyperparallel.mx.backends.native import MODULE as _MODULE
from hyperparallel.mx.groups import batched_blocks, grouped_blocks

_IN_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ELEM_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_MODE_CODES = {"rceil": 0, "floor": 1}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1}

def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "the cpu backend takes CPU tensors only"
    if _LIB is None:
        return _loader.unavailable_reason(_MODULE) or f"the native library {_MODULE} is not loaded"
    return None


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def _block_table(start, length, scale_row):
    return _ptr(start), _ptr(length), _ptr(scale_row)


@torch.library.custom_op("hyperparallel::mx_quantize_cpu", mutates_args=())
def _quantize(x: torch.Tensor, axis: int, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    data, scale = outputs.quantized(x, axis, elem_dtype, _empty)
    if x.numel() == 0:
        return data, scale
    outer, n, inner = outputs.split_at_axis(x.shape, axis)
    args = (_ptr(x), _IN_CODES[x.dtype])
    codes = (_ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads())
    if inner == 1:
        _LIB.hp_mx_quant_rows(*args, outer, n, _ptr(data), _ptr(scale), *codes)
    else:
        blocks = batched_blocks(outer, n)
        _LIB.hp_mx_quant_cols(*args, inner, len(blocks[0]), *_block_table(*blocks), _ptr(data), _ptr(scale), *codes)
    return data, scale


@torch.library.custom_op("hyperparallel::mx_quantize_dual_cpu", mutates_args=())
def _quantize_dual(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    out = outputs.dual(x, elem_dtype, _empty)
    if x.numel():
        M, K = x.shape
        _LIB.hp_mx_quant_dual(
            _ptr(x), _IN_CODES[x.dtype], M, K, *(_ptr(t) for t in out),
            _ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads(),
        )
    return out


@torch.library.custom_op("hyperparallel::mx_quantize_grouped_cpu", mutates_args=())
def _quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    data, scale = outputs.grouped(x, len(offsets), elem_dtype, _empty)
    if x.numel():
        blocks = grouped_blocks(offsets)
        _LIB.hp_mx_quant_cols(
            _ptr(x), _IN_CODES[x.dtype], x.shape[1], len(blocks[0]), *_block_table(*blocks), _ptr(data),
            _ptr(scale), _ELEM_CODES[elem_dtype], _MODE_CODES[scale_mode], _threads(),
        )
    return data, scale


@torch.library.custom_op("hyperparallel::mx_dequantize_cpu", mutates_args=())
def _dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int, group_offsets: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype if dtype in _OUT_CODES else torch.float32
    out = outputs.dequantized(data, out_dtype, _empty)
    if data.numel():
        outer, n, inner = outputs.split_at_axis(data.shape, axis)
        elem, code, nt = _ELEM_CODES[data.dtype], _OUT_CODES[out_dtype], _threads()
        if group_offsets is None and inner == 1:
            _LIB.hp_mx_dequant_rows(_ptr(data), _ptr(scale), outer, n, elem, _ptr(out), code, nt)
        else:
            blocks = grouped_blocks(group_offsets) if group_offsets is not None else batched_blocks(outer, n)
            _LIB.hp_mx_dequant_cols(_ptr(data), _ptr(scale), inner, len(blocks[0]), *_block_table(*blocks), elem, _ptr(out), code, nt)
    return out if out_dtype == dtype else out.to(dtype)


# (their fake implementations, for torch.compile: the outputs, unfilled)
outputs.register_fakes(_quantize, _quantize_dual, _quantize_grouped, _dequantize)


def quantize(x, axis, elem_dtype, scale_mode):
    return _quantize(x, axis, elem_dtype, scale_mode)


def quantize_dual(x, elem_dtype, scale_mode):
    return _quantize_dual(x, elem_dtype, scale_mode)


def quantize_grouped(x, offsets, elem_dtype, scale_mode):
    return _quantize_grouped(x, offsets, elem_dtype, scale_mode)


def dequantize(data, scale, axis, group_offsets, dtype):
    transposed_view = data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous()
    if transposed_view or (group_offsets is not None and axis == 1):
        # MXTensor.t(): work on the untransposed storage (grouped blocks run along its rows)
        return _dequantize(data.t().contiguous(), scale.t().contiguous(), 1 - axis, group_offsets, dtype).t()
    return _dequantize(data.contiguous(), scale.contiguous(), axis, group_offsets, dtype)


__all__ = ["quantize", "quantize_dual", "quantize_grouped", "dequantize"]

"""Dynamic MX quantization: one axis, both axes in one pass, grouped rows (MoE).

Quantization is not differentiable: inputs are detached (hyperparallel.lowp adds autograd).
"""

from __future__ import annotations

import torch

from hyperparallel.errors import ShapeError
from hyperparallel.mx.backends import get_backend
from hyperparallel.mx.format import (
    BLOCK_SIZE,
    check_block_size,
    check_input,
    check_scale_mode,
    element_format,
    normalize_axis,
)
from hyperparallel.mx.groups import check_offsets
from hyperparallel.mx.tensor import MXTensor


def _check(x, scale_mode, elem_dtype, block_size, what="x"):
    check_input(x, what)
    check_scale_mode(scale_mode)
    element_format(elem_dtype)
    check_block_size(block_size)


def quantize(
    x: torch.Tensor,
    axis: int = -1,
    *,
    scale_mode: str = "rceil",
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = BLOCK_SIZE,
    backend: str | None = None,
) -> MXTensor:
    """Quantize `x` (fp32, bf16 or fp16) in blocks of 32 along `axis`."""
    _check(x, scale_mode, elem_dtype, block_size)
    axis = normalize_axis(axis, x.dim())
    data, scale = get_backend(backend, x.device).quantize(x.detach(), axis, elem_dtype, scale_mode)
    return MXTensor(data, scale, axis, scale_mode)


def quantize_dual(
    x: torch.Tensor,
    *,
    scale_mode: str = "rceil",
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = BLOCK_SIZE,
    backend: str | None = None,
) -> tuple[MXTensor, MXTensor]:
    """Row-wise (axis -1) and column-wise (axis 0) copies of a 2-D `x` from one pass over it."""
    _check(x, scale_mode, elem_dtype, block_size)
    if x.dim() != 2:
        raise ShapeError(f"quantize_dual takes a 2-D tensor, got shape {tuple(x.shape)}")
    rd, rs, cd, cs = get_backend(backend, x.device).quantize_dual(x.detach(), elem_dtype, scale_mode)
    return MXTensor(rd, rs, 1, scale_mode), MXTensor(cd, cs, 0, scale_mode)


def quantize_grouped(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    scale_mode: str = "rceil",
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = BLOCK_SIZE,
    backend: str | None = None,
) -> MXTensor:
    """Column-wise blocks of a 2-D `x` whose rows are grouped (tokens sorted by expert).

    `offsets` are the cumulative group ends (last == x.shape[0]); blocks restart at every group
    start, groups may have any size, empty ones included. The scale layout is described in
    ``hyperparallel.mx.groups``.
    """
    _check(x, scale_mode, elem_dtype, block_size)
    if x.dim() != 2:
        raise ShapeError(f"quantize_grouped takes a 2-D tensor, got shape {tuple(x.shape)}")
    check_offsets(offsets, x.shape[0])
    data, scale = get_backend(backend, x.device).quantize_grouped(x.detach(), offsets, elem_dtype, scale_mode)
    # a copy: MoE code often reuses its routing buffers, which must not change this tensor
    return MXTensor(data, scale, 0, scale_mode, group_offsets=offsets.detach().clone())


def dequantize(mx: MXTensor, dtype: torch.dtype = torch.float32, *, backend: str | None = None) -> torch.Tensor:
    """The values of `mx` in `dtype` (each rounded once from its exact value): `MXTensor.dequantize`."""
    return mx.dequantize(dtype, backend=backend)

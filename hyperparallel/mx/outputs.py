"""Output tensors of the quantizers, allocated by shape rules every backend shares.

The backends' real implementations fill these; their fake implementations (for torch.compile)
return them unfilled, so the two can never disagree on a shape or a dtype.
"""

from __future__ import annotations

import math

import torch

from hyperparallel.mx.format import SCALE_DTYPE, num_blocks
from hyperparallel.mx.groups import grouped_scale_rows


def split_at_axis(shape, axis: int) -> tuple[int, int, int]:
    """(outer, n, inner): the tensor seen as [outer, n, inner] around dimension `axis`."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def quantized(x: torch.Tensor, axis: int, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = list(x.shape)
    scale_shape = shape[:axis] + [num_blocks(shape[axis])] + shape[axis + 1 :]
    return x.new_empty(shape, dtype=elem_dtype), x.new_empty(scale_shape, dtype=SCALE_DTYPE)


def dual(x: torch.Tensor, elem_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (*quantized(x, 1, elem_dtype), *quantized(x, 0, elem_dtype))


def grouped(x: torch.Tensor, num_groups: int, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale rows that no block uses must read as byte 0, so the scales start zeroed."""
    M, K = x.shape
    return x.new_empty(M, K, dtype=elem_dtype), x.new_zeros(grouped_scale_rows(M, num_groups), K, dtype=torch.uint8).view(SCALE_DTYPE)


def dequantized(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=dtype)

"""Output tensors of the quantizers, allocated by shape rules every backend shares.

The backends' real implementations fill these; their fake implementations (for torch.compile)
return them unfilled, so the two can never disagree on a shape or a dtype. ``empty(shape, dtype)``
lets a backend choose where the memory comes from (the CPU backend's buffer cache); by default
it is ``new_empty`` on the input's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hyperparallel.mx.format import SCALE_DTYPE, num_blocks
from hyperparallel.mx.groups import grouped_scale_rows


def split_at_axis(shape, axis: int) -> tuple[int, int, int]:
    """(outer, n, inner): the tensor seen as [outer, n, inner] around dimension `axis`."""
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


Empty = Callable[[list[int], torch.dtype], torch.Tensor]


def _like(t: torch.Tensor) -> Empty:
    return lambda shape, dtype: t.new_empty(shape, dtype=dtype)


def quantized(x: torch.Tensor, axis: int, elem_dtype: torch.dtype, empty: Empty | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    empty = empty or _like(x)
    shape = list(x.shape)
    scale_shape = shape[:axis] + [num_blocks(shape[axis])] + shape[axis + 1 :]
    return empty(shape, elem_dtype), empty(scale_shape, SCALE_DTYPE)


def dual(x: torch.Tensor, elem_dtype: torch.dtype, empty: Empty | None = None) -> tuple[torch.Tensor, ...]:
    return (*quantized(x, 1, elem_dtype, empty), *quantized(x, 0, elem_dtype, empty))


def grouped(x: torch.Tensor, num_groups: int, elem_dtype: torch.dtype, empty: Empty | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale rows that no block uses must read as byte 0, so the scales start zeroed."""
    empty = empty or _like(x)
    M, K = x.shape
    scale = empty([grouped_scale_rows(M, num_groups), K], torch.uint8).zero_()
    return empty([M, K], elem_dtype), scale.view(SCALE_DTYPE)


def dequantized(data: torch.Tensor, dtype: torch.dtype, empty: Empty | None = None) -> torch.Tensor:
    return (empty or _like(data))(list(data.shape), dtype)


def register_fakes(quantize, quantize_dual, quantize_grouped, dequantize) -> None:
    """A backend's four custom ops (the backend functions' arguments, in order) get their fake
    implementations: the outputs by these rules, unfilled."""
    quantize.register_fake(lambda x, axis, elem_dtype, scale_mode: quantized(x, axis, elem_dtype))
    quantize_dual.register_fake(lambda x, elem_dtype, scale_mode: dual(x, elem_dtype))
    quantize_grouped.register_fake(lambda x, offsets, elem_dtype, scale_mode: grouped(x, offsets.shape[0], elem_dtype))
    dequantize.register_fake(lambda data, scale, axis, group_offsets, dtype: dequantized(data, dtype))

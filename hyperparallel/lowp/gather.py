"""MXWeightGather: an MXFP8 weight gathered by FSDP as MX data, not as its values.

A weight that only MXFP8 products read (MXLinear's) needs, per step, two MX copies: blocked along
its last dim K for forward, and along dim -2 (N) for the input gradient. Under FSDP each rank
holds rows (dim 0) of the weight; this codec (the protocol of `hyperparallel.fsdp.gather`) has
each rank quantize its own rows, and the all-gather moves FP8 elements and E8M0 scales, 1 + 1/32
bytes per element, instead of 2 (bf16) or 4 (float32): forward gathers the copy along K, backward
the copy along N (fsdp/group.py, [Note: what a gather carries]).

Exact: a block of 32 that lies within one rank's rows is quantized from the same 32 values as in
the whole weight, so the gathered copies are bitwise what quantizing the gathered weight gives.
Blocks along K always do (a row is never split). Blocks along N of a 2-D weight run across rows,
so its shards' boundaries fall on multiples of 32 rows (`row_alignment`: fsdp aligns this
parameter's shards so, whatever the group's `align`); a 3-D weight [E, N, K] is split by
experts, whose N never is.
Quantized from the shard itself, in the parameter's dtype: the float32 master weights under bf16
mixed precision, as the weight's own copies are quantized without FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hyperparallel import mx
from hyperparallel.mx.tensor import MXTensor

_BLOCK = mx.BLOCK_SIZE


def _axis(purpose: str, ndim: int) -> int:
    return ndim - 1 if purpose == "forward" else ndim - 2


def _scale_shape(purpose: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    axis = _axis(purpose, len(shape))
    return (*shape[:axis], -(-shape[axis] // _BLOCK), *shape[axis + 1:])


class MXWeightGather:
    """The two MX copies of one weight, gathered; `copies[purpose]` until FSDP frees them."""

    def __init__(self, scale_mode: str):
        self.scale_mode = scale_mode
        self.copies: dict[str, MXTensor] = {}

    def fits(self, shape: torch.Size) -> bool:
        return len(shape) >= 2

    def row_alignment(self, shape: torch.Size) -> int:
        # along N of a 2-D weight a block spans 32 rows: every rank's must start on a block;
        # a 3-D weight's rows are experts, whose N no shard splits
        return _BLOCK if len(shape) == 2 else 1

    def pieces(self, purpose: str, shape: torch.Size) -> list[tuple[torch.dtype, Callable[[int], int]]]:
        rest = tuple(shape[1:])
        return [(torch.float8_e4m3fn, lambda rows: rows * math.prod(rest)),
                (torch.float8_e8m0fnu, lambda rows: math.prod(_scale_shape(purpose, (rows, *rest))) if rows else 0)]

    def encode(self, purpose: str, shard: torch.Tensor) -> list[torch.Tensor]:
        if shard.shape[0] == 0:
            return [torch.empty(0, dtype=torch.float8_e4m3fn, device=shard.device),
                    torch.empty(0, dtype=torch.float8_e8m0fnu, device=shard.device)]
        q = mx.quantize(shard, _axis(purpose, shard.dim()), scale_mode=self.scale_mode)
        return [q.data.reshape(-1), q.scale.reshape(-1)]

    def decoded(self, purpose: str, shape: torch.Size, pieces: list[torch.Tensor]) -> None:
        data, scale = pieces
        self.copies[purpose] = MXTensor(data.view(shape), scale.view(_scale_shape(purpose, tuple(shape))),
                                        _axis(purpose, len(shape)), self.scale_mode)

    def release(self) -> None:
        self.copies.clear()


def check_has_values(weight: torch.Tensor, what: str) -> None:
    """A weight FSDP gathers as MX data has no values of its own: quantizing it would read freed
    memory. Raised where a module runs outside the hooks that gather its copies."""
    if not torch.compiler.is_compiling() and weight.numel() and weight.untyped_storage().nbytes() == 0:
        raise RuntimeError(f"{what}: its weight has no values here (FSDP gathers it as MX data, for the "
                           f"module's forward and backward under its FSDP hooks)")

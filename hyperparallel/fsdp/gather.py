"""What an all-gather carries: pieces of a byte buffer, each a parameter's values or its encoding.

A group's all-gather moves one flat buffer of bytes in which every rank has a slot of the same
padded length (collectives.py, `GatherViews`). A slot holds pieces, one after another, each
starting on a 16-byte boundary so that it can be viewed in any dtype:

- a parameter's values, cast to its full copy's dtype (MixedPrecision's param_dtype, or its own
  for a parameter tagged `keep_param_dtype`): one piece per parameter, so a group gathers bf16
  weights and float32 norms in one collective;
- or what a `GatherCodec` makes of the rank's shard, for a parameter whose every reader takes that
  form instead of the values (MXFP8 products: FP8 elements and E8M0 scales, lowp/gather.py): the
  pieces a step needs for one purpose, "forward" or "backward", each gathered when it is needed.

A piece is laid out as a parameter is (param.py): every rank holds `rank_numels[r]` of its
elements, and the ranks' parts, in rank order, are the whole piece. So a codec's pieces must be
made from each rank's rows alone and concatenate to what encoding the whole parameter gives:
MX blocks that never straddle two ranks: the codec's `row_alignment`, which the parameter's
shards are aligned to (a 2-D MXFP8 weight: 32 rows; the other parameters of its group keep the
group's `align`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hyperparallel.fsdp.geometry import padded_rows

PURPOSES = ("forward", "backward")


class GatherCodec(Protocol):
    """Gathers a parameter in another form than its values (set by `set_gather_codec`).

    The group calls, per purpose it gathers for: `encode` on this rank's shard (the tensors to
    send, flattened, in `pieces`' order), then `decoded` with the whole pieces (flat, every rank's
    part in rank order), valid until `release`, which the group calls when it frees the
    parameter. The full Parameter is then never given values: only the codec's readers use it."""

    def pieces(self, purpose: str, shape: torch.Size) -> list[tuple[torch.dtype, Callable[[int], int]]]:
        """Per tensor `encode` makes for `purpose` of a parameter of `shape`: its dtype, and how
        many elements a shard of a given number of rows makes of it."""
        ...

    def fits(self, shape: torch.Size) -> bool:
        """Whether a parameter of `shape` can be gathered in this form at all."""
        ...

    def row_alignment(self, shape: torch.Size) -> int:
        """Rows every shard boundary must fall on a multiple of, so that each rank's rows encode
        to their part of the whole (fsdp raises the group's `align` to it for this parameter)."""
        ...

    def encode(self, purpose: str, shard: torch.Tensor) -> list[torch.Tensor]: ...

    def decoded(self, purpose: str, shape: torch.Size, pieces: list[torch.Tensor]) -> None: ...

    def release(self) -> None: ...


# A codec's alignment may pad a parameter's slots (a [1024, K] weight over 64 ranks: 16 rows each,
# 32 with whole blocks, half the ranks none); beyond an eighth more rows per slot the padding
# (gathered, reduce-scattered, and the optimizer's state on the ranks holding them) costs more
# than the encoding saves, and the parameter is gathered as its values instead.
MAX_CODEC_PADDING = 1.125


def codec_align(codec: GatherCodec | None, shape: torch.Size, world: int, geometry: str, align: int) -> int | None:
    """The rows a parameter of `shape` sharded with `codec` is aligned to (a multiple of `align`),
    or None where it is gathered as its values: no codec, one that does not fit it, or one whose
    alignment would pad its slots by more than MAX_CODEC_PADDING."""
    if codec is None or not codec.fits(shape):
        return None
    aligned = math.lcm(align, codec.row_alignment(shape))
    rows = shape[0] if len(shape) else 1
    if padded_rows(rows, world, geometry, aligned) > MAX_CODEC_PADDING * padded_rows(rows, world, geometry, align):
        return None
    return aligned


ALIGN_BYTES = 16  # where every piece starts in a slot: any dtype's view of it is then aligned


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class Piece:
    """A piece of one all-gather: its dtype and every rank's element count, rank 0 first."""

    dtype: torch.dtype
    rank_numels: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return sum(self.rank_numels)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of every rank's slot for this piece: the longest part, aligned."""
        return aligned(max(self.rank_numels) * self.itemsize)

    @functools.cached_property
    def runs(self) -> list[Run]:
        return runs_of(list(self.rank_numels))


@dataclass(frozen=True)
class Run:
    """Consecutive ranks that hold the same number of one parameter's elements. In a [world, slot]
    communication buffer their pieces form one strided [count, numel] view; in the flattened
    parameter, one contiguous block. A parameter has one run when its rows divide evenly, and
    otherwise at most three that hold elements (the longer shards, shorter ones, a last short
    one; tests/fsdp/test_views.py) and perhaps one of empty shards, whatever the number of
    ranks: what the group's copies are counted in."""

    first: int  # the first rank of the run
    count: int  # ranks in the run
    numel: int  # elements each of them holds
    start: int  # where the first rank's elements begin in the flattened parameter

    @property
    def shape(self) -> tuple[int, ...]:
        """Of the run's views in the copies: [ranks, elements], or [elements] for one rank."""
        return (self.numel,) if self.count == 1 else (self.count, self.numel)


def runs_of(rank_numels: list[int]) -> list[Run]:
    runs, start, rank = [], 0, 0
    while rank < len(rank_numels):
        numel, count = rank_numels[rank], 1
        while rank + count < len(rank_numels) and rank_numels[rank + count] == numel:
            count += 1
        runs.append(Run(rank, count, numel, start))
        start += count * numel
        rank += count
    return runs

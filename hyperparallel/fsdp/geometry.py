"""Which rows of a parameter each rank holds: non-uniform shard geometry along dim 0.

- ``chunk``: torch.chunk's sizes, ceil(n / W) rows per rank until the rows run out
  (7 rows on 4 ranks -> 2, 2, 2, 1; 5 on 4 -> 2, 2, 1, 0).
- ``balanced``: the first n mod W ranks hold one row more (5 on 4 -> 2, 1, 1, 1).
- ``align``: shard boundaries fall on multiples of `align` rows (the last one may end at n),
  so that, say, 32-row MXFP8 column blocks never straddle two ranks; geometries then deal out
  whole groups of `align` rows.

A shard is described by the parameter's global shape, its first row and its row count: what a
checkpoint records, and all a loader needs to reshard into another geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperparallel.errors import ConfigError

GEOMETRIES = ("chunk", "balanced")


@dataclass(frozen=True)
class ShardInfo:
    global_shape: torch.Size
    offset: int  # first row (dim 0) this rank holds
    length: int  # rows this rank holds; 0 for an empty shard

    @property
    def rows(self) -> int:
        return self.global_shape[0] if len(self.global_shape) else 1


def _check(world_size: int, geometry: str, align: int) -> None:
    if geometry not in GEOMETRIES:
        raise ConfigError(f"shard geometry must be one of {GEOMETRIES}, got {geometry!r}")
    if not isinstance(align, int) or align < 1:
        raise ConfigError(f"shard align must be a whole number of rows >= 1, got {align!r}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")


def shard_ranges(rows: int, world_size: int, geometry: str = "chunk", align: int = 1) -> list[tuple[int, int]]:
    """(offset, length) of every rank's shard of `rows` rows, rank 0 first."""
    _check(world_size, geometry, align)
    groups = -(-rows // align)  # whole groups of `align` rows, the last one possibly short
    if geometry == "chunk":
        per_rank = -(-groups // world_size)
        counts = [max(0, min(per_rank, groups - r * per_rank)) for r in range(world_size)]
    else:
        base, extra = divmod(groups, world_size)
        counts = [base + (r < extra) for r in range(world_size)]
    ranges, start = [], 0
    for count in counts:
        end = min(start + count * align, rows)
        ranges.append((start, end - start))
        start = end
    return ranges


def shard_of(shape, rank: int, world_size: int, geometry: str = "chunk", align: int = 1) -> ShardInfo:
    """The shard of a parameter of `shape` that `rank` holds."""
    shape = torch.Size(shape)
    rows = shape[0] if len(shape) else 1  # a 0-d parameter is one row
    offset, length = shard_ranges(rows, world_size, geometry, align)[rank]
    return ShardInfo(shape, offset, length)


def padded_rows(rows: int, world_size: int, geometry: str = "chunk", align: int = 1) -> int:
    """Rows every rank's slot in a flat communication buffer holds: the longest shard."""
    return max(length for _, length in shard_ranges(rows, world_size, geometry, align))

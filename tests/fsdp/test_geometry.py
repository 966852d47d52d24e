"""Shard geometry: the issue's examples, and the invariants on any shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hyperparallel.errors import ConfigError
from hyperparallel.fsdp.geometry import ShardInfo, padded_rows, shard_of, shard_ranges


def lengths(rows, world, geometry, align=1):
    return [length for _, length in shard_ranges(rows, world, geometry, align)]


def test_the_examples():
    assert lengths(7, 4, "chunk") == [2, 2, 2, 1]
    assert lengths(5, 4, "chunk") == [2, 2, 1, 0]
    assert lengths(5, 4, "balanced") == [2, 1, 1, 1]
    assert lengths(7, 4, "chunk") == [len(c) for c in torch.arange(7).chunk(4)]
    assert lengths(100, 3, "chunk", align=32) == [64, 36, 0]
    assert lengths(100, 3, "balanced", align=32) == [64, 32, 4]
    assert lengths(0, 3, "balanced") == [0, 0, 0]


@given(rows=st.integers(0, 500), world=st.integers(1, 9), geometry=st.sampled_from(["chunk", "balanced"]),
       align=st.sampled_from([1, 2, 8, 32]))
def test_shards_tile_the_rows_in_rank_order_on_aligned_boundaries(rows, world, geometry, align):
    ranges = shard_ranges(rows, world, geometry, align)
    assert len(ranges) == world
    start = 0
    for offset, length in ranges:
        assert offset == start and length >= 0
        assert offset % align == 0 or offset == rows
        start += length
    assert start == rows
    if geometry == "chunk":
        torch_sizes = [len(c) for c in torch.arange(-(-rows // align)).chunk(world)] if rows else []
        assert [-(-n // align) for n in lengths(rows, world, geometry, align)][: len(torch_sizes)] == torch_sizes
    else:
        groups = [-(-n // align) for n in lengths(rows, world, geometry, align)]
        assert max(groups) - min(groups) <= 1
    assert padded_rows(rows, world, geometry, align) == max(lengths(rows, world, geometry, align))


def test_shard_info_of_any_parameter_shape():
    assert shard_of((5, 3), 1, 4, "balanced") == ShardInfo(torch.Size([5, 3]), 2, 1)
    assert shard_of((5,), 3, 4, "chunk") == ShardInfo(torch.Size([5]), 5, 0)  # an empty shard
    scalar = shard_of((), 0, 2)
    assert scalar.rows == 1 and (scalar.offset, scalar.length) == (0, 1)


@pytest.mark.parametrize("args, message", [
    ((4, 2, "strided"), "geometry must be one of"),
    ((4, 2, "chunk", 0), "align must be a whole number"),
    ((4, 0, "chunk"), "world size must be >= 1"),
])
def test_bad_geometry_is_named(args, message):
    with pytest.raises(ConfigError, match=message):
        shard_ranges(*args)

"""Fully sharded data parallelism with non-uniform sharding (docs/fsdp.md)."""

from hyperparallel.fsdp.fully_shard import (
    MixedPrecision,
    ShardPlacement,
    clip_grad_norm_,
    fully_shard,
    set_requires_gradient_sync,
    shard_info,
    shard_placement,
)
from hyperparallel.fsdp.geometry import GEOMETRIES, ShardInfo, padded_rows, shard_of, shard_ranges

__all__ = [
    "GEOMETRIES",
    "MixedPrecision",
    "ShardInfo",
    "ShardPlacement",
    "clip_grad_norm_",
    "fully_shard",
    "padded_rows",
    "set_requires_gradient_sync",
    "shard_of",
    "shard_info",
    "shard_placement",
    "shard_ranges",
]

"""Fully sharded data parallelism with non-uniform sharding (docs/fsdp.md).

geometry.py: which rows each rank holds; gather.py: what an all-gather carries (each
parameter's values in its dtype, or a codec's encoding of its rows); param.py: a sharded
parameter (its shard and full copy, the tags that keep its dtype or give it a codec) and the shard tag (`shard_info` / `set_shard_info`: a part's place in the whole, which
`parallel` sets too); group.py: a module's parameters together, their all-gather and
reduce-scatter, and the group's lifecycle; schedule.py: the forward/backward hooks and
prefetching; api.py: fully_shard and the calls around it.
"""

from hyperparallel.fsdp.api import (
    clip_grad_norm_,
    column_shards,
    fully_shard,
    reduce_accumulated_gradients,
    run_as_pipeline_stage,
    set_column_shards,
    set_requires_gradient_sync,
    shard_placement,
)
from hyperparallel.fsdp.gather import GatherCodec
from hyperparallel.fsdp.geometry import GEOMETRIES, ShardInfo, padded_rows, shard_of, shard_ranges
from hyperparallel.fsdp.param import (
    MixedPrecision,
    ShardPlacement,
    keep_param_dtype,
    set_gather_codec,
    set_shard_info,
    shard_info,
)

__all__ = [
    "GEOMETRIES",
    "GatherCodec",
    "MixedPrecision",
    "ShardInfo",
    "ShardPlacement",
    "clip_grad_norm_",
    "column_shards",
    "fully_shard",
    "keep_param_dtype",
    "padded_rows",
    "reduce_accumulated_gradients",
    "run_as_pipeline_stage",
    "set_column_shards",
    "set_gather_codec",
    "set_requires_gradient_sync",
    "set_shard_info",
    "shard_of",
    "shard_info",
    "shard_placement",
    "shard_ranges",
]

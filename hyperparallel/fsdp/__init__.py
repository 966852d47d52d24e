"""Fully sharded data parallelism with non-uniform sharding. So far: the shard geometry
(`fully_shard` itself is the rest of its issue)."""

from hyperparallel.fsdp.geometry import GEOMETRIES, ShardInfo, padded_rows, shard_info, shard_ranges

__all__ = ["GEOMETRIES", "ShardInfo", "padded_rows", "shard_info", "shard_ranges"]

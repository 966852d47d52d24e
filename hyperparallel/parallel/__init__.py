"""Parallelism plans and activation recompute."""

from hyperparallel.parallel.fsdp_plan import shard_model
from hyperparallel.parallel.recompute import apply_recompute

__all__ = ["apply_recompute", "shard_model"]

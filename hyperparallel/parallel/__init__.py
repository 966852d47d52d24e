"""Parallelism plans and activation recompute."""

from hyperparallel.parallel.fsdp_plan import shard_model
from hyperparallel.parallel.recompute import MODES as RECOMPUTE_MODES
from hyperparallel.parallel.recompute import apply_recompute

__all__ = ["RECOMPUTE_MODES", "apply_recompute", "shard_model"]

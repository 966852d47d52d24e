"""Parallelism plans and activation recompute."""

from hyperparallel.parallel.expert_parallel import ExpertLayout, apply_expert_parallel, expert_layout
from hyperparallel.parallel.fsdp_plan import shard_model
from hyperparallel.parallel.recompute import MODES as RECOMPUTE_MODES
from hyperparallel.parallel.recompute import apply_recompute

__all__ = ["RECOMPUTE_MODES", "ExpertLayout", "apply_expert_parallel", "apply_recompute", "expert_layout", "shard_model"]

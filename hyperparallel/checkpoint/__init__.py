"""Checkpoints of sharded training state through torch.distributed.checkpoint."""

from hyperparallel.checkpoint.sharded import as_sharded, load_planner, save_planner, unwrap, wrap_state

__all__ = ["as_sharded", "load_planner", "save_planner", "unwrap", "wrap_state"]

"""Parallelism plans and activation recompute."""

from hyperparallel.parallel.recompute import apply_recompute

__all__ = ["apply_recompute"]

"""Optimizers: Muon (with AdamW groups) in one object, param-group rules, LR schedules."""

from hyperparallel.optim.muon import Muon, orthogonalize
from hyperparallel.optim.param_groups import build_optimizer, split_for_muon
from hyperparallel.optim.schedules import build_scheduler, lr_factor

__all__ = ["Muon", "build_optimizer", "build_scheduler", "lr_factor", "orthogonalize", "split_for_muon"]

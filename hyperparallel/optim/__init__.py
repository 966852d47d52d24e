"""Optimizers: Muon (with AdamW groups) in one object, param-group rules, LR schedules, and their
settings (OptimizerConfig, SchedulerConfig: the trainer's `optimizer:` and `scheduler:` sections)."""

from hyperparallel.optim.config import OptimizerConfig, SchedulerConfig
from hyperparallel.optim.muon import Muon, orthogonalize
from hyperparallel.optim.param_groups import OPTIMIZER_NAMES, build_optimizer, split_for_muon
from hyperparallel.optim.schedules import SCHEDULE_KINDS, build_scheduler, lr_factor, validate_schedule

__all__ = [
    "OPTIMIZER_NAMES",
    "SCHEDULE_KINDS",
    "Muon",
    "OptimizerConfig",
    "SchedulerConfig",
    "build_optimizer",
    "build_scheduler",
    "lr_factor",
    "orthogonalize",
    "split_for_muon",
    "validate_schedule",
]

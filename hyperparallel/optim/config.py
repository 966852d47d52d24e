"""The settings of optim's two builders: OptimizerConfig for `build_optimizer`, SchedulerConfig
for `build_scheduler`. They are the trainer's `optimizer:` and `scheduler:` sections as they are,
so each default and each range is written here once (the ranges: `bounds`, `validate_schedule`).
"""

from __future__ import annotations

from pydantic import model_validator

from hyperparallel.optim import bounds
from hyperparallel.optim.muon import NS_STEPS
from hyperparallel.optim.param_groups import OPTIMIZER_NAMES
from hyperparallel.optim.schedules import SCHEDULE_KINDS, validate_schedule
from hyperparallel.schema import Section, choice


class OptimizerConfig(Section):
    """AdamW ("adamw") or Muon with AdamW groups ("muon"); `betas` and `eps` are AdamW's,
    `momentum`, `nesterov` and `ns_steps` Muon's."""

    name: choice(OPTIMIZER_NAMES) = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_lr: float | None = None  # Muon's own lr (default: lr)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = NS_STEPS

    @model_validator(mode="after")
    def _in_range(self):
        # (a ConfigError is a ValueError: pydantic reports it with the section's other problems)
        bounds.check("lr", self.lr)
        bounds.check("weight_decay", self.weight_decay)
        if self.muon_lr is not None:
            bounds.check("lr", self.muon_lr, name="muon_lr")
        bounds.check("betas", self.betas)
        bounds.check("adamw_eps", self.eps, name="eps")
        if self.name == "muon":  # (AdamW ignores Muon's settings)
            bounds.check("momentum", self.momentum)
            bounds.check("nesterov", self.nesterov)
            bounds.check("ns_steps", self.ns_steps)
        return self


class SchedulerConfig(Section):
    """Linear warmup, then constant, linear or cosine decay to `min_lr_ratio` of the lr."""

    kind: choice(SCHEDULE_KINDS) = "cosine"
    warmup_steps: int | None = None  # null: 10% of the run's steps
    min_lr_ratio: float = 0.1

    @model_validator(mode="after")
    def _in_range(self):
        validate_schedule(self.kind, self.warmup_steps or 0, None, self.min_lr_ratio)
        return self

    def warmup(self, total_steps: int) -> int:
        """The warmup steps of a run of `total_steps` (null: a tenth of them)."""
        return total_steps // 10 if self.warmup_steps is None else self.warmup_steps

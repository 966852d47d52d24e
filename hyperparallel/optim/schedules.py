"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay.

A schedule is a factor on each group's initial lr; LambdaLR applies it, so every param group
(Muon, AdamW decay / no-decay) keeps its own base lr.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

from hyperparallel.errors import ConfigError

if TYPE_CHECKING:  # (config.py imports SCHEDULE_KINDS and validate_schedule from here)
    from hyperparallel.optim.config import SchedulerConfig

SCHEDULE_KINDS = ("constant", "linear", "cosine")


def lr_factor(kind: str, step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """The factor on the base lr at optimizer step ``step`` (0-based).

    Warmup: (step + 1) / (warmup_steps + 1), so step 0 already moves the weights. Then the factor
    is 1 at step ``warmup_steps`` and decays to ``min_lr_ratio`` at ``total_steps`` (and stays
    there); "constant" stays 1.
    """
    validate_schedule(kind, warmup_steps, total_steps, min_lr_ratio)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be an integer >= 0, got {step!r}")
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps == 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def validate_schedule(kind: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> None:
    """Raise ConfigError naming the first schedule setting that is out of range (total_steps None:
    the settings on their own, before the run's length is known)."""
    if kind not in SCHEDULE_KINDS:
        raise ConfigError(f"kind must be one of {SCHEDULE_KINDS}, got {kind!r}")
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
        raise ConfigError(f"total_steps must be an integer >= 1, got {total_steps!r}")
    if total_steps is not None and warmup_steps > total_steps:
        raise ConfigError(f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})")
    ok = isinstance(min_lr_ratio, (int, float)) and not isinstance(min_lr_ratio, bool) and 0 <= min_lr_ratio <= 1
    if not ok:
        raise ConfigError(f"min_lr_ratio must be a number in [0, 1], got {min_lr_ratio!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, config: SchedulerConfig, *, total_steps: int) -> LambdaLR:
    """A LambdaLR that scales every group's initial lr by ``lr_factor(config.kind, step, ...)``
    over a run of `total_steps` (which decides a null `config.warmup_steps`).

    Call ``scheduler.step()`` once after each ``optimizer.step()``.
    """
    warmup_steps = config.warmup(total_steps)
    validate_schedule(config.kind, warmup_steps, total_steps, config.min_lr_ratio)
    # A partial rather than a closure: it pickles, and LambdaLR's state_dict keeps nothing of it, so
    # a resumed run follows the schedule it is built with, not one stored in the checkpoint.
    factor = functools.partial(
        lr_factor, config.kind, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=config.min_lr_ratio
    )
    return LambdaLR(optimizer, factor)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

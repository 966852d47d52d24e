"""The allowed range of every optimizer setting, in one place.

Muon checks its param groups with these, and OptimizerConfig (build_optimizer's settings, the
trainer's `optimizer:` section) its values, so a bound is stated once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from hyperparallel.errors import ConfigError


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _betas(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)


def _coefficients(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 3 and all(map(is_number, value))


# setting -> (the test a value must pass, what the message says it must be)
BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda v: is_number(v) and v >= 0, "a finite number >= 0"),
    "weight_decay": (lambda v: is_number(v) and v >= 0, "a finite number >= 0"),
    "betas": (_betas, "2 numbers in [0, 1)"),
    "adamw_eps": (lambda v: is_number(v) and v > 0, "a finite number > 0"),  # 0: 0/0 where a gradient stays 0
    "momentum": (lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "nesterov": (lambda v: isinstance(v, bool), "True or False"),
    "ns_coefficients": (_coefficients, "3 numbers (a, b, c)"),
    "ns_eps": (lambda v: is_number(v) and v > 0, "a finite number > 0"),
    "ns_steps": (lambda v: _is_int(v) and 1 <= v < 100, "an integer in [1, 99]"),
}


def check(setting: str, value: Any, *, name: str | None = None, label: str | None = None) -> None:
    """ConfigError unless `value` is allowed for `setting`; the message calls it `name` (default:
    the setting), after `label` when given."""
    test, expected = BOUNDS[setting]
    if not test(value):
        prefix = f"{label}: " if label else ""
        raise ConfigError(f"{prefix}{name or setting} must be {expected}, got {value!r}")

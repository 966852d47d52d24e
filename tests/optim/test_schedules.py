"""LR schedules: the factor at the steps that define each kind, validation, and LambdaLR wiring."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.optim import Muon, SchedulerConfig, build_scheduler, lr_factor

KINDS = ["constant", "linear", "cosine"]


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_is_linear_and_never_zero(kind):
    factors = [lr_factor(kind, step, 4, 10, 0.1) for step in range(5)]
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_constant_stays_at_one_after_warmup():
    assert [lr_factor("constant", step, 2, 10) for step in (2, 5, 10, 1000)] == [1.0] * 4


def test_linear_decays_to_min_at_total_steps_and_stays():
    # warmup 4, decay over steps 4..10, min 0.1
    assert lr_factor("linear", 7, 4, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor("linear", 10, 4, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor("linear", 50, 4, 10, 0.1) == pytest.approx(0.1)


def test_cosine_decays_to_min_at_total_steps_and_stays():
    assert lr_factor("cosine", 7, 4, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor("cosine", 5, 4, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 6)))
    assert lr_factor("cosine", 10, 4, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor("cosine", 50, 4, 10, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_no_warmup_starts_at_full_lr(kind):
    assert lr_factor(kind, 0, 0, 10) == 1.0
    assert lr_factor(kind, 10, 0, 10) == 0.0


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_warmup_spanning_every_step_ends_at_min(kind):
    assert lr_factor(kind, 4, 5, 5, 0.2) == pytest.approx(5 / 6)
    assert lr_factor(kind, 5, 5, 5, 0.2) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"kind": "step"}, "kind"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"total_steps": 0}, "total_steps"),
        ({"warmup_steps": 11}, "warmup_steps"),
        ({"min_lr_ratio": -0.1}, "min_lr_ratio"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_bad_settings_raise_config_error_naming_the_key(kwargs, key):
    settings = {"kind": "cosine", "warmup_steps": 2, "total_steps": 10, "min_lr_ratio": 0.0, **kwargs}
    with pytest.raises(ConfigError, match=key):
        lr_factor(step=0, **settings)
    total_steps = settings.pop("total_steps")
    with pytest.raises(ConfigError, match=key):
        build_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), SchedulerConfig(**settings),
                        total_steps=total_steps)


def test_negative_step_is_rejected():
    with pytest.raises(ConfigError, match="step"):
        lr_factor("linear", -1, 2, 10)


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_scales_each_group_by_lr_factor(kind):
    matrix, vector = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    optimizer = Muon([{"params": [matrix], "lr": 0.02}, {"params": [vector], "use_muon": False, "lr": 0.001}])
    scheduler = build_scheduler(optimizer, SchedulerConfig(kind=kind, warmup_steps=2, min_lr_ratio=0.1), total_steps=6)
    for step in range(9):
        factor = lr_factor(kind, step, 2, 6, 0.1)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.02 * factor, 0.001 * factor])
        matrix.grad, vector.grad = torch.ones_like(matrix), torch.ones_like(vector)
        optimizer.step()
        scheduler.step()


def test_scheduler_state_round_trips():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = build_scheduler(optimizer, SchedulerConfig(kind="cosine", warmup_steps=1, min_lr_ratio=0.0), total_steps=4)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    resumed_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    resumed = build_scheduler(resumed_optimizer, SchedulerConfig(kind="cosine", warmup_steps=1, min_lr_ratio=0.0),
                              total_steps=4)
    resumed.load_state_dict(scheduler.state_dict())
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    optimizer.step()
    scheduler.step()
    resumed_optimizer.step()
    resumed.step()
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == lr_factor("cosine", 3, 1, 4)

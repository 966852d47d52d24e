"""Which parameters go to Muon, which to AdamW, which get weight decay; and the optimizer built from that."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import torch
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.optim.muon import Muon

if TYPE_CHECKING:  # (config.py imports OPTIMIZER_NAMES from here)
    from hyperparallel.optim.config import OptimizerConfig

# Muon is meant for hidden-layer linear maps; embeddings, the output head, norms and MoE routers
# are left to AdamW, as in Keller Jordan's Muon and Moonshot's Moonlight.
MUON_EXCLUDE = ("*embed*", "*lm_head*", "*norm*", "*.mlp.gate.weight", "*router*")
NO_DECAY = ("*bias", "*norm*")
OPTIMIZER_NAMES = ("adamw", "muon")

NamedParams = list[tuple[str, nn.Parameter]]


def split_for_muon(model: nn.Module, *, exclude: Sequence[str] = MUON_EXCLUDE) -> tuple[NamedParams, NamedParams]:
    """``(muon, adamw)``: trainable 2-D / 3-D params whose full name matches no ``exclude`` glob, and the rest.

    Frozen parameters (requires_grad=False) are in neither list. A tied parameter appears once,
    under the first name ``named_parameters()`` gives it.
    """
    exclude = _globs(exclude, "exclude")
    muon: NamedParams = []
    adamw: NamedParams = []
    for name, param in model.named_parameters():  # yields each Parameter object once
        if not param.requires_grad:
            continue
        is_matrix = param.ndim in (2, 3)
        (muon if is_matrix and not _matches(name, exclude) else adamw).append((name, param))
    return muon, adamw


def build_optimizer(
    model: nn.Module,
    config: OptimizerConfig,
    *,
    adjust_lr_fn: str | None = None,
    no_decay: Sequence[str] = NO_DECAY,
    muon_exclude: Sequence[str] = MUON_EXCLUDE,
) -> torch.optim.Optimizer:
    """torch.optim.AdamW ("adamw") or hyperparallel Muon ("muon") over the trainable parameters,
    with `config`'s settings (the trainer's `optimizer:` section; its ranges are checked when it is
    made). The keywords are a library user's, not YAML settings.

    Groups, each with a "name" key (empty ones are left out): "muon" (Muon only; lr=muon_lr or lr,
    with weight decay), "adamw_decay", and "adamw_no_decay" (biases, norms, every param with
    ndim < 2; weight_decay=0).
    """
    c = config
    no_decay = _globs(no_decay, "no_decay")

    if c.name == "adamw":
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = _adamw_groups(trainable, c.weight_decay, no_decay)
        _check_not_empty(groups)
        # the fused kernel (one pass per tensor) is what HF's Trainer uses too; same math
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for _, p in trainable)
        return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=fused)

    muon_params, adamw_params = split_for_muon(model, exclude=muon_exclude)
    groups = [
        {
            "name": "muon",
            "params": [p for _, p in muon_params],
            "use_muon": True,
            "lr": c.lr if c.muon_lr is None else c.muon_lr,
            "weight_decay": c.weight_decay,
        }
    ]
    groups += [{**group, "use_muon": False} for group in _adamw_groups(adamw_params, c.weight_decay, no_decay)]
    groups = [group for group in groups if group["params"]]
    _check_not_empty(groups)
    return Muon(
        groups,
        lr=c.lr,
        weight_decay=c.weight_decay,
        momentum=c.momentum,
        nesterov=c.nesterov,
        ns_steps=c.ns_steps,
        adjust_lr_fn=adjust_lr_fn,
        adamw_betas=tuple(c.betas),
        adamw_eps=c.eps,
    )


def _adamw_groups(named_params: NamedParams, weight_decay: float, no_decay: tuple[str, ...]) -> list[dict]:
    decay, skip = [], []
    for name, param in named_params:
        # 1-D (and 0-D) params are scales and offsets: decaying them towards 0 only hurts.
        (skip if param.ndim < 2 or _matches(name, no_decay) else decay).append(param)
    groups = [
        {"name": "adamw_decay", "params": decay, "weight_decay": weight_decay},
        {"name": "adamw_no_decay", "params": skip, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _check_not_empty(groups: list[dict]) -> None:
    if not groups:
        raise ConfigError("the model has no trainable parameters (every requires_grad is False)")


def _matches(name: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, glob) for glob in globs)


def _globs(value: Sequence[str], key: str) -> tuple[str, ...]:
    # A bare string would be iterated character by character and silently match almost everything.
    if isinstance(value, str) or not all(isinstance(glob, str) for glob in value):
        raise ConfigError(f"{key} must be a list of glob patterns, got {value!r}")
    return tuple(value)

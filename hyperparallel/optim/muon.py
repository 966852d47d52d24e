"""Muon for matrices and AdamW for everything else, in one optimizer.

Groups with ``use_muon=True`` hold 2-D matrices, or 3-D stacks of independent matrices (MoE expert
weights ``[E, out, in]``); each matrix follows torch.optim.Muon exactly. Groups with
``use_muon=False`` follow torch.optim.AdamW exactly (foreach=False, amsgrad=False).

The Muon step is three functions so that a sharded caller can split it: ``advance_momentum`` and
``apply_muon_update`` are elementwise (they run on any shard), only ``orthogonalize`` needs the
whole matrix.

Sharded parameters (``hyperparallel.fsdp.fully_shard``): a 2-D matrix split by rows over several
ranks is orthogonalized once, by one owner rank (``sharded_muon``); a 3-D stack split along dim 0
holds whole matrices on every rank and is orthogonalized locally. The state stays per shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.fsdp import ShardPlacement, shard_placement
from hyperparallel.optim import bounds
from hyperparallel.optim.sharded_muon import ExchangePlans, ShardedMatrix, orthogonalize_sharded

# Defaults of torch.optim.Muon (Keller Jordan's quintic Newton–Schulz coefficients).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def orthogonalize(
    grad_matrix: Tensor,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> Tensor:
    """Newton–Schulz orthogonalization of ``[m, n]``, or of each ``[b]`` of ``[b, m, n]``; returns bfloat16.

    Same operations, order and dtype as torch.optim.Muon, so a 2-D result is bit-equal to it.
    The input is never modified.
    """
    if grad_matrix.ndim not in (2, 3):
        raise ShapeError(
            f"orthogonalize takes a [m, n] matrix or a [b, m, n] stack, got shape {tuple(grad_matrix.shape)}"
        )
    if len(coefficients) != 3:
        raise ConfigError(f"Newton–Schulz coefficients must be 3 numbers (a, b, c), got {coefficients!r}")
    a, b, c = coefficients
    x = grad_matrix.bfloat16()
    # Iterate on the wide orientation so that the Gram matrix x @ x.T is the smaller one.
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Frobenius norm <= 1 bounds the spectral norm by 1. Out of place: a bf16 input must stay intact.
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, poly, x, beta=a)
    return x.mT if tall else x


def advance_momentum(grad: Tensor, momentum_buffer: Tensor, *, momentum: float, nesterov: bool) -> Tensor:
    """Fold ``grad`` into ``momentum_buffer`` (in place); return what Newton–Schulz should orthogonalize."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def adjusted_lr(lr: float, adjust_lr_fn: str | None, matrix_shape: Sequence[int]) -> float:
    """The lr Muon applies to one ``[rows, cols]`` matrix (the last two entries of ``matrix_shape``)."""
    rows, cols = matrix_shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ConfigError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def apply_muon_update(
    param: Tensor,
    update: Tensor,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    matrix_shape: Sequence[int] | None = None,
) -> None:
    """Decoupled weight decay, then ``param -= adjusted_lr * update``.

    ``matrix_shape`` is the shape of the whole matrix when ``param`` is only a shard of it.
    """
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr(lr, adjust_lr_fn, param.shape if matrix_shape is None else matrix_shape))


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on one tensor, operation for operation as torch.optim.AdamW's single-tensor path."""
    beta1, beta2 = betas
    step += 1
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_count = step.item()
    step_size = lr / (1 - beta1**step_count)
    bias_correction2_sqrt = (1 - beta2**step_count) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class Muon(torch.optim.Optimizer):
    """Muon on ``use_muon=True`` groups (the default), AdamW on ``use_muon=False`` groups.

    Muon groups take lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
    adjust_lr_fn (defaults: the constructor's, which are torch.optim.Muon's). AdamW groups take lr,
    weight_decay (defaults: the constructor's), betas and eps (defaults: ``adamw_betas``,
    ``adamw_eps``). A 3-D Muon parameter is a stack of independent matrices along dim 0.

    With FSDP-sharded parameters, ``step`` is a collective over their process groups: build the
    same optimizer over the same parameters on every rank.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        # Kept apart from self.defaults, which torch copies into every group: AdamW groups must not
        # carry Muon keys (and `eps` means a different thing in each kind).
        self._kind_defaults = {
            True: {
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_coefficients": ns_coefficients,
                "eps": eps,
                "ns_steps": ns_steps,
                "adjust_lr_fn": adjust_lr_fn,
            },
            False: {"betas": adamw_betas, "eps": adamw_eps},
        }
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "use_muon": True})

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_kind_defaults": self._kind_defaults}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        label = f"Muon param group {len(self.param_groups)}"
        if "name" in param_group:
            label += f" ({param_group['name']!r})"
        use_muon = param_group.setdefault("use_muon", True)
        if not isinstance(use_muon, bool):
            raise ConfigError(f"{label}: use_muon must be True or False, got {use_muon!r}")
        for key, value in self._kind_defaults[use_muon].items():
            param_group.setdefault(key, value)
        for key in ("lr", "weight_decay"):
            param_group.setdefault(key, self.defaults[key])
        params = param_group["params"]
        # Materialize generators here so that the checks below and torch see the same tensors.
        if not isinstance(params, (Tensor, set)):
            param_group["params"] = params = list(params)
        _validate_group(param_group, label)
        for item in [params] if isinstance(params, Tensor) else params:
            tensor = item[1] if isinstance(item, tuple) else item
            if isinstance(tensor, Tensor):
                _validate_param(tensor, use_muon, label)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        row_sharded: list[tuple[Tensor, dict[str, Any], ShardedMatrix]] = []
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                row_sharded += self._muon_group_step(group, index)
            else:
                self._adamw_group_step(group)
        if row_sharded:
            updates = orthogonalize_sharded([matrix for _, _, matrix in row_sharded], self._exchange_plans())
            for (param, group, matrix), update in zip(row_sharded, updates, strict=True):
                apply_muon_update(
                    param,
                    update,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    matrix_shape=matrix.shape,
                )
        return loss

    def _exchange_plans(self) -> ExchangePlans:
        # made on first use, not in __init__: an optimizer restored by __setstate__ has none
        plans = self.__dict__.get("_plans")
        if plans is None:
            plans = self._plans = ExchangePlans()
        return plans

    def _muon_group_step(
        self, group: dict[str, Any], group_index: int
    ) -> list[tuple[Tensor, dict[str, Any], ShardedMatrix]]:
        """Step every matrix this rank holds whole; return the row-sharded ones, whose Newton–Schulz
        needs the other ranks' rows (their momentum is already advanced)."""
        row_sharded = []
        for index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            _check_dense(param)
            placement = shard_placement(param)
            row_sharded_here = placement is not None and len(placement.ranges) > 1
            if row_sharded_here:  # before touching its state
                _check_shard(param, placement, _param_label(group, group_index, index))
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            direction = advance_momentum(
                param.grad, state["momentum_buffer"], momentum=group["momentum"], nesterov=group["nesterov"]
            )
            if row_sharded_here:
                if param.ndim == 2:
                    ns = functools.partial(
                        orthogonalize, coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"]
                    )
                    row_sharded.append((param, group, ShardedMatrix(direction, placement, ns)))
                    continue
                if param.numel() == 0:
                    continue  # this rank holds none of the stack's matrices
            update = orthogonalize(direction, group["ns_coefficients"], group["ns_steps"], group["eps"])
            apply_muon_update(
                param, update, lr=group["lr"], weight_decay=group["weight_decay"], adjust_lr_fn=group["adjust_lr_fn"]
            )
        return row_sharded

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            _check_dense(param)
            state = self.state[param]
            if len(state) == 0:
                # A CPU float tensor, as torch's AdamW keeps it (capturable=False, fused=False), so
                # checkpoints of either optimizer hold the same kind of `step`.
                state["step"] = torch.tensor(0.0, dtype=_step_dtype())
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            adamw_update(
                param,
                param.grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                state["step"],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )


def _step_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_dense(param: Tensor) -> None:
    if param.grad.is_sparse:
        raise ShapeError(f"Muon does not support sparse gradients (parameter of shape {tuple(param.shape)})")


def _param_label(group: dict[str, Any], group_index: int, index: int) -> str:
    names = group.get("param_names")
    name = repr(names[index]) if names else f"{index}"
    label = f"Muon param group {group_index}"
    if "name" in group:
        label += f" ({group['name']!r})"
    return f"{label}, parameter {name}"


def _check_shard(param: Tensor, placement: ShardPlacement, label: str) -> None:
    """A shard must hold the rows its placement gives this rank: the exchange is sized from it."""
    ranges, rank = placement.ranges, placement.rank
    if ranges[rank][1] != param.shape[0]:
        raise ShapeError(
            f"{label}: a shard of shape {tuple(param.shape)} on rank {rank}, but its shard placement gives "
            f"this rank {ranges[rank][1]} rows of {sum(length for _, length in ranges)}; step the optimizer "
            f"on the shards fully_shard made, unchanged in shape"
        )


def _validate_param(param: Tensor, use_muon: bool, label: str) -> None:
    if torch.is_complex(param):
        raise ShapeError(f"{label}: complex parameters are not supported (shape {tuple(param.shape)})")
    if use_muon and param.ndim not in (2, 3):
        raise ConfigError(
            f"{label}: Muon takes 2-D matrices or 3-D stacks of matrices, got a parameter of shape "
            f"{tuple(param.shape)}; put it in a group with use_muon=False (AdamW)"
        )


def _validate_group(group: dict[str, Any], label: str) -> None:
    for key in ("lr", "weight_decay"):
        bounds.check(key, group[key], label=label)
    if group["use_muon"]:
        for key in ("momentum", "nesterov", "ns_coefficients", "ns_steps"):
            bounds.check(key, group[key], label=label)
        bounds.check("ns_eps", group["eps"], name="eps", label=label)
        fn = group["adjust_lr_fn"]
        if fn not in ADJUST_LR_FNS:
            raise ConfigError(f"{label}: adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {fn!r}")
    else:
        bounds.check("betas", group["betas"], label=label)
        bounds.check("adamw_eps", group["eps"], name="eps", label=label)

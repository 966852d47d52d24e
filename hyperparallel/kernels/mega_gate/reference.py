"""MegaGate in torch ops: the specification every fused backend is held to, and the checks of
every argument a caller can get wrong (run before any kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.kernels.router_groups import exceeds_reachable, group_problem, reachable

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")


# ---------------------------------------------------------------------------------- checks


def check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups) -> None:
    """Every error a caller can make, named, before any kernel runs."""
    if score not in SCORES:
        raise ConfigError(f"mega_gate score {score!r} is not one of {', '.join(SCORES)}")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        got = f"{tuple(logits.shape)} {logits.dtype}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ShapeError(f"mega_gate logits must be a [tokens, experts] float32 tensor; got {got}")
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ShapeError("mega_gate logits must have at least one expert (column); got 0")
    if not 0 < top_k <= num_experts:
        raise ConfigError(f"mega_gate top_k ({top_k}) must be in 1..num_experts ({num_experts})")
    if hash_indices is not None:
        _check_hash(hash_indices, logits, top_k)
        return  # no selection: the bias and the groups are not used
    if correction_bias is not None and (
            correction_bias.shape != (num_experts,) or correction_bias.dtype != torch.float32
            or correction_bias.device != logits.device):
        raise ShapeError(f"mega_gate correction_bias must be a [{num_experts}] float32 tensor on {logits.device}; "
                         f"got {tuple(correction_bias.shape)} {correction_bias.dtype} on {correction_bias.device}")
    _check_groups(num_experts, top_k, num_groups, top_groups)


def _check_hash(hash_indices, logits, top_k) -> None:
    tokens = logits.shape[0]
    if (hash_indices.shape != (tokens, top_k) or hash_indices.dtype != torch.int64
            or hash_indices.device != logits.device):
        raise ShapeError(f"mega_gate hash_indices must be a [{tokens}, {top_k}] int64 tensor (tokens, top_k) "
                         f"on {logits.device}; got {tuple(hash_indices.shape)} {hash_indices.dtype} "
                         f"on {hash_indices.device}")


def _check_groups(num_experts, top_k, num_groups, top_groups) -> None:
    problem = group_problem(num_experts, num_groups, top_groups, top_k)
    if problem is not None:
        raise ConfigError(f"mega_gate: {problem}")
    if exceeds_reachable(num_experts, num_groups, top_groups, top_k):
        # see [Note: top_k beyond the reachable experts] (kernels/router_groups.py)
        raise ConfigError(
            f"mega_gate: top_k ({top_k}) exceeds the {reachable(num_experts, num_groups, top_groups)} experts "
            f"that top_groups ({top_groups}) of num_groups ({num_groups}) groups reach; transformers then also "
            f"chooses experts outside them, in torch.topk's order of -inf ties, which MegaGate does not "
            f"reproduce: route it op by op (TopKRouter does, even with fused set)")


# ------------------------------------------------------------------------------- reference


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    if score == "softmax":
        return F.softmax(logits, dtype=torch.float, dim=-1)
    if score == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()  # transformers' ACT2FN["sqrtsoftplus"] (threshold 20)


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row, largest first, equal values by lower index (NaN
    first, as torch.topk ranks it): see [Note: order of the k outputs]."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def _eligible(choice: torch.Tensor, num_groups: int, top_groups: int) -> torch.Tensor:
    """`choice` with the experts outside the `top_groups` best groups at -inf (TopKRouter._eligible)."""
    if num_groups == 1:
        return choice
    tokens, num_experts = choice.shape
    per_group = num_experts // num_groups
    group_scores = choice.view(tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = _top(group_scores, top_groups)
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(tokens, num_experts)
    return choice.masked_fill(~score_mask.bool(), float("-inf"))


def mega_gate_reference(logits: torch.Tensor, correction_bias: torch.Tensor | None, *, score: str, top_k: int,
                        num_groups: int = 1, top_groups: int = 1, norm_topk_prob: bool = True,
                        routed_scaling_factor: float = 1.0, norm_eps: float = 0.0,
                        hash_indices: torch.Tensor | None = None, aux_probs: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MegaGate in torch ops, TopKRouter's op for op but for the order of equal values (a stable
    sort where TopKRouter calls torch.topk); differentiable through autograd."""
    check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups)
    probs = _scores(logits, score)
    if hash_indices is not None:
        indices = hash_indices
    else:
        choice = probs if correction_bias is None else probs + correction_bias
        indices = _top(_eligible(choice, num_groups, top_groups), top_k)
    weights = probs.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + norm_eps)
    weights = weights * routed_scaling_factor
    flat = indices.reshape(-1).detach()
    counts = torch.zeros(logits.shape[1], dtype=torch.int64, device=logits.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    prob_sum = None
    if aux_probs:
        distribution = probs if score == "softmax" else probs / probs.sum(dim=-1, keepdim=True)
        prob_sum = distribution.sum(dim=0)
    return weights, indices, counts, prob_sum


__all__ = ["SCORES", "check", "mega_gate_reference"]

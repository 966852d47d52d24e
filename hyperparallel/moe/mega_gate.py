"""MegaGate: everything a MoE router does after its logits, as one fused operation.

`mega_gate(logits, correction_bias, score=..., top_k=...)` computes, per token, what
`TopKRouter` (and transformers' routers, op for op) computes from the logits: the scores, the
biased and group-limited choice, the top k, the renormalized and scaled weights; and in the
same pass what load balancing reads, the per-expert loads and (``aux_probs``) the per-expert
sums of the auxiliary loss's distribution. Backward gives the gradient w.r.t. the logits from
the weights' and the probability sums' gradients.

Backends, chosen by the device of the logits: the native C kernel on CPU tensors
(csrc/mega_gate.c, when built; else the reference), Triton on CUDA tensors
(`mega_gate_triton`), and `mega_gate_reference` (pure torch, the specification in code) on any
other device. The native and Triton paths are `torch.library` custom ops with fake
implementations and their backward as a custom op too, so torch.compile traces them whole
(fullgraph) and AOTAutograd sees one forward and one backward operation.

[Note: what backward keeps] Only the logits (the op's input, which the router's matmul keeps
anyway) and the int64 indices [T, k] are saved; backward recomputes each row's scores from its
logits. No [T, E] intermediate (scores, choice, masks) outlives the forward.

[Note: order of the k outputs] The k experts of a token come sorted by their choice value,
largest first, equal values by lower expert index (as a stable descending sort orders them).
Without ties that is torch.topk(sorted=True)'s order, and the experts are transformers' own;
transformers' DeepSeek routers ask for sorted=False, whose order is unspecified: the same set of
experts, with their weights, in some order. torch.topk leaves the order of equal values
unspecified (on CPU it is not by index: [20, 16, 1, 22] for four equal values), so where equal
values straddle the k-th place, which of them transformers takes is up to torch's selection
algorithm; MegaGate takes the lower indices, on every backend. The same rule picks among groups
of equal score. Hash-routed layers keep the table's order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.moe import mega_gate_native as native
from hyperparallel.moe import mega_gate_triton as triton_gate

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
BACKENDS = ("native", "triton", "reference")
_SCORE_CODES = {name: code for code, name in enumerate(SCORES)}  # csrc/mega_gate.c's enum


# ---------------------------------------------------------------------------------- checks


def _check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups) -> None:
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
    if num_groups < 1 or num_experts % num_groups or not 0 < top_groups <= num_groups:
        raise ConfigError(f"mega_gate groups: {num_experts} experts in num_groups={num_groups}, top_groups="
                          f"{top_groups} of them eligible; the groups must divide the experts and "
                          f"1 <= top_groups <= num_groups")
    if num_groups == 1:
        return
    per_group = num_experts // num_groups
    if per_group < 2:
        raise ConfigError(f"mega_gate num_groups={num_groups} leaves {per_group} expert per group; a group is "
                          f"scored by its two best experts, so it needs at least 2")
    if top_k > top_groups * per_group:
        raise ConfigError(f"mega_gate top_k ({top_k}) exceeds the {top_groups * per_group} experts of the "
                          f"top_groups={top_groups} eligible groups")


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
    _check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups)
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


# --------------------------------------------------------------------------------- native


def _outputs(logits: torch.Tensor, top_k: int, aux_probs: bool, empty=torch.empty):
    """weights [T, k], indices [T, k], counts [E], prob_sum [E] (or [0] without aux_probs: a
    custom op returns tensors, never None)."""
    tokens, num_experts = logits.shape
    like = {"device": logits.device}
    return (empty(tokens, top_k, dtype=torch.float32, **like), empty(tokens, top_k, dtype=torch.int64, **like),
            empty(num_experts, dtype=torch.int64, **like),
            empty(num_experts if aux_probs else 0, dtype=torch.float32, **like))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native_forward(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
                    routed_scaling_factor, norm_eps, aux_probs):
    logits = logits.contiguous()
    bias = None if correction_bias is None or hash_indices is not None else correction_bias.contiguous()
    hashed = None if hash_indices is None else hash_indices.contiguous()
    weights, indices, counts, prob_sum = _outputs(logits, top_k, aux_probs)
    status = native.LIB.hp_mega_gate_forward(
        _ptr(logits), logits.shape[0], logits.shape[1], _ptr(bias), _ptr(hashed), _SCORE_CODES[score], top_k,
        1 if hashed is not None else num_groups, top_groups, int(norm_topk_prob), routed_scaling_factor, norm_eps,
        _ptr(weights), _ptr(indices), _ptr(counts), _ptr(prob_sum) if aux_probs else None, torch.get_num_threads())
    _raise_for(status, logits.shape[1])
    return weights, indices, counts, prob_sum


def _native_backward(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob,
                     routed_scaling_factor, norm_eps):
    logits, indices = logits.contiguous(), indices.contiguous()
    grad_logits = torch.empty_like(logits)
    status = native.LIB.hp_mega_gate_backward(
        _ptr(logits), logits.shape[0], logits.shape[1], _ptr(indices), _ptr(grad_weights), _ptr(grad_prob_sum),
        _SCORE_CODES[score], top_k, int(norm_topk_prob), routed_scaling_factor, norm_eps, _ptr(grad_logits),
        torch.get_num_threads())
    _raise_for(status, logits.shape[1])
    return grad_logits


def _raise_for(status: int, num_experts: int) -> None:
    if status == native.BAD_HASH_INDEX:
        raise ShapeError(f"mega_gate hash_indices holds an expert id outside 0..{num_experts - 1}")
    if status == native.NO_MEMORY:
        raise MemoryError("mega_gate: the native kernel could not allocate its row buffers")


# ------------------------------------------------------------------------------ custom ops
# One forward op and one backward op per fast backend, the same schema for both backends.


def _define_ops(name: str, forward_impl, backward_impl):
    @torch.library.custom_op(f"hyperparallel::mega_gate_{name}", mutates_args=())
    def forward(logits: torch.Tensor, correction_bias: torch.Tensor | None, hash_indices: torch.Tensor | None,
                score: str, top_k: int, num_groups: int, top_groups: int, norm_topk_prob: bool,
                routed_scaling_factor: float, norm_eps: float, aux_probs: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return forward_impl(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups,
                            norm_topk_prob, routed_scaling_factor, norm_eps, aux_probs)

    @forward.register_fake
    def _(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
          routed_scaling_factor, norm_eps, aux_probs):
        return _outputs(logits, top_k, aux_probs, empty=torch.empty)

    @torch.library.custom_op(f"hyperparallel::mega_gate_{name}_backward", mutates_args=())
    def backward_op(logits: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor | None,
                    grad_prob_sum: torch.Tensor | None, score: str, top_k: int, norm_topk_prob: bool,
                    routed_scaling_factor: float, norm_eps: float) -> torch.Tensor:
        return backward_impl(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob,
                             routed_scaling_factor, norm_eps)

    @backward_op.register_fake
    def _(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob, routed_scaling_factor,
          norm_eps):
        return torch.empty_like(logits)

    def setup_context(ctx, inputs, output):
        logits, _, _, score, top_k, _, _, norm_topk_prob, routed_scaling_factor, norm_eps, aux_probs = inputs
        ctx.save_for_backward(logits, output[1])  # see [Note: what backward keeps]
        ctx.config = (score, top_k, norm_topk_prob, routed_scaling_factor, norm_eps)
        ctx.aux_probs = aux_probs
        ctx.set_materialize_grads(False)  # an output nothing used gets None, not a zero tensor

    def backward(ctx, grad_weights, grad_indices, grad_counts, grad_prob_sum):
        logits, indices = ctx.saved_tensors
        if grad_weights is not None:
            grad_weights = grad_weights.contiguous()  # sum()'s gradient is an expanded view
        if grad_prob_sum is not None and ctx.aux_probs:
            grad_prob_sum = grad_prob_sum.contiguous()
        else:
            grad_prob_sum = None
        grad_logits = None
        if ctx.needs_input_grad[0] and (grad_weights is not None or grad_prob_sum is not None):
            grad_logits = backward_op(logits, indices, grad_weights, grad_prob_sum, *ctx.config)
        return grad_logits, None, None, None, None, None, None, None, None, None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward


_native_op = _define_ops("cpu", _native_forward, _native_backward)
_triton_op = _define_ops("triton", triton_gate.forward, triton_gate.backward)


# ------------------------------------------------------------------------------------ API


def backend_for(device: torch.device) -> str:
    """The backend `mega_gate` runs on tensors of this device: one of BACKENDS."""
    device = torch.device(device)
    if device.type == "cpu":
        return "native" if native.LIB is not None else "reference"
    if device.type == "cuda" and triton_gate.unavailable_reason(device) is None:
        return "triton"
    return "reference"


def run_backend(backend: str, logits: torch.Tensor, correction_bias: torch.Tensor | None, *, score: str,
                top_k: int, num_groups: int = 1, top_groups: int = 1, norm_topk_prob: bool = True,
                routed_scaling_factor: float = 1.0, norm_eps: float = 0.0,
                hash_indices: torch.Tensor | None = None, aux_probs: bool = False):
    """`mega_gate` on a named backend (tests and benchmarks compare them on the same inputs)."""
    if backend not in BACKENDS:
        raise ConfigError(f"mega_gate backend {backend!r} is not one of {', '.join(BACKENDS)}")
    args = dict(score=score, top_k=top_k, num_groups=num_groups, top_groups=top_groups,
                norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps,
                hash_indices=hash_indices, aux_probs=aux_probs)
    if backend == "reference":
        return mega_gate_reference(logits, correction_bias, **args)
    _check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups)
    if backend == "native" and native.LIB is None:
        raise ConfigError("mega_gate backend 'native' needs hyperparallel._mega_gate_native (run `make setup`)")
    if backend == "triton" and (reason := triton_gate.unavailable_reason(logits.device)) is not None:
        raise ConfigError(f"mega_gate backend 'triton': {reason}")
    op = _native_op if backend == "native" else _triton_op
    weights, indices, counts, prob_sum = op(
        logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
        float(routed_scaling_factor), float(norm_eps), aux_probs)
    return weights, indices, counts, prob_sum if aux_probs else None


def mega_gate(logits: torch.Tensor, correction_bias: torch.Tensor | None, *, score: str, top_k: int,
              num_groups: int = 1, top_groups: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0, norm_eps: float = 0.0,
              hash_indices: torch.Tensor | None = None, aux_probs: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] float32 (differentiable) -> (weights [T, k] float32, indices [T, k] int64,
    counts [E] int64, prob_sum [E] float32 or None).

    score: "softmax", "sigmoid" or "sqrtsoftplus" (the per-expert scores p). The experts are the
    top_k of p + correction_bias (bias [E] float32, for the choice only), among the top_groups best
    of num_groups groups of consecutive experts (a group scored by the sum of its two best);
    or, given hash_indices [T, k], those (no choice: bias and groups unused). weights = p at the
    experts, divided by their sum + norm_eps when norm_topk_prob, times routed_scaling_factor.
    counts[e]: how many (token, slot) pairs chose e. prob_sum (aux_probs): the sum over tokens of
    the Switch aux loss's distribution, softmax p, else p / p.sum(-1) (differentiable).
    The k experts of a token come by choice value, largest first, equal values by lower index
    (see [Note: order of the k outputs]).
    """
    return run_backend(backend_for(logits.device), logits, correction_bias, score=score, top_k=top_k,
                       num_groups=num_groups, top_groups=top_groups, norm_topk_prob=norm_topk_prob,
                       routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps,
                       hash_indices=hash_indices, aux_probs=aux_probs)


__all__ = ["BACKENDS", "SCORES", "backend_for", "mega_gate", "mega_gate_reference", "run_backend"]

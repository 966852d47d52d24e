"""MegaGate's fused backends (native C, Triton) as custom ops, and the API that picks one.

See the package's docstring for what MegaGate computes and [Note: what backward keeps];
kernels.backends' [Note: fused backends] for how a backend is chosen.
"""

from __future__ import annotations

import torch

from hyperparallel.errors import ShapeError
from hyperparallel.kernels.backends import FusedBackends, custom_op, ptr
from hyperparallel.kernels.mega_gate import native
from hyperparallel.kernels.mega_gate import triton as triton_gate
from hyperparallel.kernels.mega_gate.reference import SCORES, check, mega_gate_reference

_SCORE_CODES = {name: code for code, name in enumerate(SCORES)}  # csrc/mega_gate.c's enum
_BACKENDS = FusedBackends("mega_gate", native)


# --------------------------------------------------------------------------------- native


def _outputs(logits: torch.Tensor, top_k: int, aux_probs: bool, empty=torch.empty):
    """weights [T, k], indices [T, k], counts [E], prob_sum [E] (or [0] without aux_probs: a
    custom op returns tensors, never None)."""
    tokens, num_experts = logits.shape
    like = {"device": logits.device}
    return (empty(tokens, top_k, dtype=torch.float32, **like), empty(tokens, top_k, dtype=torch.int64, **like),
            empty(num_experts, dtype=torch.int64, **like),
            empty(num_experts if aux_probs else 0, dtype=torch.float32, **like))


def _native_forward(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
                    routed_scaling_factor, norm_eps, aux_probs):
    logits = logits.contiguous()
    bias = None if correction_bias is None or hash_indices is not None else correction_bias.contiguous()
    hashed = None if hash_indices is None else hash_indices.contiguous()
    weights, indices, counts, prob_sum = _outputs(logits, top_k, aux_probs)
    status = native.LIB.hp_mega_gate_forward(
        ptr(logits), logits.shape[0], logits.shape[1], ptr(bias), ptr(hashed), _SCORE_CODES[score], top_k,
        1 if hashed is not None else num_groups, top_groups, int(norm_topk_prob), routed_scaling_factor, norm_eps,
        ptr(weights), ptr(indices), ptr(counts), ptr(prob_sum) if aux_probs else None, torch.get_num_threads())
    _raise_for(status, logits.shape[1])
    return weights, indices, counts, prob_sum


def _native_backward(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob,
                     routed_scaling_factor, norm_eps):
    logits, indices = logits.contiguous(), indices.contiguous()
    grad_logits = torch.empty_like(logits)
    status = native.LIB.hp_mega_gate_backward(
        ptr(logits), logits.shape[0], logits.shape[1], ptr(indices), ptr(grad_weights), ptr(grad_prob_sum),
        _SCORE_CODES[score], top_k, int(norm_topk_prob), routed_scaling_factor, norm_eps, ptr(grad_logits),
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
    def forward(logits: torch.Tensor, correction_bias: torch.Tensor | None, hash_indices: torch.Tensor | None,
                score: str, top_k: int, num_groups: int, top_groups: int, norm_topk_prob: bool,
                routed_scaling_factor: float, norm_eps: float, aux_probs: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return forward_impl(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups,
                            norm_topk_prob, routed_scaling_factor, norm_eps, aux_probs)

    def forward_fake(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
                     routed_scaling_factor, norm_eps, aux_probs):
        return _outputs(logits, top_k, aux_probs, empty=torch.empty)

    def backward_impl_op(logits: torch.Tensor, indices: torch.Tensor, grad_weights: torch.Tensor | None,
                         grad_prob_sum: torch.Tensor | None, score: str, top_k: int, norm_topk_prob: bool,
                         routed_scaling_factor: float, norm_eps: float) -> torch.Tensor:
        return backward_impl(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob,
                             routed_scaling_factor, norm_eps)

    def backward_fake(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob,
                      routed_scaling_factor, norm_eps):
        return torch.empty_like(logits)

    forward_op = custom_op(f"mega_gate_{name}", forward, forward_fake)
    backward_op = custom_op(f"mega_gate_{name}_backward", backward_impl_op, backward_fake)

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

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op


_native_op = _define_ops("cpu", _native_forward, _native_backward)
_triton_op = _define_ops("triton", triton_gate.forward, triton_gate.backward)


# ------------------------------------------------------------------------------------ API


def backend_for(device: torch.device) -> str:
    """The backend `mega_gate` runs on tensors of this device: one of BACKENDS."""
    return _BACKENDS.for_device(device)


def run_backend(backend: str, logits: torch.Tensor, correction_bias: torch.Tensor | None, *, score: str,
                top_k: int, num_groups: int = 1, top_groups: int = 1, norm_topk_prob: bool = True,
                routed_scaling_factor: float = 1.0, norm_eps: float = 0.0,
                hash_indices: torch.Tensor | None = None, aux_probs: bool = False):
    """`mega_gate` on a named backend (tests and benchmarks compare them on the same inputs)."""
    _BACKENDS.require(backend, logits.device)
    args = dict(score=score, top_k=top_k, num_groups=num_groups, top_groups=top_groups,
                norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps,
                hash_indices=hash_indices, aux_probs=aux_probs)
    if backend == "reference":
        return mega_gate_reference(logits, correction_bias, **args)
    check(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups)
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


__all__ = ["backend_for", "mega_gate", "run_backend"]

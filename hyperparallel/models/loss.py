"""A causal LM's cross-entropy from its last hidden states, chunk by chunk, logits never whole.

Hugging Face models compute `logits = lm_head(h)` for every position ([tokens, vocab], the
largest activation of a small model), then log_softmax, then its backward: three passes over
the logits and one more to zero the gradient of nll. `linear_cross_entropy` computes the same
loss a chunk of rows at a time, and because the loss is the last thing forward computes, it
also computes the gradient there: per chunk, one matmul for the logits, one pass for their
log-sum-exp, one for softmax minus one-hot (in place), and the two matmuls of the head's
backward. Backward then only scales the two gradients it kept by the incoming gradient.

`FusedLossHead` takes the place of a model's `lm_head` (same weight Parameter, same name). Inside
`with fused_loss(model):` the head hands its input through untouched and the model's
`loss_function` (which HF models call with the head's output and the labels) runs
`linear_cross_entropy` on it; outside, the head is an ordinary linear layer and the loss is
Hugging Face's. The numbers are HF's ForCausalLMLoss: labels shifted by one, -100 ignored,
the mean over the counted tokens (or the sum over `num_items_in_batch`), computed in float32.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hyperparallel.lowp.dtypes import compute_dtype

IGNORE_INDEX = -100
# Rows of logits computed at once: the logits of one chunk (rows x vocab float32) stay near the
# size of a core's share of the last-level cache, and the head's matmuls stay large enough to run
# at full speed (measured on the CPU: 2-core Zen 4).
_CHUNK_ELEMENTS = 1 << 21
_MIN_CHUNK_ROWS = 64


# A logit this far below its row's largest, exp(-50) = 2e-22 of the largest term, is below float32's
# resolution of any sum it joins (and of 1e6 of them), so its term is taken as 0. Computed, it would
# make denormal numbers (exp under 1.2e-38, or its product with a small 1 / tokens), which x86 cores
# handle many times slower: on logits spread over ~130 (randn x 16), a compiled chunk's element-wise
# work took 4.8 ms where it takes 1.25 (Sapphire Rapids, 512 x 4096; 1.2 ms at a spread of ~8).
_NEGLIGIBLE_SHIFT = -50.0


def softmax_numerators(logits: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """exp(logits - peak), in a new tensor, with the terms under exp(-50) of the peak's exactly 0."""
    shifted = logits - peak
    return shifted.masked_fill_(shifted < _NEGLIGIBLE_SHIFT, float("-inf")).exp_()


# Logits up to this many elements (16 MiB in float32: 1024 tokens x 4096 words) are computed whole,
# by one compiled function (the head's product, log-softmax and their backward, fused by the
# compiler), when a compile backend is given: chunking saves memory only where logits are large,
# and at this size the whole function is faster (1.48x for the loss, forward and backward, at
# 1024 x 4096 in bf16 on the CPU). Above it, and uncompiled, the chunks. (Compiled for each row
# count it meets, as a step's micro-batches all have one; its softmax takes the terms far below
# a row's peak as they come, the denormal slowdown the chunks avoid included.)
_WHOLE_ELEMENTS = 1 << 22


def _chunk_rows(rows: int, vocab: int) -> int:
    return max(_MIN_CHUNK_ROWS, min(rows, _CHUNK_ELEMENTS // max(vocab, 1)))


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, inverse_denominator: torch.Tensor,
                         grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (sum of the counted rows' losses, d loss / d logits in grad_dtype), in float32.

    d loss / d logits = (softmax - one_hot) / denominator on counted rows, 0 on ignored ones. One
    exp pass serves both the log-sum-exp and the softmax. The one-hot is a comparison with the
    column index, not a scatter: compiled, the gradient is then one element-wise pass that writes
    grad_dtype directly (Inductor runs a scatter as a separate kernel over a float32 buffer;
    the same numbers to the bit).
    """
    logits = logits.float()
    counted = targets != IGNORE_INDEX
    safe = torch.where(counted, targets, 0).unsqueeze(1)
    picked = logits.gather(1, safe).squeeze(1)
    peak = logits.amax(dim=1, keepdim=True)
    exp = softmax_numerators(logits, peak)
    sums = exp.sum(dim=1, keepdim=True)
    lse = sums.log() + peak
    loss = torch.where(counted, lse.squeeze(1) - picked, 0.0).sum()
    scale = torch.where(counted.unsqueeze(1), inverse_denominator, 0.0)
    target_column = torch.arange(logits.shape[1], device=logits.device) == safe
    grad = exp.mul_(scale / sums).sub_(torch.where(target_column, scale, 0.0))
    return loss, grad.to(grad_dtype)


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    counted = targets != IGNORE_INDEX
    picked = logits.gather(1, torch.where(counted, targets, 0).unsqueeze(1)).squeeze(1)
    return torch.where(counted, torch.logsumexp(logits, dim=1) - picked, 0.0).sum()


class VocabSplit(Protocol):
    """A vocab-parallel head's part of the loss: the head's weight is this rank's rows of the
    whole (tensor parallelism's `parallel.vocab_loss.VocabShard` implements it)."""

    def loss_and_grad(self, logits: torch.Tensor, targets: torch.Tensor, inverse_denominator: torch.Tensor,
                      grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`_chunk_loss_and_grad` on this rank's columns of the logits, completed over the ranks."""
        ...

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's columns side by side (generation only)."""
        ...


_compiled: dict[tuple, object] = {}


def _compiled_with(fn, backend: str):
    """`fn` compiled with `backend`, once per function and backend."""
    if (fn, backend) not in _compiled:
        if backend == "dvm":
            import hyperparallel.fusion  # noqa: F401  (registers the "dvm" backend)
        _compiled[fn, backend] = torch.compile(fn, backend=backend, dynamic=False)
    return _compiled[fn, backend]


def _loss_and_grad_fn(backend: str | None):
    """The chunk function, compiled with `backend` or as it is."""
    return _chunk_loss_and_grad if backend in (None, "none") else _compiled_with(_chunk_loss_and_grad, backend)


def _whole_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, denominator: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The loss from whole logits, products in `dtype` and the rest in float32 as the chunks compute it."""
    logits = (hidden.to(dtype) @ weight.to(dtype).t()).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum") / denominator


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, denominator, dtype, want_grads, backend, vocab_shard):
        rows, vocab = hidden.shape[0], weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grads else None
        grad_weight = None  # the first chunk's product, summed in float32 from the second chunk on
        step = _chunk_rows(rows, vocab)
        chunk_fn = _loss_and_grad_fn(backend)
        inverse_denominator = 1.0 / denominator
        # the products in `dtype` (autocast's, when it is on), everything else in float32
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for lo in range(0, rows, step):
                h = hidden[lo : lo + step].to(dtype)
                logits = h @ w.t()
                if vocab_shard is not None:  # (the collectives run eagerly: no compiled chunk function)
                    loss, grad_logits = vocab_shard.loss_and_grad(logits, targets[lo : lo + step],
                                                                  inverse_denominator, dtype)
                    total += loss
                    if not want_grads:
                        continue
                elif not want_grads:
                    total += _chunk_loss(logits, targets[lo : lo + step])
                    continue
                else:
                    loss, grad_logits = chunk_fn(logits, targets[lo : lo + step], inverse_denominator, dtype)
                    total += loss
                grad_hidden[lo : lo + step] = grad_logits @ w
                if grad_weight is None:
                    grad_weight = grad_logits.t() @ h
                elif grad_weight.dtype == torch.float32 == dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight = grad_weight.float().add_(grad_logits.t() @ h)
        if want_grads:
            if grad_weight is None:  # (no rows)
                grad_weight = torch.zeros_like(weight)
            elif grad_weight.dtype != weight.dtype and grad_weight.dtype == torch.float32:
                grad_weight = grad_weight.to(weight.dtype)  # (summed in float32; kept until backward in the weight's)
            ctx.weight_dtype = weight.dtype
            ctx.save_for_backward(grad_hidden, grad_weight)
        return total / denominator

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled in the weight's dtype (a one-chunk product in a lower one is cast in the same pass)
        scaled_weight = torch.mul(grad_weight, grad_loss.to(ctx.weight_dtype).view(1, 1))
        return grad_hidden * grad_loss.to(grad_hidden.dtype), scaled_weight, None, None, None, None, None, None


def shift_targets(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position i predicts token i+1: labels shifted left by one, the last position ignored."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    compile: str | None = None,
    vocab_shard: VocabSplit | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T, shifted labels) as HF's ForCausalLMLoss, without the logits.

    hidden [..., H] (the positions of `labels`), weight [V, H]. Give `labels` (shifted here) or
    `shift_labels` (already shifted). The mean over tokens whose target is not -100, or their sum
    divided by `num_items_in_batch` when given (HF's gradient-accumulation convention).
    `compile` names a torch.compile backend: small logits are then computed whole by one compiled
    function (`_WHOLE_ELEMENTS`), larger ones by chunks whose element-wise work it compiles.
    `vocab_shard`: `weight` is this rank's rows of a vocab-parallel head (tensor parallelism); the
    loss is then the whole vocabulary's, and the gradient of `hidden` this rank's part of it.
    """
    targets = shift_targets(labels) if shift_labels is None else shift_labels
    targets = targets.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if flat.shape[0] != targets.shape[0]:
        raise ValueError(f"linear_cross_entropy: {flat.shape[0]} hidden rows but {targets.shape[0]} targets")
    if num_items_in_batch is None:
        # a zero count gives nan, as torch's cross_entropy does for a batch with nothing to count
        denominator = (targets != IGNORE_INDEX).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    if compile not in (None, "none") and vocab_shard is None and flat.shape[0] * weight.shape[0] <= _WHOLE_ELEMENTS:
        dtype = compute_dtype(flat)
        with torch.autocast(hidden.device.type, enabled=False):
            return _compiled_with(_whole_loss, compile)(flat, weight, targets, denominator, dtype)
    want_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(flat, weight, targets, denominator, compute_dtype(flat), want_grads, compile,
                                    vocab_shard)


class FusedLossHead(nn.Module):
    """An `lm_head` (bias-free nn.Linear) that, while deferred, leaves the projection to the loss."""

    def __init__(self, head: nn.Linear, compile: str | None = None):
        super().__init__()
        self.compile = compile  # a torch.compile backend for the loss's element-wise work, or None
        self.in_features = head.in_features
        self.out_features = head.out_features
        self.weight = head.weight  # the same Parameter object: tying, optimizers, checkpoints see no change
        self.deferred = False
        self._handed_out: torch.Tensor | None = None
        self.vocab_shard: VocabSplit | None = None  # set by tensor parallelism: the head is vocab-parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.deferred:
            logits = F.linear(hidden, self.weight)
            if self.vocab_shard is None:
                return logits
            if torch.is_grad_enabled() and hidden.requires_grad:
                raise RuntimeError("a vocab-parallel lm_head makes whole logits only without gradients (generation); "
                                   "training computes its loss inside fused_loss(model)")
            return self.vocab_shard.whole_logits(logits)  # generation only, no autograd
        self._handed_out = hidden
        return hidden

    def take(self, value: torch.Tensor) -> torch.Tensor | None:
        """The hidden states if `value` is what this head just handed out in place of logits."""
        handed, self._handed_out = self._handed_out, None
        return handed if handed is not None and value is handed else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class _FusedCausalLMLoss:
    """The model's loss_function while a FusedLossHead is installed."""

    def __init__(self, head: FusedLossHead, fallback):
        self.head = head
        self.fallback = fallback

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                 shift_labels=None, **kwargs):
        if not self.head.deferred:
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        hidden = self.head.take(logits)
        if hidden is None or ignore_index != IGNORE_INDEX:
            raise RuntimeError("fused_loss: the model's loss was given something other than the lm_head's output; "
                               "this model computes its loss in a way FusedLossHead does not support")
        return linear_cross_entropy(hidden, self.head.weight, labels, shift_labels=shift_labels,
                                    num_items_in_batch=num_items_in_batch, compile=self.head.compile,
                                    vocab_shard=self.head.vocab_shard)


def install_fused_loss(model: nn.Module, compile: str | None = None) -> bool:
    """Swap the model's lm_head for a FusedLossHead; False (nothing changed) where it cannot be.

    Needs a bias-free nn.Linear `lm_head` (an MXFP8 or otherwise replaced head keeps its own path),
    HF's default causal-LM loss, and a forward that hands the head's output to that loss as it is
    (`_head_problem`: not Gemma-2's soft-capped logits, say). `compile`: a torch.compile backend
    for the loss's element-wise work (none: run as it is).
    """
    return fused_loss_problem(model, compile) is None


def fused_loss_problem(model: nn.Module, compile: str | None = None) -> str | None:
    """`install_fused_loss`, saying why it could not (None: installed)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, FusedLossHead):
        head.compile = compile
        return None
    if type(head) is not nn.Linear or head.bias is not None:
        return f"its lm_head is not a bias-free nn.Linear ({type(head).__name__})"
    if not hasattr(model, "loss_function") or getattr(model, "loss_type", None) not in (None, "ForCausalLM") \
            or hasattr(model, "_loss_function"):
        return "its loss is not transformers' causal-LM loss"
    fused = FusedLossHead(head, compile)
    model.loss_function = _FusedCausalLMLoss(fused, model.loss_function)
    model.lm_head = fused
    problem = _head_problem(model)
    if problem is not None:
        model.lm_head = head
        del model._loss_function  # (transformers' loss_function property then gives the model's own again)
    return problem


class _Probed(Exception):
    """Ends `_head_problem`'s forward at the loss (whether the loss got the head's output)."""

    def __init__(self, got_the_head: bool):
        super().__init__()
        self.got_the_head = got_the_head


class _HiddenStates(nn.Module):
    """Stands in for a causal LM's base model in `_head_problem`: its output is hidden states
    on the meta device."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=torch.empty(1, 2, self.hidden_size, device="meta"))


def _head_problem(model: nn.Module) -> str | None:
    """Why `model` (with a FusedLossHead installed) does not hand its lm_head's output to its loss as
    it is, or None where it does (then the fused loss computes what its own computes): its
    causal-LM forward is run once, on the meta device, over a stand-in base model, and the loss
    checks what it is given. A forward that scales, soft-caps or otherwise rewrites the logits
    first (as its config makes it: Gemma-2 with final_logit_softcapping, Cohere's logit_scale), or
    computes its loss otherwise, does not."""
    head, loss = model.lm_head, model.loss_function
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module):
        return f"its base model is not at {prefix!r}"

    def probe(logits, *args, **kwargs):
        raise _Probed(head.take(logits) is not None)

    setattr(model, prefix, _HiddenStates(head.in_features))
    model.loss_function = probe
    head.deferred = True
    try:
        ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
        model(input_ids=ids, labels=ids)
    except _Probed as probed:
        return None if probed.got_the_head else "its forward rewrites the head's logits (scales or soft-caps them) first"
    except Exception as error:  # noqa: BLE001 (a forward that cannot run this way is not one to trust the fused loss with)
        text = str(error).strip()
        return (f"its forward does not run over hidden states alone ({type(error).__name__}"
                + (f": {text.splitlines()[0]}" if text else "") + ")")
    finally:
        head.deferred, head._handed_out = False, None
        setattr(model, prefix, base)
        model.loss_function = loss
    return "its forward never calls its loss_function"


@contextlib.contextmanager
def fused_loss(model: nn.Module):
    """Within this block the model's `.loss` comes from linear_cross_entropy and its `.logits` are
    the last hidden states (the logits are never made). A model without a FusedLossHead is
    left as it is."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, FusedLossHead):
        yield
        return
    head.deferred = True
    try:
        yield
    finally:
        head.deferred = False
        head._handed_out = None

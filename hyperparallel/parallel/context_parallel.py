"""Context parallelism (CP) for Hugging Face decoder models: every sequence split among cp ranks.

Each rank of a CP group holds two chunks of every sequence of the micro-batch (the load-balanced
layout of `context_attention`: chunks r and 2cp-1-r of 2cp). Everything but attention
(embeddings, norms, MLPs, MoE, the loss) works token by token and runs on the local tokens
unchanged; attention is the one place a token meets the others, and there the model's
attention function is replaced by one that exchanges keys / values (ring) or heads (ulysses)
within the group. The model is called with `position_ids` = the global positions of the local
tokens, so rotary embeddings are those of the whole sequence.

Use (every rank of the group, the same model and mode):

    cp = apply_context_parallel(model, cp_group, "ring")          # once, after building
    ids, shift_labels, position_ids, count = context_parallel_batch(input_ids, labels, cp.size, cp.rank)
    loss = model(input_ids=ids, position_ids=position_ids, labels=shift_labels,
                 shift_labels=shift_labels, num_items_in_batch=count).loss
    loss.backward()   # then average the gradients over the group (FSDP's mean does)

The labels are shifted on the whole sequence before sharding (a chunk's last token predicts the
next chunk's first), and each rank's loss is the sum of its tokens' losses over 1/cp of the
whole micro-batch's counted tokens: the mean of the cp ranks' gradients is then the one-process
gradient, and the mean of their losses the one-process loss.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.models.layers import attention_modules, config_values, decoder_layers, token_mixers
from hyperparallel.models.loss import IGNORE_INDEX, shift_targets
from hyperparallel.parallel.context_attention import (
    check_heads,
    check_sequence,
    local_chunks,
    ring_attention,
    ulysses_attention,
)
from hyperparallel.parallel.mesh import CP_MODES

# The name under which transformers dispatches to us; it must not contain "sdpa", "flash" or
# "flex", whose names transformers checks for their own kernels' requirements.
ATTENTION = "hyperparallel_context_parallel"
STATE = "_hp_context_parallel"  # the attribute holding a ContextParallel, on the model and each attention module


def load_balanced_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens `rank` holds, in the order it holds them (LongTensor [S / cp])."""
    check_sequence(seq_len, cp)
    if not 0 <= rank < cp:
        raise ConfigError(f"context-parallel rank {rank} is not in 0..{cp - 1} (cp={cp})")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in local_chunks(cp, rank)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The tokens of `tensor` (sequence along `dim`) that `rank` holds."""
    return tensor.index_select(dim, load_balanced_positions(tensor.shape[dim], cp, rank, tensor.device))


def gather_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (`parts[r]` is rank r's): shard_sequence's inverse."""
    cp = len(parts)
    joined = torch.cat(list(parts), dim=dim)
    held = torch.cat([load_balanced_positions(joined.shape[dim], cp, r, joined.device) for r in range(cp)])
    return joined.index_select(dim, torch.argsort(held))


def context_parallel_batch(ids: torch.Tensor, labels: torch.Tensor, cp: int, rank: int):
    """(local_ids, local_shift_labels, local_position_ids, num_items_in_batch) of a micro-batch
    [B, S] for `rank` of `cp`: the labels shifted on the whole sequence (position i predicts
    token i + 1; -100 at the end and wherever the labels say -100), then sharded; the global
    positions of the local tokens [B, S / cp]; and the counted tokens of the whole micro-batch
    divided by cp (float32), for the model's `num_items_in_batch=`."""
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise ShapeError(f"context_parallel_batch takes input ids and labels of one shape [batch, seq]; got ids "
                         f"{tuple(ids.shape)} and labels {tuple(labels.shape)}")
    positions = load_balanced_positions(ids.shape[1], cp, rank, ids.device)
    shifted = shift_targets(labels)
    counted = (shifted != IGNORE_INDEX).sum().to(torch.float32)
    return (ids.index_select(1, positions), shifted.index_select(1, positions),
            positions.unsqueeze(0).expand(ids.shape[0], -1), counted / cp)


@dataclass
class ContextParallel:
    """How a model's attention runs: the group of cp ranks splitting each sequence, and the mode."""

    group: dist.ProcessGroup
    mode: str
    size: int
    rank: int
    _checked: object = field(default=None, repr=False, compare=False)  # weakref to the last position_ids checked

    def check_positions(self, position_ids: torch.Tensor | None, local_len: int) -> None:
        """The model must be called with the global positions of the local tokens: with any others
        its rotary embeddings would silently disagree with the causal mask, which the attention
        takes from the layout. Every layer gets the same tensor: it is read once per forward
        (one host sync)."""
        if position_ids is None or (self._checked is not None and self._checked() is position_ids):
            return
        want = load_balanced_positions(local_len * self.size, self.size, self.rank, position_ids.device)
        if position_ids.shape[-1] != local_len or not bool((position_ids == want).all()):
            raise ConfigError(f"context parallelism (cp={self.size}, rank {self.rank}) needs the model called with "
                              "position_ids = the global positions of the local tokens (context_parallel_batch's "
                              "third result); packed documents whose positions restart are not supported")
        self._checked = weakref.ref(position_ids)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scaling: float | None) -> torch.Tensor:
        """[B, H, S/cp, D] local query / key / value -> [B, H, S/cp, Dv]: exact causal attention."""
        kernel = ring_attention if self.mode == "ring" else ulysses_attention
        return kernel(query, key, value, self.group, scaling)


def _attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (integrations/sdpa_attention.py), output
    [B, S/cp, H, Dv] as sdpa_attention_forward returns it. The mask is causal by global position
    (our mask function gave transformers' None); the position_ids that transformers passes along
    are only checked against the layout, the loss's arguments it also passes are not read."""
    state = getattr(module, STATE, None)
    name = type(module).__name__
    if state is None:
        raise ConfigError(f"{name} uses attn_implementation {ATTENTION!r} but apply_context_parallel did not "
                          "prepare it; call apply_context_parallel(model, group, mode) on the whole model")
    if attention_mask is not None:
        raise ConfigError(f"{name}: context-parallel attention is causal over the whole sequence and takes no "
                          "attention mask; mark padding with labels of -100 instead")
    if dropout:
        raise ConfigError(f"{name}: context-parallel attention has no dropout (attention_dropout is {dropout})")
    window = kwargs.get("sliding_window")
    if window is not None and window < query.shape[2] * state.size:  # (one as long as the sequence masks nothing)
        raise ConfigError(f"{name}: context-parallel attention does not support sliding_window ({window}) shorter "
                          f"than the sequence ({query.shape[2] * state.size})")
    if kwargs.get("softcap") is not None:
        raise ConfigError(f"{name}: context-parallel attention does not support softcap ({kwargs['softcap']})")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ConfigError(f"{name}: context-parallel attention is causal; this attention is not")
    state.check_positions(kwargs.get("position_ids"), query.shape[2])
    out = state.attention(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """The mask function of our attention: none. transformers would build a mask for the local
    length, and its packed-sequence detection would read the load-balanced positions (which jump
    at the second chunk) as two packed sequences; the attention builds its mask from the layout.
    A padding mask cannot be honoured, so one that masks anything is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ConfigError("context parallelism takes no padding attention_mask (it masks causally over the whole "
                          "sequence); pass attention_mask=None and mark padding with labels of -100")
    return None


def _register() -> None:
    AttentionInterface.register(ATTENTION, _attention_forward)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


def context_parallel_problem(model: nn.Module, seq_len: int | None = None) -> str | None:
    """Why `model` (on the meta device is enough) cannot run context-parallel attention over
    sequences of `seq_len` tokens (None: of any length), or None: every decoder layer's token
    mixing must be plain causal attention through transformers' attention interface (no sliding
    window shorter than the sequence, chunks, sinks, soft-capping, dropout or position-dependent
    scaling), and nothing else may mix tokens along the sequence."""
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        return f"{name} does not dispatch its attention through transformers' AttentionInterface"
    attention = {id(m) for m in attention_modules(model)}
    config = model.config.get_text_config(decoder=True)
    for i, layer in enumerate(decoder_layers(model)):
        inside = [m for m in layer.modules() if id(m) in attention]
        mixers = token_mixers(layer)
        if mixers:
            return f"decoder layer {i} mixes tokens with {mixers[0]} too, which runs over the whole sequence"
        if not inside:
            return f"decoder layer {i} has no attention module through transformers' AttentionInterface"
        for module in inside:
            problem = _attention_problem(module, config, seq_len)
            if problem is not None:
                return f"{type(module).__name__} (decoder layer {i}) {problem}"
    layers = decoder_layers(model)
    within = {id(m) for layer in layers for m in layer.modules()}
    for where, module in model.named_modules():  # (attention outside the decoder layers: BLT's local models)
        if id(module) in attention and id(module) not in within:
            problem = _attention_problem(module, config, seq_len)
            if problem is not None:
                return f"{type(module).__name__} ({where}) {problem}"
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, key, None):
            return f"its attention soft-caps the scores ({key} = {getattr(config, key)})"
    return None


def _attention_problem(module: nn.Module, config, seq_len: int | None) -> str | None:
    """What a Hugging Face attention module does that context-parallel attention does not."""
    from hyperparallel.models.layers import attention_window, layer_type

    dropout = getattr(module, "attention_dropout", 0.0)
    dropout = dropout.p if isinstance(dropout, nn.Dropout) else dropout  # (Persimmon holds an nn.Dropout)
    if dropout:
        return f"has attention dropout ({dropout}); set the model's attention_dropout to 0"
    window = attention_window(module, config)
    if window is not None and (seq_len is None or window < seq_len):
        return f"attends in a sliding window (sliding_window = {window}){_shorter(seq_len)}"
    if layer_type(module, config) == "chunked_attention":
        return f"attends within chunks (attention_chunk_size = {getattr(config, 'attention_chunk_size', None)})"
    if not getattr(module, "is_causal", True):
        return "is not causal"
    own = _own_attention_mask(type(module))
    if own is not None:
        return f"hands the attention a mask of its own ({own}), which context-parallel attention cannot take"
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        return "has attention sinks"
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        return ("scales its queries by their position in its own input (attn_temperature_tuning), which under CP is a "
                "chunk of the sequence")
    return None


@functools.cache
def _own_attention_mask(cls: type) -> str | None:
    """The mask `cls.forward` hands transformers' attention function where it is not the mask the
    model gave it (its `attention_mask` argument) but one it makes itself (Doge's dynamic mask),
    as source text; None otherwise."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface"):
            continue
        given = next((k.value for k in node.keywords if k.arg == "attention_mask"),
                     node.args[4] if len(node.args) > 4 else None)  # (module, q, k, v, mask)
        if given is not None and not (isinstance(given, ast.Name) and given.id == "attention_mask"):
            return ast.unparse(given)
    return None


def _shorter(seq_len: int | None) -> str:
    return f" shorter than the sequence (data.seq_len = {seq_len})" if seq_len is not None else ""


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, mode: str,
                           seq_len: int | None = None) -> ContextParallel:
    """Make every attention layer of `model` run context-parallel attention over `group` (the cp
    ranks; every rank calls it, with the same mode); returns the ContextParallel, also kept as
    `model._hp_context_parallel`. Call once after building the model (before or after FSDP)."""
    if mode not in CP_MODES:
        raise ConfigError(f"context-parallel mode {mode!r} is not one of {', '.join(CP_MODES)}")
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or not model._can_set_attn_implementation():
        raise ConfigError(f"{name} does not dispatch its attention through transformers' AttentionInterface; "
                          "context parallelism needs a Hugging Face model that does")
    layers = attention_modules(model)
    if not layers:
        raise ConfigError(f"{name} has no attention layer that context parallelism can reach (a module whose "
                          "forward calls transformers' attention interface)")
    problem = context_parallel_problem(model, seq_len)
    if problem is not None:
        raise ConfigError(f"parallel.cp: {problem}; context-parallel attention is plain causal attention")
    if not dist.is_initialized():
        raise ConfigError("context parallelism needs torch.distributed initialized (a process group of the cp ranks)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ConfigError(f"rank {dist.get_rank()} is not a member of the context-parallel group it was given")
    if mode == "ulysses":
        for heads in sorted(config_values(model.config.get_text_config(decoder=True), "num_attention_heads")):
            check_heads(heads, size)
    state = ContextParallel(group, mode, size, rank)
    _register()
    model.set_attn_implementation(ATTENTION)
    missed = sorted({type(layer).__name__ for layer in layers
                     if getattr(getattr(layer, "config", model.config), "_attn_implementation", None) != ATTENTION})
    if missed:
        raise ConfigError(f"{name}: transformers did not switch {', '.join(missed)} to context-parallel attention "
                          "(its config keeps another attn_implementation)")
    for module in (model, *layers):
        setattr(module, STATE, state)
    return state

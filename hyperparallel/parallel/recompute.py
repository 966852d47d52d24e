"""Activation recompute per decoder layer.

- ``full``: a layer keeps only its inputs; backward reruns its forward.
- ``selective``: a layer keeps the outputs of its matrix products and attention (the expensive
  ops) and recomputes the cheap element-wise work between them (norms, activations, rotary
  embeddings, residual adds), which holds most of the activation memory of a layer for little
  compute. Built on torch.utils.checkpoint's selective checkpoint contexts.

The layer's forward is replaced on the instance, so module names and state-dict keys stay as
they were (HF checkpoints keep loading).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hyperparallel.errors import ConfigError
from hyperparallel.models.layers import decoder_layers

_aten = torch.ops.aten
# ops whose outputs selective recompute keeps: everything else in a layer is recomputed
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}
if hasattr(_aten, "_grouped_mm"):
    SAVED_OPS.add(_aten._grouped_mm.default)


RECOMPUTE_MODES = ("off", "full", "selective")  # (parallel.recompute)

# custom ops of other layers, by name (hyperparallel.models registers them)
SAVED_OP_NAMES = {"hyperparallel::grouped_mm"}


_kept_nothing = threading.local()


@contextlib.contextmanager
def nothing_kept():
    """Selective recompute keeps no output of an op run inside: for kernels that write into their
    own products in place (ring attention's score tiles), which a kept product would not survive
    (the recompute would read the tile as the kernel left it). Such a kernel is recomputed whole."""
    depth = getattr(_kept_nothing, "depth", 0)
    _kept_nothing.depth = depth + 1
    try:
        yield
    finally:
        _kept_nothing.depth = depth


def _policy(ctx, op, *args, **kwargs):
    if getattr(_kept_nothing, "depth", 0):
        return CheckpointPolicy.PREFER_RECOMPUTE
    saved = op in SAVED_OPS or (hasattr(op, "name") and op.name() in SAVED_OP_NAMES)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed(forward, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Recompute every decoder layer in `mode` (off | full | selective); returns how many."""
    if mode == "off":
        return 0
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"parallel.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    layers = decoder_layers(model)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        # a KV cache is state that the forward appends to: recompute would append again
        config.use_cache = False
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, mode)
        layer._hp_recomputed = True
    return len(layers)


def recomputed(module: nn.Module) -> bool:
    """Whether apply_recompute made `module` run its forward again inside backward (its own
    forward hooks do not run then: what FSDP must gather for that forward, it gathers for backward)."""
    return getattr(module, "_hp_recomputed", False)

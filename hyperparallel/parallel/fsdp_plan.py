"""FSDP for a Hugging Face causal LM: every decoder layer is one sharded group, the root (embeddings,
final norm, output head) another, as DESIGN.md's training step expects."""

from __future__ import annotations

from torch import nn

from hyperparallel.fsdp import fully_shard
from hyperparallel.parallel.recompute import decoder_layers


def shard_model(model: nn.Module, *, geometry: str = "chunk", align: int = 1, process_group=None) -> nn.Module:
    """Shard each decoder layer, then the root, over `process_group` (default: every rank)."""
    options = {"geometry": geometry, "align": align, "process_group": process_group}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    return fully_shard(model, **options)

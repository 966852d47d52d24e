"""FSDP for a Hugging Face causal LM: every decoder layer is one sharded group, the root (embeddings,
final norm, output head) another, as DESIGN.md's training step expects. With expert parallelism,
each layer's experts are a group of their own, sharded over the ranks that hold the same experts.
With HSDP, every group's shards are replicated over `replicate_group` (parallel/mesh.py)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from hyperparallel.fsdp import MixedPrecision, fully_shard
from hyperparallel.models.layers import decoder_layers
from hyperparallel.parallel.expert_parallel import ExpertLayout, expert_modules
from hyperparallel.parallel.recompute import recomputed


def shard_model(model: nn.Module, *, geometry: str = "chunk", align: int = 1, process_group: dist.ProcessGroup | None = None,
                replicate_group: dist.ProcessGroup | None = None, experts: ExpertLayout | None = None, device=None,
                mp_policy: MixedPrecision | None = None) -> nn.Module:
    """Shard each decoder layer, then the root, over `process_group` (default: every rank), and
    replicate the shards over `replicate_group` (HSDP; None: no replicas).

    `experts`: the layout `apply_expert_parallel` split the experts with. Each rank's expert
    gradients then already sum the tokens of its whole EP group, so they are reduced over the
    ranks holding the same experts (and their replicas) and divided by every data-parallel rank
    (a mean over the world's tokens, `experts.world`).
    `device`: where the shards of a model built on the meta device get their memory.
    `mp_policy`: the dtypes of the gathers and the reductions (parallel/mixed_precision.py)."""
    options = {"geometry": geometry, "align": align, "device": device, "mp_policy": mp_policy}
    for layer in decoder_layers(model):
        if experts is not None:
            for module in expert_modules(layer):
                fully_shard(module, process_group=experts.shard_group, replicate_group=experts.replicate_group,
                            gradient_divide_factor=experts.world, **options)
        fully_shard(layer, process_group=process_group, replicate_group=replicate_group,
                    replays_forward=recomputed(layer), **options)
    return fully_shard(model, process_group=process_group, replicate_group=replicate_group, **options)

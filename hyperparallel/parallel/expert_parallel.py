"""Expert parallelism (EP) for a model whose experts are hyperparallel.moe.GroupedExperts (inside a
tuned family's MoEBlock, or inside the MoE block transformers wrote, models/moe_blocks.py).

The EP ranks are borrowed from the data-parallel ones, as torchtitan borrows them: the world's
ranks form a (expert_shard x ep) mesh; each group of `ep` consecutive ranks splits every MoE
layer's experts among its members (any count: 10 experts on 4 ranks are 3, 3, 2, 2), and the
ranks at the same place in every group hold the same experts, which FSDP then shards among
them (`shard_model`). Non-expert parameters are sharded over every rank as without EP. With
HSDP the mesh is that within each replica (parallel/mesh.py), and each expert's shards are
replicated over the replicas, as every other shard is.

Each rank keeps the same Parameter objects with only its experts' rows (`.data` replaced), and
records where they sit in the whole (`fsdp.set_shard_info`: the global shape and the first expert),
so a checkpoint holds every expert once with its global shape and loads into any other ep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import ShardInfo, set_shard_info
from hyperparallel.moe import GroupedExperts, MegaMoE, MoEBlock, MoEShape
from hyperparallel.moe.dispatch import ExpertParallel, dispatch_format, expert_ranges
from hyperparallel.parallel.mesh import MeshShape, ParallelMesh, build_mesh


@dataclass(frozen=True)
class ExpertLayout:
    ep: int
    ep_group: dist.ProcessGroup  # the ranks that split the experts among them (this rank's)
    shard_group: dist.ProcessGroup  # the ranks that hold the same experts as this rank
    # the ranks whose tokens each expert's gradient sums (dp_replicate x dp_shard x cp): its mean's divisor
    world: int
    # HSDP: the ranks of the other replicas holding the same experts' shards (a group of one without)
    replicate_group: dist.ProcessGroup

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)


def expert_layout(ep: int) -> ExpertLayout:
    """The groups of an `ep`-way expert parallelism over every rank, which FSDP alone shares
    (dp_shard = the world; a collective: every rank calls it)."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ConfigError(f"parallel.ep ({ep}) must divide the number of ranks ({world})")
    return expert_layout_of(build_mesh(MeshShape(dp_shard=world, ep=ep)))


def expert_layout_of(mesh: ParallelMesh) -> ExpertLayout:
    """The expert parallelism of a ParallelMesh (its ep groups sit within one replica and one tp
    coordinate; an expert's shards are replicated over the mesh's replicate group, the ranks at the
    same place in every replica)."""
    shape = mesh.shape
    return ExpertLayout(shape.ep, mesh.ep_group, mesh.expert_shard_group, shape.dp_replicate * shape.shard_size,
                        mesh.replicate_group)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def routed_experts(model: nn.Module) -> list[tuple[GroupedExperts, MoEBlock | None]]:
    """Every GroupedExperts of `model`, with the MoEBlock holding it (None: transformers' own block)."""
    in_blocks = {id(block.experts): block for block in moe_blocks(model)}
    return [(m, in_blocks.get(id(m))) for m in model.modules() if isinstance(m, GroupedExperts)]


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, layout: ExpertLayout, *, implementation: str = "sequential",
                          waves: int = 1, dispatch: str = "compute") -> int:
    """Keep only this rank's experts in every MoE layer and route tokens through the EP group;
    returns how many layers. Call before fully_shard and before building the optimizer. A MoEBlock
    dispatches (MegaMoE then overlaps its shared experts too); experts inside transformers' own
    block dispatch from their forward.

    `implementation`: "sequential" (ExpertParallel) or "megamoe" (MegaMoE with `waves` waves);
    `dispatch`: moe.dispatch (auto, compute or mx), the rows' format on the way to each layer's
    experts (`dispatch_format`: a ConfigError for mx to experts that are not MXFP8). Call after
    lowp.convert, whose recipes decide it."""
    layers = routed_experts(model)
    formats = [dispatch_format(dispatch, experts) for experts, _ in layers]  # (every layer checked before any changes)
    for (experts, block), rows in zip(layers, formats, strict=True):
        total = keep_local_experts(experts, layout.ep, layout.ep_rank)
        dispatcher = (MegaMoE(layout.ep_group, total, waves, dispatch=rows) if implementation == "megamoe"
                      else ExpertParallel(layout.ep_group, total, dispatch=rows))
        if block is not None:
            block.dispatcher = dispatcher
        else:
            experts.dispatcher = dispatcher
    return len(layers)


@torch.no_grad()
def keep_local_experts(experts: GroupedExperts, ep: int, ep_rank: int) -> int:
    """Keep only expert-parallel rank `ep_rank`'s experts (of `ep`): the rows of every per-expert
    parameter (weights and biases); returns how many it had. (Also what `hyperparallel plan` does
    to a rank's fake model: the same rows, no groups.)"""
    total = experts.num_experts
    offset, count = expert_ranges(total, ep)[ep_rank]
    for param in experts.parameters(recurse=False):
        if _per_expert(param, total):
            global_shape = param.shape
            param.data = param.data[offset:offset + count].clone()
            set_shard_info(param, ShardInfo(global_shape, offset, count))
    experts.num_experts = count
    return total


def shared_by_experts(experts: GroupedExperts) -> list[str]:
    """The parameters of `experts` that all its experts share (a norm after every expert: MuseSpark's
    post_expert_norm): expert parallelism would keep a copy per rank, trained on that rank's
    experts' tokens only."""
    per_expert = {id(p) for p in experts.parameters(recurse=False) if _per_expert(p, experts.num_experts)}
    return [name for name, p in experts.named_parameters() if id(p) not in per_expert]


def _per_expert(param: nn.Parameter, experts: int) -> bool:
    return param.dim() >= 2 and param.shape[0] == experts


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The experts modules under `module` that expert parallelism split."""
    return [experts for experts, block in routed_experts(module)
            if (block.dispatcher if block is not None else experts.dispatcher) is not None]


def moe_shape(model: nn.Module, tokens: int, element_bytes: int) -> MoEShape:
    """The shape of `model`'s first MoE layer for `tokens` tokens a rank: what MegaMoE's cost model
    plans waves for (a MoEBlock's shared experts included; a block transformers wrote runs its own
    apart). Before or after expert parallelism keeps a rank's experts: the counts it reads are the
    layer's (`routed_experts`)."""
    from hyperparallel.models.flops import top_k_of

    experts, block = routed_experts(model)[0]
    shared = block.shared_experts if block is not None else None
    shared_intermediate = sum(p.numel() for p in shared.parameters()) // (3 * experts.hidden_dim) if shared else 0
    return MoEShape(tokens=tokens, hidden=experts.hidden_dim, intermediate=experts.intermediate_dim,
                    experts=experts.routed_experts, top_k=top_k_of(model, experts),
                    shared_intermediate=shared_intermediate, element_bytes=element_bytes)

"""Expert parallelism (EP) for a model of hyperparallel.moe.MoEBlocks.

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
from hyperparallel.moe import MegaMoE, MoEBlock
from hyperparallel.moe.dispatch import ExpertParallel, expert_ranges
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


def expert_layout(ep: int, device_type: str) -> ExpertLayout:
    """The groups of an `ep`-way expert parallelism over every rank, which FSDP alone shares
    (dp_shard = the world; a collective: every rank calls it)."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ConfigError(f"parallel.ep ({ep}) must divide the number of ranks ({world})")
    return expert_layout_of(build_mesh(MeshShape(dp_shard=world, ep=ep), device_type))


def expert_layout_of(mesh: ParallelMesh) -> ExpertLayout:
    """The expert parallelism of a ParallelMesh (its ep groups sit within one replica and one tp
    coordinate; an expert's shards are replicated over the mesh's replicate group, the ranks at the
    same place in every replica)."""
    shape = mesh.shape
    return ExpertLayout(shape.ep, mesh.ep_group, mesh.expert_shard_group, shape.dp_replicate * shape.shard_size,
                        mesh.replicate_group)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, layout: ExpertLayout, *, implementation: str = "sequential",
                          waves: int = 1) -> int:
    """Keep only this rank's experts in every MoEBlock and route tokens through the EP group;
    returns how many blocks. Call before fully_shard and before building the optimizer.

    `implementation`: "sequential" (ExpertParallel) or "megamoe" (MegaMoE with `waves` waves)."""
    blocks = moe_blocks(model)
    for block in blocks:
        total = keep_local_experts(block, layout.ep, layout.ep_rank)
        block.dispatcher = (MegaMoE(layout.ep_group, total, waves) if implementation == "megamoe"
                            else ExpertParallel(layout.ep_group, total))
    return len(blocks)


@torch.no_grad()
def keep_local_experts(block: MoEBlock, ep: int, ep_rank: int) -> int:
    """Keep only expert-parallel rank `ep_rank`'s experts of `block` (of `ep`); returns how many it
    had. (Also what `hyperparallel plan` does to a rank's fake model: the same rows, no groups.)"""
    experts = block.experts
    total = experts.num_experts
    offset, count = expert_ranges(total, ep)[ep_rank]
    for param in (experts.gate_up_proj, experts.down_proj):
        global_shape = param.shape
        param.data = param.data[offset:offset + count].clone()
        set_shard_info(param, ShardInfo(global_shape, offset, count))
    experts.num_experts = count
    return total


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The experts modules under `module` that expert parallelism split."""
    return [block.experts for block in moe_blocks(module) if block.dispatcher is not None]

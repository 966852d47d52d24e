"""The ranks of a run laid out as a device mesh: dp_shard x cp x tp, tensor parallelism innermost
(consecutive ranks, the fastest links), expert parallelism borrowed from dp_shard x cp.

Each dimension is a `torch.distributed.device_mesh` dimension; the groups a plan needs are
read from three meshes over the same world (every rank builds all of them, in the same order):

- (dp_shard, cp, tp): `tp` (the ranks splitting each weight) and `cp` (the ranks splitting
  each sequence);
- (dp_shard x cp, tp): `fsdp`, the ranks FSDP shards the TP-local weights over (a context-parallel
  rank holds the same weights as its peers, so they shard them too, as torchtitan does);
- (expert_shard, ep, tp) with ep x expert_shard = dp_shard x cp: `ep`, the ranks splitting the
  experts, and `expert_shard`, the ranks holding the same experts.

A data-parallel replica is one (dp_shard) coordinate: its tp x cp ranks read the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hyperparallel.errors import ConfigError

CP_MODES = ("ring", "ulysses")  # how context parallelism's attention exchanges the sequence (parallel.cp_mode)


@dataclass(frozen=True)
class MeshShape:
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_shard * self.cp * self.tp


def check_mesh_shape(shape: MeshShape, world: int) -> None:
    """ConfigError naming each dimension when the layout does not fit `world` ranks."""
    if shape.world != world:
        raise ConfigError(f"parallel.dp_shard ({shape.dp_shard}) x parallel.cp ({shape.cp}) x parallel.tp "
                          f"({shape.tp}) = {shape.world} ranks, but this run has {world}; make their product "
                          f"{world}, or launch {shape.world} ranks (--nproc {shape.world})")
    borrowed = shape.dp_shard * shape.cp
    if shape.ep > 1 and borrowed % shape.ep:
        raise ConfigError(f"parallel.ep ({shape.ep}) borrows its ranks from parallel.dp_shard ({shape.dp_shard}) x "
                          f"parallel.cp ({shape.cp}) = {borrowed}: that product must be a multiple of ep")


@dataclass(frozen=True)
class ParallelMesh:
    shape: MeshShape
    tp_group: object
    cp_group: object
    fsdp_group: object  # dp_shard x cp: what FSDP shards over
    ep_group: object | None  # None without expert parallelism
    expert_shard_group: object | None
    device_mesh: object  # the (dp_shard, cp, tp) DeviceMesh

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def cp(self) -> int:
        return self.shape.cp

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp > 1 else 0

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group) if self.cp > 1 else 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: which share of the global batch it reads."""
        return self.device_mesh.get_local_rank("dp_shard")

    @property
    def dp_size(self) -> int:
        return self.shape.dp_shard


def build_mesh(shape: MeshShape, device_type: str) -> ParallelMesh:
    """The groups of `shape` over every rank (collective: every rank calls it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_mesh_shape(shape, world)
    mesh = init_device_mesh(device_type, (shape.dp_shard, shape.cp, shape.tp), mesh_dim_names=("dp_shard", "cp", "tp"))
    fsdp = init_device_mesh(device_type, (shape.dp_shard * shape.cp, shape.tp), mesh_dim_names=("fsdp", "tp"))
    ep_group = expert_shard_group = None
    if shape.ep > 1:
        experts = init_device_mesh(device_type, (shape.dp_shard * shape.cp // shape.ep, shape.ep, shape.tp),
                                   mesh_dim_names=("expert_shard", "ep", "tp"))
        ep_group, expert_shard_group = experts.get_group("ep"), experts.get_group("expert_shard")
    return ParallelMesh(shape, mesh.get_group("tp"), mesh.get_group("cp"), fsdp.get_group("fsdp"), ep_group,
                        expert_shard_group, mesh)

"""The ranks of a run laid out as a device mesh: dp_replicate x dp_shard x cp x tp, row-major,
tensor parallelism innermost (consecutive ranks, the fastest links), expert parallelism
borrowed from dp_shard x cp within each replica.

Each dimension is a `torch.distributed.device_mesh` dimension; the groups a plan needs are read
from three meshes over the same world (every rank builds all of them, in the same order), all
described by `MeshShape.meshes` and listed, rank by rank, by `MeshShape.groups` (a pure
function: what `build_mesh` makes, and what the run summary prints):

- (dp_replicate, dp_shard, cp, tp): `tp` (the ranks splitting each weight), `cp` (the ranks
  splitting each sequence) and `dp_replicate` (HSDP: the ranks holding the same shards);
- (dp_replicate, dp_shard x cp, tp): `fsdp`, the ranks FSDP shards the TP-local weights over,
  within one replica (a context-parallel rank holds the same weights as its peers, so they shard
  them too, as torchtitan does);
- (dp_replicate, expert_shard, ep, tp) with ep x expert_shard = dp_shard x cp: `ep`, the ranks
  splitting the experts, and `expert_shard`, the ranks of one replica holding the same experts.
  Their replicas are the `dp_replicate` group's: the same ranks (the same (dp_shard, cp, tp)
  coordinates in every replica).

With tp innermost and dp_replicate outermost, a shard group's ranks (dp_shard x cp x tp
consecutive ranks) sit on one machine whenever they fit in it, and only the replicas' all-reduce
of the gradients crosses machines (docs/parallel.md, "HSDP").

A data-parallel rank is one (dp_replicate, dp_shard) coordinate: its tp x cp ranks read the same
batch, and there are dp_replicate x dp_shard of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from hyperparallel.errors import ConfigError

CP_MODES = ("ring", "ulysses")  # how context parallelism's attention exchanges the sequence (parallel.cp_mode)
MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # the device mesh's dimensions, outermost first


@dataclass(frozen=True)
class MeshShape:
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    dp_replicate: int = 1  # HSDP: copies of the dp_shard x cp sharding (1: plain FSDP)

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shard_size(self) -> int:
        """The ranks of one FSDP group: dp_shard x cp."""
        return self.dp_shard * self.cp

    def meshes(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """The device meshes the groups are read from: name -> (sizes, dimension names), each laid
        over the ranks 0 .. world - 1 in row-major order (as init_device_mesh lays them)."""
        r, s, c, t = self.dp_replicate, self.dp_shard, self.cp, self.tp
        meshes = {"ranks": ((r, s, c, t), MESH_DIMS),
                  "fsdp": ((r, s * c, t), ("dp_replicate", "fsdp", "tp"))}
        if self.ep > 1:
            meshes["experts"] = ((r, s * c // self.ep, self.ep, t), ("dp_replicate", "expert_shard", "ep", "tp"))
        return meshes

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind (tp, cp, dp_replicate, dp_shard, fsdp; with EP expert_shard and
        ep) as its global ranks, in group-rank order. A pure function of the shape."""
        groups: dict[str, list[list[int]]] = {}
        for sizes, names in self.meshes().values():
            ranks = torch.arange(self.world).view(sizes)
            for dim, name in enumerate(names):  # (dp_replicate and tp are the same groups in every mesh)
                groups.setdefault(name, ranks.movedim(dim, -1).reshape(-1, sizes[dim]).tolist())
        return groups

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s place on each of MESH_DIMS."""
        place, sizes = {}, dict(zip(MESH_DIMS, (self.dp_replicate, self.dp_shard, self.cp, self.tp), strict=True))
        for name in reversed(MESH_DIMS):
            rank, place[name] = divmod(rank, sizes[name])
        return place


def check_mesh_shape(shape: MeshShape, world: int) -> None:
    """ConfigError naming each dimension when the layout does not fit `world` ranks."""
    if shape.world != world:
        raise ConfigError(f"parallel.dp_replicate ({shape.dp_replicate}) x parallel.dp_shard ({shape.dp_shard}) x "
                          f"parallel.cp ({shape.cp}) x parallel.tp ({shape.tp}) = {shape.world} ranks, but this run has "
                          f"{world}; make their product {world}, or launch {shape.world} ranks (--nproc {shape.world})")
    if shape.ep > 1 and shape.shard_size % shape.ep:
        raise ConfigError(f"parallel.ep ({shape.ep}) borrows its ranks from parallel.dp_shard ({shape.dp_shard}) x "
                          f"parallel.cp ({shape.cp}) = {shape.shard_size}: that product must be a multiple of ep")


@dataclass(frozen=True)
class ParallelMesh:
    shape: MeshShape
    rank: int  # this process's global rank
    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    fsdp_group: dist.ProcessGroup  # dp_shard x cp within one replica: what FSDP shards over
    replicate_group: dist.ProcessGroup  # dp_replicate: the ranks holding the same shards (HSDP)
    ep_group: dist.ProcessGroup | None  # None without expert parallelism
    expert_shard_group: dist.ProcessGroup | None

    @property
    def tp(self) -> int:
        return self.shape.tp

    @property
    def cp(self) -> int:
        return self.shape.cp

    @property
    def dp_replicate(self) -> int:
        return self.shape.dp_replicate

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp > 1 else 0

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group) if self.cp > 1 else 0

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: which share of the global batch it reads."""
        place = self.shape.coordinates(self.rank)
        return place["dp_replicate"] * self.shape.dp_shard + place["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.shape.dp_replicate * self.shape.dp_shard


def build_mesh(shape: MeshShape, device_type: str) -> ParallelMesh:
    """The groups of `shape` over every rank (collective: every rank calls it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_mesh_shape(shape, world)
    meshes = {name: init_device_mesh(device_type, sizes, mesh_dim_names=names)
              for name, (sizes, names) in shape.meshes().items()}
    ranks, experts = meshes["ranks"], meshes.get("experts")
    return ParallelMesh(
        shape, dist.get_rank() if dist.is_initialized() else 0,
        tp_group=ranks.get_group("tp"), cp_group=ranks.get_group("cp"), fsdp_group=meshes["fsdp"].get_group("fsdp"),
        replicate_group=ranks.get_group("dp_replicate"),
        ep_group=experts.get_group("ep") if experts is not None else None,
        expert_shard_group=experts.get_group("expert_shard") if experts is not None else None,
    )


def _listed(groups: list[list[int]], shown: int = 4) -> str:
    text = " ".join(str(g) for g in groups[:shown])
    return text + (f" ... ({len(groups)} in all)" if len(groups) > shown else "")


def describe_groups(shape: MeshShape, local_world: int | None) -> list[str]:
    """The run summary's lines on data parallelism's groups: with HSDP, which ranks form the shard
    groups and which the replica groups; and, given the ranks per machine (LOCAL_WORLD_SIZE), a
    warning when a shard group spans machines (FSDP's all-gathers then cross the slow links)."""
    groups = shape.groups()
    lines = []
    if shape.dp_replicate > 1:
        lines.append(f"HSDP: {shape.dp_replicate} replicas x FSDP over {shape.shard_size} rank(s); shard groups "
                     f"{_listed(groups['fsdp'])}; replica groups {_listed(groups['dp_replicate'])}")
    if local_world and shape.shard_size > 1:
        spans = max(len({rank // local_world for rank in group}) for group in groups["fsdp"])
        if spans > 1:
            fix = "; parallel.dp_replicate keeps them on one (shard within a machine, replicate across)" \
                if shape.dp_replicate == 1 else ""
            lines.append(f"FSDP shard groups span {spans} machines ({local_world} ranks on each): every layer's "
                         f"all-gather and reduce-scatter crosses the links between machines{fix}")
    return lines

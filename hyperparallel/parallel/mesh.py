"""The ranks of a run laid out as a device mesh: pp x dp_replicate x dp_shard x cp x tp,
row-major, tensor parallelism innermost (consecutive ranks, the fastest links), pipeline stages
outermost (each stage's ranks a block of consecutive ranks: a whole mesh of the other dimensions,
whose groups are laid out within it as in a run without pp), expert parallelism borrowed from
dp_shard x cp within each replica.

`MeshShape` is the layout as numbers, every axis present (size 1 when unused): a pure value that
`hyperparallel plan` reasons about without ranks, and the one place that validates a layout
(`layout_problems`). `ParallelMesh` is that shape over this run's ranks: a typed process group
per axis, built once (`build_mesh`) and taken by every stage of the build and the step, whatever the layout:
a size-1 axis has a group of one rank, so callers ask `mesh.tp_enabled`, never whether a mesh
exists. As torchtitan's ParallelDims, it exists on one rank too (a process group of one).

Each group is a dimension of one of three meshes over the same world, laid out as
`torch.distributed.device_mesh` lays them, all described by `MeshShape.meshes` and listed, rank
by rank, by `MeshShape.groups` (a pure function: the groups `build_mesh` makes for the kinds a
run uses, every rank every one, in the same order, and what the run summary prints):

- (pp, dp_replicate, dp_shard, cp, tp): `pp` (the ranks holding the pipeline's stages, one of
  each: activations pass along it), `tp` (the ranks splitting each weight), `cp` (the ranks
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
batch, and there are dp_replicate x dp_shard of them. A config that names no dimension on N > 1
ranks is plain data parallelism: the shape dp_replicate = N, replicated by DDP (`ddp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyperparallel.errors import ConfigError
from hyperparallel.process_groups import made_once

# pipeline schedules (parallel.pp_schedule), torch.distributed.pipelining's: one stage a rank
# (gpipe, 1f1b) or several (interleaved_1f1b). Not yet: its zero-bubble ones (zbv, dualpipev),
# whose backward writes the weights' gradients outside FSDP's gradient hooks.
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
CP_MODES = ("ring", "ulysses")  # how context parallelism's attention exchanges the sequence (parallel.cp_mode)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the device mesh's dimensions, outermost first
GROUPS = ("pp", "stage", "tp", "cp", "dp_replicate", "fsdp", "ep", "expert_shard", "world")  # a ParallelMesh's process groups


@dataclass(frozen=True)
class MeshShape:
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1  # HSDP: copies of the dp_shard x cp sharding (1: plain FSDP); with ddp, the ranks
    ddp: bool = False  # the config names no dimension: its dp_replicate ranks each hold the whole model (DDP)
    pp: int = 1  # pipeline stages (the outermost dimension)

    @classmethod
    def of(cls, parallel, world: int) -> MeshShape:
        """The layout `parallel` (the trainer's parallel: section, or anything with its fields) names
        over `world` ranks; naming none on several ranks is data parallelism (DDP) over them."""
        pp = getattr(parallel, "pp", 1)
        if pp * parallel.dp_replicate * parallel.dp_shard * parallel.cp * parallel.tp == 1 and world > 1:
            return cls(dp_replicate=world, ep=parallel.ep, ddp=True)
        return cls(dp_shard=parallel.dp_shard, cp=parallel.cp, tp=parallel.tp, ep=parallel.ep,
                   dp_replicate=parallel.dp_replicate, pp=pp)

    @property
    def world(self) -> int:
        return self.pp * self.stage_world

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage (all of them without pp)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shard_size(self) -> int:
        """The ranks of one FSDP group: dp_shard x cp (1 where nothing is sharded)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """The ranks of one replica holding the same experts (FSDP shards them over these)."""
        return self.shard_size // self.ep

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: each reads its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """The model is sharded by FSDP (over `shard_size` ranks, perhaps 1 under tp or HSDP): any
        layout the config names over more than one rank."""
        return self.world > 1 and not self.ddp

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def dims(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp, "ep": self.ep}

    def meshes(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """The device meshes the groups are read from: name -> (sizes, dimension names), each laid
        over the ranks 0 .. world - 1 in row-major order (as init_device_mesh lays them). The
        experts mesh only with expert parallelism: without, its groups are the fsdp group and one
        rank alone."""
        p, r, s, c, t = self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp
        meshes = {"ranks": ((p, r, s, c, t), MESH_DIMS),
                  "fsdp": ((p, r, s * c, t), ("pp", "dp_replicate", "fsdp", "tp"))}
        if self.ep_enabled:
            meshes["experts"] = ((p, r, s * c // self.ep, self.ep, t),
                                 ("pp", "dp_replicate", "expert_shard", "ep", "tp"))
        return meshes

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind (tp, cp, dp_replicate, dp_shard, fsdp, expert_shard, ep) as its
        global ranks, in group-rank order. A pure function of the shape."""
        groups: dict[str, list[list[int]]] = {}
        for sizes, names in self.meshes().values():
            ranks = torch.arange(self.world).view(sizes)
            for dim, name in enumerate(names):  # (dp_replicate and tp are the same groups in every mesh)
                groups.setdefault(name, ranks.movedim(dim, -1).reshape(-1, sizes[dim]).tolist())
        if not self.ep_enabled:  # (every rank holds every expert: its fsdp group shards them)
            groups.update(expert_shard=groups["fsdp"], ep=[[rank] for rank in range(self.world)])
        groups["stage"] = torch.arange(self.world).view(self.pp, self.stage_world).tolist()
        return groups

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s place on each of MESH_DIMS."""
        place, sizes = {}, dict(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                    strict=True))
        for name in reversed(MESH_DIMS):
            rank, place[name] = divmod(rank, sizes[name])
        return place

    def dp_rank(self, rank: int) -> int:
        """`rank`'s data-parallel rank: which share of the global batch it reads."""
        place = self.coordinates(rank)
        return place["dp_replicate"] * self.dp_shard + place["dp_shard"]


def layout_problems(parallel, world: int) -> list[str]:
    """Every problem of the layout `parallel` names (the trainer's parallel: section) on `world`
    ranks, one line each: the one place a layout is validated (the model's own limits, such as
    heads that tp must divide, are preflight's)."""
    problems = []
    p = parallel
    ep, dp_replicate, dp_shard, tp, cp, pp = p.ep, p.dp_replicate, p.dp_shard, p.tp, p.cp, getattr(p, "pp", 1)
    named = pp * dp_replicate * dp_shard * cp * tp
    if dp_replicate == 1 and pp * tp * cp == 1:
        if dp_shard > 1 and dp_shard != world:
            replicate = (f", or parallel.dp_replicate: {world // dp_shard} to replicate that sharding over the "
                         f"{world} ranks (HSDP)" if world > dp_shard and world % dp_shard == 0 else "")
            problems.append(f"parallel.dp_shard = {dp_shard} shards the model over that many ranks, but this "
                            f"run has {world}; launch it with hyperparallel train --nproc {dp_shard}{replicate}")
    elif named != world:
        stages = f"parallel.pp ({pp}) x " if pp > 1 else ""
        problems.append(f"{stages}parallel.dp_replicate ({dp_replicate}) x parallel.dp_shard ({dp_shard}) x "
                        f"parallel.cp ({cp}) x parallel.tp ({tp}) = {named} ranks, but this run has {world}; make "
                        f"their product {world}, or launch hyperparallel train --nproc {named}")
    if pp > 1:
        problems += pipeline_layout_problems(p)
    borrowed = dp_shard * cp
    if ep > 1 and (borrowed == 1 or borrowed % ep):
        if dp_replicate == 1:
            choices = [n for n in range(2, world + 1) if world % n == 0]
            fix = f"dp_shard: {world} and ep one of {choices}" if choices else "at least 2 ranks (--nproc)"
        else:  # (within each replica)
            choices = [n for n in range(2, borrowed + 1) if borrowed % n == 0]
            fix = (f"ep one of {choices}" if choices else
                   "shard within each replica (dp_shard > 1), the dimension ep borrows from")
        within = f" within each of parallel.dp_replicate = {dp_replicate} replicas" if dp_replicate > 1 else ""
        problems.append(f"parallel.ep = {ep} borrows its ranks from parallel.dp_shard = {dp_shard} x parallel.cp = {cp}"
                        f"{within}: that product must be a multiple of ep (the ranks sharing each expert's shards x "
                        f"ep); with {world} rank(s): {fix}")
    if tp > 1 and cp > 1:
        problems.append(f"parallel.tp = {tp} with parallel.cp = {cp}: tensor and context parallelism together are not "
                        f"supported yet; use one of them (with dp_shard)")
    if p.sync_every_micro_batch and named == 1:
        problems.append("parallel.sync_every_micro_batch reduce-scatters each micro-batch's gradients into FSDP's "
                        "shards, and this layout is not sharded (DDP reduces once a step); set parallel.dp_shard > 1, "
                        "or sync_every_micro_batch: false")
    if p.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel splits the sequence between tensor-parallel blocks, and "
                        "parallel.tp is 1; set parallel.tp > 1 or sequence_parallel: false")
    return problems


def pipeline_layout_problems(parallel) -> list[str]:
    """What the pipeline settings ask of each other (the model's layer count is the build's)."""
    p, problems = parallel, []
    stages_per_rank = p.pp_virtual_stages
    if p.pp_schedule in ("1f1b", "gpipe") and stages_per_rank != 1:
        problems.append(f"parallel.pp_schedule: {p.pp_schedule} runs one stage a rank, and parallel.pp_virtual_stages "
                        f"is {stages_per_rank}; use pp_schedule: interleaved_1f1b, or pp_virtual_stages: 1")
    if p.pp_schedule == "interleaved_1f1b" and stages_per_rank < 2:
        problems.append("parallel.pp_schedule: interleaved_1f1b interleaves several stages a rank; set "
                        "parallel.pp_virtual_stages: 2 or more (or use 1f1b)")
    if p.sequence_parallel:
        problems.append(f"parallel.pp = {p.pp} with parallel.sequence_parallel: the stages would hand each other "
                        f"a part of the sequence (not supported yet); set sequence_parallel: false")
    if p.sync_every_micro_batch:
        problems.append("parallel.sync_every_micro_batch with parallel.pp: a pipeline reduces its stages' gradients "
                        "once, after the schedule's last backward; set sync_every_micro_batch: false")
    stages = p.pp * stages_per_rank
    if p.pp_layers is not None and (len(p.pp_layers) != stages or min(p.pp_layers) < 1):
        problems.append(f"parallel.pp_layers gives {len(p.pp_layers)} stage(s) ({p.pp_layers}); the pipeline has "
                        f"pp x pp_virtual_stages = {stages}, each with at least one decoder layer")
    return problems


def _check_fits(shape: MeshShape, world: int) -> None:
    """What build_mesh refuses of a shape a caller made (a config's layout was checked, with the
    fixes to name, by layout_problems before any work)."""
    if shape.world != world:
        raise ConfigError(f"parallel.pp ({shape.pp}) x parallel.dp_replicate ({shape.dp_replicate}) x parallel.dp_shard ({shape.dp_shard}) x "
                          f"parallel.cp ({shape.cp}) x parallel.tp ({shape.tp}) = {shape.world} ranks, but this run has "
                          f"{world}; make their product {world}, or launch {shape.world} ranks (--nproc {shape.world})")
    if shape.shard_size % shape.ep:
        raise ConfigError(f"parallel.ep ({shape.ep}) borrows its ranks from parallel.dp_shard ({shape.dp_shard}) x "
                          f"parallel.cp ({shape.cp}) = {shape.shard_size}: that product must be a multiple of ep")


@dataclass(frozen=True)
class ParallelMesh:
    """A MeshShape over this run's ranks: one process group per axis (GROUPS), every axis present
    (a size-1 axis: a group of this rank alone); its sizes are `mesh.shape`'s."""

    shape: MeshShape
    rank: int  # this process's rank in the mesh
    groups: dict[str, dist.ProcessGroup]  # GROUPS' names -> this rank's group of that kind

    # the shape's answers, asked of the mesh
    @property
    def pp_enabled(self) -> bool:
        return self.shape.pp_enabled

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (its first, with virtual stages: parallel/pipeline.py)."""
        return self.coordinates["pp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The ranks with this rank's place in every other stage: one rank of each stage."""
        return self.groups["pp"]

    @property
    def stage_group(self) -> dist.ProcessGroup:
        """The ranks holding this rank's pipeline stages (every rank without pp)."""
        return self.groups["stage"]

    @property
    def fsdp_enabled(self) -> bool:
        return self.shape.fsdp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.shape.hsdp_enabled

    @property
    def ddp_enabled(self) -> bool:
        return self.shape.ddp

    @property
    def tp_enabled(self) -> bool:
        return self.shape.tp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.shape.cp_enabled

    @property
    def ep_enabled(self) -> bool:
        return self.shape.ep_enabled

    @property
    def dp_size(self) -> int:
        return self.shape.dp_size

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.groups["tp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.groups["cp"]

    @property
    def fsdp_group(self) -> dist.ProcessGroup:
        """dp_shard x cp within one replica: what FSDP shards over."""
        return self.groups["fsdp"]

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        """dp_replicate: the ranks holding the same shards (HSDP), or the same model (DDP)."""
        return self.groups["dp_replicate"]

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.groups["ep"]

    @property
    def expert_shard_group(self) -> dist.ProcessGroup:
        return self.groups["expert_shard"]

    @property
    def world_group(self) -> dist.ProcessGroup:
        """Every rank of the mesh (the default group's, but for a one-rank mesh inside a larger one)."""
        return self.groups["world"]

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place on each of MESH_DIMS."""
        return self.shape.coordinates(self.rank)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: which share of the global batch it reads."""
        return self.shape.dp_rank(self.rank)


def build_mesh(shape: MeshShape) -> ParallelMesh:
    """The groups of `shape` over the ranks of the default process group (collective: every rank
    calls it), in the default group's backends. A one-rank shape inside a larger group (a reference
    computed on one rank of a test's spawn) gets a group of this rank alone for every axis."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs a process group: join one first (hyperparallel.train.distributed's "
                           "joined or init_distributed; on one process they make a group of its own)")
    world = dist.get_world_size()
    if shape.world == 1 and world > 1:
        return ParallelMesh(shape, 0, dict.fromkeys(GROUPS, _alone()))
    _check_fits(shape, world)
    # the same shape built again (another model in this process) takes the groups made the first time
    return made_once(("mesh", shape), lambda: _new_mesh(shape))


def _new_mesh(shape: MeshShape) -> ParallelMesh:
    """The groups this rank belongs to, of the kinds a run uses, made from the shape's rank lists
    (`MeshShape.groups`) rather than by torch's `init_device_mesh`, which makes a group for every
    dimension of each of its meshes: the unused ones, each dimension the meshes share once per
    mesh, and a group of one rank for every dimension of size 1. Each of those is a real process
    group (with gloo, a connection loop and its threads for the life of the process)."""
    lists = shape.groups()
    kinds = ["pp", "tp", "cp", "dp_replicate", "fsdp"] + (["ep", "expert_shard"] if shape.ep_enabled else [])
    groups = {kind: _group_of(kind, lists[kind]) for kind in kinds}
    if not shape.ep_enabled:  # every rank holds every expert: one rank splits them, the fsdp group shards them
        groups.update(ep=_alone(), expert_shard=groups["fsdp"])
    groups["world"] = dist.group.WORLD
    groups["stage"] = _group_of("stage", lists["stage"])  # (without pp: every rank, the default group)
    return ParallelMesh(shape, dist.get_rank(), groups)


def _group_of(kind: str, lists: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group among `lists` (every group of one kind, their global ranks, ascending;
    collective: new_group is, so every rank makes every group, in the same order). The same ranks
    of the same kind, built again for another shape in this process, take the group made the first
    time. A group of every rank is the default group, as torch's DeviceMesh makes it, but for the
    expert dispatch's; a group of one rank is `_alone()`. Otherwise two kinds never share a group,
    even over the same ranks: each keeps its own communicator, so that one kind's collectives
    (FSDP's prefetched gathers, say) do not queue behind another's (the expert dispatch) on a GPU."""
    me = dist.get_rank()
    if kind != "ep" and len(lists) == 1 and len(lists[0]) == dist.get_world_size():
        return dist.group.WORLD
    mine = None
    for ranks in lists:
        if len(ranks) == 1:
            if ranks[0] == me:
                mine = _alone()
            continue
        group = made_once(("group", kind, tuple(ranks)), lambda ranks=ranks: dist.new_group(ranks, group_desc=kind))
        if me in ranks:
            mine = group
    return mine


def _alone() -> dist.ProcessGroup:
    """A group of this rank alone (made by this rank only: no other rank takes part)."""
    return made_once("alone", lambda: dist.new_group([dist.get_rank()], use_local_synchronization=True))


def _listed(groups: list[list[int]], shown: int = 4) -> str:
    text = " ".join(str(g) for g in groups[:shown])
    return text + (f" ... ({len(groups)} in all)" if len(groups) > shown else "")


def describe_groups(shape: MeshShape, local_world: int | None) -> list[str]:
    """The run summary's lines on data parallelism's groups: with HSDP, which ranks form the shard
    groups and which the replica groups; and, given the ranks per machine (LOCAL_WORLD_SIZE), a
    warning when a shard group spans machines (FSDP's all-gathers then cross the slow links)."""
    if not shape.fsdp_enabled:
        return []
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

"""A layout built again in one process takes the groups made the first time (hyperparallel/process_groups.py):
each group made again would keep gloo's threads to the end of the process. Counted on a fake process
group of 4 ranks (this process plays rank 0; nothing is sent) as the groups torch has registered."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyperparallel.parallel.mesh import GROUPS, MeshShape, build_mesh
from hyperparallel.parallel.pipeline import tied_embedding_groups
from hyperparallel.process_groups import forget, made_once


def registered() -> int:
    """The process groups torch holds now."""
    return len(dist.distributed_c10d._world.pg_map)


@pytest.fixture
def four_ranks():
    """A fake default group of 4 ranks, left (and the groups kept for it forgotten) at the end."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    forget()
    dist.destroy_process_group()


def test_a_shape_built_twice_makes_its_groups_once(four_ranks):
    shape = MeshShape(dp_shard=2, tp=2)
    before = registered()
    first = build_mesh(shape)
    made = registered() - before
    assert made > 0
    second = build_mesh(shape)
    assert registered() - before == made  # nothing more
    assert second is first and all(second.groups[name] is first.groups[name] for name in GROUPS)
    assert build_mesh(MeshShape(dp_shard=4)) is not first  # another shape: groups of its own


def test_the_tied_embedding_pairs_are_made_once(four_ranks):
    pair = tied_embedding_groups(stage_world=2, pp=2, rank=0)
    count = registered()
    assert tied_embedding_groups(stage_world=2, pp=2, rank=0) is pair
    assert dist.get_process_group_ranks(pair) == [0, 2]
    assert registered() == count


def test_a_new_default_group_makes_its_groups_again():
    made = []
    for _ in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:  # (no forget() before leaving: the new default group alone must start afresh)
            group = made_once("pair", lambda: made.append(dist.new_group([0, 1])) or made[-1])
            assert made_once("pair", lambda: made.append(None)) is group  # made once under this default group
            assert dist.get_process_group_ranks(group) == [0, 1]  # registered: not the destroyed group's
        finally:
            dist.destroy_process_group()
    forget()
    assert len(made) == 2 and made[0] is not made[1]


def test_a_mesh_makes_a_group_for_each_kind_it_uses_and_one_for_every_rank_alone(four_ranks):
    """build_mesh: a group per kind of more than one rank (tp, fsdp here), one group of this rank
    alone for every kind of one (pp, cp, dp_replicate, ep), the default group for a kind over every
    rank but ep, and no group for a dimension nothing reads (dp_shard apart from fsdp); torch's DeviceMesh
    made one per dimension of each mesh."""
    before = registered()
    mesh = build_mesh(MeshShape(dp_shard=2, tp=2))
    assert registered() - before == 3  # (tp [0, 1], fsdp [0, 2], and rank 0 alone)
    ranks = {name: dist.get_process_group_ranks(mesh.groups[name]) for name in ("tp", "fsdp", "pp", "cp", "ep")}
    assert ranks == {"tp": [0, 1], "fsdp": [0, 2], "pp": [0], "cp": [0], "ep": [0]}
    assert mesh.groups["pp"] is mesh.groups["cp"] is mesh.groups["dp_replicate"] is mesh.groups["ep"]
    # another shape: its tp ranks' group taken again; dp_replicate over fsdp's ranks [0, 2] a group of its own
    other = build_mesh(MeshShape(dp_replicate=2, tp=2))
    assert other.groups["tp"] is mesh.groups["tp"]
    assert dist.get_process_group_ranks(other.groups["dp_replicate"]) == [0, 2]
    assert other.groups["dp_replicate"] is not mesh.groups["fsdp"]
    assert registered() - before == 4
    # a kind over every rank: the default group (as torch's DeviceMesh gave it), nothing registered
    assert build_mesh(MeshShape(dp_shard=4)).groups["fsdp"] is dist.group.WORLD
    assert registered() - before == 4
    # but the expert dispatch's: a communicator of its own beside FSDP's
    experts = build_mesh(MeshShape(dp_shard=4, ep=4))
    assert experts.groups["fsdp"] is dist.group.WORLD and experts.groups["ep"] is not dist.group.WORLD
    assert dist.get_process_group_ranks(experts.groups["ep"]) == [0, 1, 2, 3] and registered() - before == 5

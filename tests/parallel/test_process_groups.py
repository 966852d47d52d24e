"""A mesh built again in one process takes the groups made the first time (hyperparallel/process_groups.py):
each group made again would keep gloo's threads to the end of the process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hyperparallel.parallel.mesh import GROUPS, MeshShape, build_mesh
from hyperparallel.process_groups import made_once


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def one_rank():
    """A default process group of this process alone, left at the end."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_shape_built_twice_gets_the_same_groups_and_no_new_threads(one_rank):
    shape = MeshShape(dp_shard=1, cp=1, tp=1)
    first = build_mesh(shape, "cpu")
    before = threads()
    second = build_mesh(shape, "cpu")
    assert threads() == before
    assert all(second.groups[name] is first.groups[name] for name in GROUPS)


def test_a_new_default_group_makes_its_groups_again():
    made = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            group = made_once("pair", lambda: made.append(dist.new_group([0])) or made[-1])
            assert made_once("pair", lambda: made.append(None)) is group  # made once under this default group
            total = torch.ones(2)
            dist.all_reduce(total, group=group)  # and it works: not a group of the destroyed default group
            assert total.tolist() == [1.0, 1.0]
        finally:
            dist.destroy_process_group()
    assert len(made) == 2 and made[0] is not made[1]

"""Sharded Muon's exchange plans are made once and kept while the matrices keep their placements
and shapes (ExchangePlans). One process: the plans need a process group to name the ranks, not
the ranks themselves; the exchanges they drive are checked on 2, 3 and 4 ranks in
tests/dist/test_sharded_muon.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyperparallel.fsdp import ShardPlacement, shard_ranges
from hyperparallel.optim import sharded_muon
from hyperparallel.optim.sharded_muon import ExchangePlans, ShardedMatrix, newton_schulz_cost, plan_owners
from tests.dist.ranks import leave

SHAPES = [(13, 7), (5, 13), (3, 5), (40, 8)]
WORLD = 3  # the placements' ranks; the process itself is rank 0 of them


@pytest.fixture(autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    leave()


def placements(shapes=SHAPES) -> list[ShardPlacement]:
    return [ShardPlacement(None, tuple(shard_ranges(rows, WORLD, "balanced")), 0) for rows, _ in shapes]


def matrices(places: list[ShardPlacement], shapes=SHAPES) -> list[ShardedMatrix]:
    """A step's matrices: new directions every step, the same placements."""
    return [ShardedMatrix(torch.randn(p.ranges[0][1], cols), p, lambda whole: whole)
            for p, (_, cols) in zip(places, shapes, strict=True)]


def test_the_plan_is_made_once_for_the_same_placements_and_shapes(monkeypatch):
    made = []
    monkeypatch.setattr(sharded_muon, "plan_owners", lambda *a: made.append(a) or plan_owners(*a))
    plans, places = ExchangePlans(), placements()
    first = plans.plans(matrices(places))
    for _ in range(3):
        assert plans.plans(matrices(places)) is first
    assert len(made) == 1
    (plan,) = first
    assert plan.owners == plan_owners([newton_schulz_cost(*s) for s in SHAPES], WORLD)
    assert plan.indices == list(range(len(SHAPES)))


def test_new_placements_or_shapes_make_a_new_plan():
    plans, places = ExchangePlans(), placements()
    first = plans.plans(matrices(places))
    assert plans.plans(matrices(placements())) is not first  # other placement objects (a model sharded again)
    second = plans.plans(matrices(places))
    shapes = [*SHAPES[:3], (40, 9)]
    assert plans.plans(matrices(places, shapes)) is not second  # a matrix of another shape


def test_what_the_plan_sends_and_receives_adds_up():
    """This rank sends every matrix's rows to its owner, and receives the rows of what it owns."""
    (plan,) = ExchangePlans().plans(matrices(placements()))
    rows = [p.ranges for p in placements()]
    assert sum(plan.send_counts) == sum(r[0][1] * cols for r, (_, cols) in zip(rows, SHAPES, strict=True))
    assert sum(plan.whole_sizes) == sum(rows_ * cols for k, (rows_, cols) in enumerate(SHAPES) if k in plan.mine)
    assert sorted(plan.permutation) == list(range(len(plan.recv_sizes)))
    assert [plan.recv_sizes[j] for j in plan.permutation] == plan.whole_sizes
    assert sum(plan.update_recv_counts) == sum(plan.send_counts)  # this rank's rows of every update come back

"""The flat buffers' views ([Note: views made once per group], fsdp/collectives.py): the layout
against a collective simulated in one process for every rank, and that a group makes its views
once and keeps no buffer's bytes between collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.fsdp import fully_shard
from hyperparallel.fsdp.collectives import FlatLayout, GatherViews, ReduceViews
from hyperparallel.fsdp.group import _GROUP
from hyperparallel.fsdp.param import ShardedParam, runs_of
from tests.dist.ranks import leave

# 0-d, 1-D, rows that divide by no rank count, fewer rows than ranks, 37 rows (one 32-row group
# and a short one under align 32), a 3-D stack
SHAPES = [(), (5,), (13, 7), (3, 4), (37, 2), (6, 2, 3)]
LAYOUTS = [(world, geometry, align) for world in (1, 2, 3, 4, 5) for geometry in ("chunk", "balanced")
           for align in (1, 32)]


def values(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def shard(world: int, rank: int, geometry: str, align: int, param_dtype=None) -> list[ShardedParam]:
    return [ShardedParam.of([], nn.Parameter(v), None, rank, world, geometry, align, param_dtype) for v in values(0)]


def gather_views(params: list[ShardedParam], world: int, rank: int) -> GatherViews:
    return GatherViews([piece for p in params for piece in p.pieces(None)], world, rank, torch.device("cpu"))


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["own dtype", "bf16"])
@pytest.mark.parametrize(("world", "geometry", "align"), LAYOUTS)
def test_gathered_views_fill_every_full_parameter(world, geometry, align, param_dtype):
    """Every parameter's values, in its full copy's dtype (bf16 for every other one under bf16:
    one byte buffer carries pieces of two dtypes)."""
    ranks = [shard(world, r, geometry, align) for r in range(world)]
    if param_dtype is not None:  # (as fully_shard's MixedPrecision would make them, every other one kept)
        for params in ranks:
            for p in params[::2]:
                p.full.data = torch.empty(p.full.shape, dtype=param_dtype)  # (its bytes: the gather's below)
                p.full_nbytes = p.full.numel() * p.full.element_size()
    views = [gather_views(params, world, r) for r, params in enumerate(ranks)]
    for v, params in zip(views, ranks, strict=True):
        v.copy_in([p.shard.view(-1) for p in params])
    slots = torch.stack([v.local.tensor for v in views])
    for r, v in enumerate(views):  # the all-gather, every rank's slot to every rank
        v.gathered.tensor.copy_(slots)
        for p in ranks[r]:
            p.full.untyped_storage().resize_(p.full_nbytes)
        v.copy_out([run for p in ranks[r] for run in p.full_runs()])
        for i, (p, want) in enumerate(zip(ranks[r], values(0), strict=True)):
            assert p.full.dtype == (param_dtype if param_dtype is not None and i % 2 == 0 else want.dtype)
            torch.testing.assert_close(p.full.detach(), want.to(p.full.dtype), rtol=0, atol=0)
        assert v.local.tensor.untyped_storage().nbytes() == v.gathered.tensor.untyped_storage().nbytes() == 0


@pytest.mark.parametrize(("world", "geometry", "align"), LAYOUTS)
def test_reduce_views_sum_each_rank_rows(world, geometry, align):
    ranks = [shard(world, r, geometry, align) for r in range(world)]
    views = [ReduceViews(FlatLayout(params, world, r), torch.float32, torch.device("cpu"))
             for r, params in enumerate(ranks)]
    grads = [values(1 + r) for r in range(world)]
    grads[0][2] = None  # a parameter without a gradient on one rank counts as zeros
    flats = [v.copy_in(g).view(world, -1).clone() for v, g in zip(views, grads, strict=True)]
    for r, v in enumerate(views):  # the reduce-scatter: the sum of every rank's slot r
        out = torch.stack([flat[r] for flat in flats]).sum(0)
        for i, (p, got) in enumerate(zip(ranks[r], v.shard_grads(out), strict=True)):
            total = sum((g[i] for g in grads if g[i] is not None), torch.zeros(SHAPES[i]))
            rows = total.reshape(p.info.rows, -1)[p.info.offset: p.info.offset + p.info.length]
            assert got.shape == p.shard.shape
            torch.testing.assert_close(got.reshape(rows.shape), rows, rtol=1e-6, atol=1e-6)
        assert v.flat.tensor.untyped_storage().nbytes() == 0


def test_padding_travels_as_zeros():
    params = shard(4, 3, "chunk", 1)  # rank 3 of 4 holds none of 3 rows, one of 5
    views = gather_views(params, 4, 3)
    views.local.tensor.fill_(255)  # (as bytes: float32 NaNs)
    views.copy_in([p.shard.view(-1) for p in params])
    assert not views.local.tensor.view(torch.float32).isnan().any()


@pytest.mark.parametrize("geometry", ["chunk", "balanced"])
def test_a_parameter_is_a_few_runs_of_ranks_whatever_their_number(geometry):
    """What bounds the copies: per parameter at most 3 runs of ranks holding elements."""
    for world in range(1, 17):
        for rows in range(0, 70):
            for align in (1, 4, 32):
                from hyperparallel.fsdp.geometry import shard_ranges

                numels = [length * 3 for _, length in shard_ranges(rows, world, geometry, align)]
                runs = runs_of(numels)
                assert sum(run.count * run.numel for run in runs) == sum(numels)
                assert sum(run.count for run in runs) == world
                assert len([run for run in runs if run.numel]) <= 3, (world, rows, align, numels)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    leave()


def test_a_full_parameter_has_no_bytes_before_its_first_gather(one_rank):
    """Sharding gives each rank its shards alone: the full parameters get their bytes from the
    first all-gather (a model built on the meta device holds its shards alone until its first step)."""
    model = fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3, device="meta")), device=torch.device("cpu"))
    for p in getattr(model, _GROUP).params:
        assert p.full.untyped_storage().nbytes() == 0 and p.shard.untyped_storage().nbytes() > 0


def test_a_group_makes_its_views_once_and_frees_its_buffers_between_collectives(one_rank):
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)))
    group = getattr(model, _GROUP)
    made = None
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        (gather,) = group._gather_views.values()  # (one kind of gather: every parameter's values)
        now = (gather, group._reduce_views, [run for p in group.params for run in p.full_runs()])
        if made is not None:
            assert now[0] is made[0] and now[1] is made[1]
            assert all(a is b for a, b in zip(now[2], made[2], strict=True))
        made = now
        for buffer in (gather.local, gather.gathered, group._reduce_views.flat):
            assert buffer.tensor.untyped_storage().nbytes() == 0
        model.zero_grad()


def test_another_storage_under_a_full_parameter_gets_new_views(one_rank):
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 6))
    group = getattr(model, _GROUP)
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = model(x)
    full = group.params[0].full
    full.data = torch.zeros_like(full.data)  # (a new storage, with bytes)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)

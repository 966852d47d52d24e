"""Muon on FSDP shards (2, 3 and 4 gloo ranks) against torch.optim.Muon + AdamW in one process.

Every rank sees the whole batch, so the reduced gradients equal the reference's (up to the
reduction's rounding) and the comparison isolates the optimizer.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ShapeError
from hyperparallel.fsdp import ShardPlacement, fully_shard, shard_info, shard_ranges
from hyperparallel.optim import Muon
from hyperparallel.optim.sharded_muon import newton_schulz_cost, plan_owners

STEPS = 3
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.9
EXPERTS = (5, 6, 4)  # a stack of 5 independent [6, 4] matrices


class Net(nn.Module):
    """Deliberately uneven matrices: 13x7 (tall), 5x13 (wide), 3x5 (fewer rows than 4 ranks)."""

    def __init__(self, split_experts: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(5, 3)
        experts = torch.randn(EXPERTS) * 0.5
        # torch.optim.Muon takes 2-D matrices only: the reference holds the stack as its slices
        self.experts = (nn.ParameterList(nn.Parameter(e.clone()) for e in experts) if split_experts
                        else nn.Parameter(experts))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))  # [B, 5]: also the gates over the 5 experts
        z = torch.cat([torch.tanh(self.c(g)), g[:, :1]], dim=1)  # [B, 4]
        stack = torch.stack(list(self.experts)) if isinstance(self.experts, nn.ParameterList) else self.experts
        return torch.einsum("be,beo->bo", torch.softmax(g, -1), torch.einsum("bi,eoi->beo", z, stack))


def make_side() -> nn.Linear:
    """A second model, sharded over ranks [0, 1] only: a process group of its own."""
    torch.manual_seed(1)
    return nn.Linear(4, 9)


def losses(step: int, net: nn.Module, side: nn.Module | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y, y_side = torch.randn(12, 7, generator=g), torch.randn(12, 6, generator=g), torch.randn(12, 9, generator=g)
    loss = nn.functional.mse_loss(net(x), y)
    return loss if side is None else loss + nn.functional.mse_loss(side(x[:, :4]), y_side)


def split_params(named):
    matrices = [(n, p) for n, p in named if p.ndim >= 2]
    return matrices, [(n, p) for n, p in named if p.ndim < 2]


def reference(adjust_lr_fn) -> dict[str, torch.Tensor]:
    net, side = Net(split_experts=True), make_side()
    matrices, biases = split_params([*net.named_parameters(), *(("side." + n, p) for n, p in side.named_parameters())])
    optimizers = [
        torch.optim.Muon([p for _, p in matrices], lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                         adjust_lr_fn=adjust_lr_fn),
        torch.optim.AdamW([p for _, p in biases], lr=LR, weight_decay=WEIGHT_DECAY, foreach=False),
    ]
    for step in range(STEPS):
        losses(step, net, side).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    final = {n: p.detach() for n, p in [*matrices, *biases] if not n.startswith("experts.")}
    final["experts"] = torch.stack([p.detach() for p in net.experts])
    return final


# (geometry, align, adjust_lr_fn) per world size; 3 and 5 rows on 4 ranks: empty shards; align
# 32 on 4 ranks: every row on rank 0, the others hold nothing
SETTINGS = {2: [("chunk", 1, None)], 3: [("balanced", 1, "match_rms_adamw"), ("chunk", 32, None)],
            4: [("chunk", 1, None), ("balanced", 32, "original")]}


def on_ranks(rank: int, world: int, out_dir: str) -> list[dict]:
    """Every setting of this world size on one rank of the session's shared spawn
    (tests/dist/spawn.py), with what each step runs counted: Newton–Schulz (by shape) and
    all_to_all_single collectives."""
    import hyperparallel.optim.muon as muon

    counts = {"ns_calls": [], "exchanges": 0}
    orthogonalize, all_to_all_single = muon.orthogonalize, dist.all_to_all_single

    def counted_orthogonalize(x, *args, **kwargs):
        counts["ns_calls"].append(tuple(x.shape))
        return orthogonalize(x, *args, **kwargs)

    def counted_all_to_all_single(*args, **kwargs):
        counts["exchanges"] += 1
        return all_to_all_single(*args, **kwargs)

    muon.orthogonalize, dist.all_to_all_single = counted_orthogonalize, counted_all_to_all_single
    results = []
    try:
        for geometry, align, adjust_lr_fn in SETTINGS[world]:
            counts.update(ns_calls=[], exchanges=0)
            result = train_sharded(rank, world, geometry, align, adjust_lr_fn)
            results.append({**result, **counts})
    finally:
        muon.orthogonalize, dist.all_to_all_single = orthogonalize, all_to_all_single
    return results


def train_sharded(rank, world, geometry, align, adjust_lr_fn) -> dict:
    same_ranks = dist.new_group(list(range(world)))  # another group object over the world's ranks
    pair = dist.new_group([0, 1])
    net = Net()
    fully_shard(net.a, process_group=same_ranks, geometry=geometry, align=align)
    fully_shard(net.b, geometry=geometry, align=align)
    fully_shard(net, geometry=geometry, align=align)
    named = list(net.named_parameters())
    side = None
    if rank < 2:
        side = fully_shard(make_side(), process_group=pair, geometry=geometry, align=align)
        named += [("side." + n, p) for n, p in side.named_parameters()]
    matrices, biases = split_params(named)
    optimizer = Muon([{"params": matrices}, {"params": biases, "use_muon": False}], lr=LR,
                     weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, adjust_lr_fn=adjust_lr_fn)
    for step in range(STEPS):
        losses(step, net, side).backward()
        optimizer.step()
        optimizer.zero_grad()
    shards = {n: (shard_info(p).offset, shard_info(p).length, p.detach().clone()) for n, p in named}
    momentum = {n: tuple(optimizer.state[p]["momentum_buffer"].shape) for n, p in matrices}
    return {"shards": shards, "momentum": momentum}


def expected_newton_schulz(world, geometry, align) -> dict[int, list[tuple[int, ...]]]:
    """Per global rank, the shapes it orthogonalizes in one step: the 2-D matrices it owns (one
    plan per set of ranks) and its own slice of the expert stack (none when its shard is empty)."""
    world_matrices = [(13, 7), (5, 13), (3, 5)]
    sets = [(list(range(world)), world_matrices + [(9, 4)])] if world == 2 else \
        [(list(range(world)), world_matrices), ([0, 1], [(9, 4)])]
    calls: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(world)}
    for ranks, shapes in sets:
        for shape, owner in zip(shapes, plan_owners([newton_schulz_cost(*s) for s in shapes], len(ranks)), strict=True):
            calls[ranks[owner]].append(shape)
    for r, (_, length) in enumerate(shard_ranges(EXPERTS[0], world, geometry, align)):
        if length:
            calls[r].append((length, *EXPERTS[1:]))
    return calls


def check(results, want, world, geometry, align):
    """Every shard equals the reference's rows; Newton–Schulz ran once per matrix, on its owner
    only; two exchanges per set of ranks per step."""
    for name, full in want.items():
        holders = [r for r in range(world) if name in results[r]["shards"]]
        assert holders == (list(range(world)) if not name.startswith("side.") else [0, 1])
        for r in holders:
            offset, length, shard = results[r]["shards"][name]
            diff = (shard - full[offset:offset + length]).abs().max().item() if length else 0.0
            assert diff <= 1e-5, f"{name} on rank {r}: max abs diff {diff}"
            if name in results[r]["momentum"]:  # the optimizer state is per shard
                assert results[r]["momentum"][name] == tuple(shard.shape)
        assert sum(results[r]["shards"][name][1] for r in holders) == full.shape[0]
    calls = expected_newton_schulz(world, geometry, align)
    for r in range(world):
        assert sorted(results[r]["ns_calls"]) == sorted(calls[r] * STEPS), f"rank {r}"
        rank_sets = 1 if world == 2 or r >= 2 else 2
        assert results[r]["exchanges"] == 2 * rank_sets * STEPS, f"rank {r}"


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"world{w}")
def test_sharded_muon_matches_torch_muon(request, world):
    per_rank = request.getfixturevalue(f"spawn_{world}")["sharded_muon"]
    for index, (geometry, align, adjust_lr_fn) in enumerate(SETTINGS[world]):
        check([results[index] for results in per_rank], reference(adjust_lr_fn), world, geometry, align)


def test_owner_plan_is_longest_first_greedy_and_deterministic():
    assert newton_schulz_cost(13, 7) == newton_schulz_cost(7, 13) == 7 * 7 * 13
    assert plan_owners([8, 7, 6, 5, 4], 2) == [0, 1, 1, 0, 0]  # loads 8|7 -> 8|13 -> 13|13 -> 17|13
    assert plan_owners([1, 1, 1, 1], 3) == [0, 1, 2, 0]  # equal costs: parameter order, lower rank first
    assert plan_owners([3, 5], 1) == [0, 0]
    assert plan_owners([], 4) == []
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.choice([1, 8, 27, 64, 125]) * rng.randint(1, 9) for _ in range(rng.randint(1, 30))]
        world = rng.randint(2, 8)
        owners = plan_owners(costs, world)
        assert owners == plan_owners(list(costs), world)
        loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world)]
        # greedy list scheduling: no rank ends more than one matrix above the average
        assert max(loads) <= sum(costs) / world + max(costs)
        if len(costs) >= world:
            assert min(loads) > 0


def test_a_shard_that_does_not_match_its_placement_is_refused(monkeypatch):
    import hyperparallel.optim.muon as muon

    weight = nn.Parameter(torch.randn(3, 4))
    weight.grad = torch.randn(3, 4)
    monkeypatch.setattr(muon, "shard_placement", lambda p: ShardPlacement(None, ((0, 2), (2, 2)), 0))
    with pytest.raises(ShapeError, match=r"'layer.weight'.*shape \(3, 4\) on rank 0.*2 rows of 4"):
        Muon([("layer.weight", weight)]).step()

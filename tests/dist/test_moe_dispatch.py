"""ExpertParallel on 4 gloo processes, in EP groups of 4, 2 and 1 ranks, against one process
running every expert (GroupedExperts) on the concatenation of a group's tokens: outputs, token and
routing-weight gradients, and each rank's expert-weight gradients against the one-process
gradients of its slice. MegaMoE, for every wave count from 1 to a rank's expert count, against
ExpertParallel on the same ranks, with and without shared experts."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe
from hyperparallel.moe import GroupedExperts
from hyperparallel.moe.dispatch import ExpertParallel, expert_ranges
from hyperparallel.moe.megamoe import MegaMoE
from hyperparallel.moe.megamoe_graphs import WavePipeline
from tests.dist.test_fsdp import one_thread

HIDDEN, INTERMEDIATE = 64, 32
WORLD = 4
# Expert-parallel layouts of the 4 processes, every case runs under each: one group of 4; two
# interleaved groups of 2 (a rank's group rank then differs from its global rank, as in a mesh
# of data x expert parallelism); and 4 groups of 1 (every expert local). One spawn runs them all:
# starting the processes costs more than every case together.
LAYOUTS = {"ep4": [[0, 1, 2, 3]], "ep2": [[0, 2], [1, 3]], "ep1": [[0], [1], [2], [3]]}
CASES = ["random_top2", "uneven_experts", "one_expert", "idle_rank", "empty_rank", "mxfp8"]
# all_to_all_single calls per layer: counts, dispatch, combine forward; combine, dispatch backward
EXCHANGES = {"forward": 3, "backward": 2}
SHARED_INTERMEDIATE = 48


def megamoe_exchanges(waves: int) -> dict[str, int]:
    """MegaMoE's: the counts, then a dispatch and a combine per wave; backward two per wave."""
    return {"forward": 1 + 2 * waves, "backward": 2 * waves}


@dataclass
class Case:
    num_experts: int
    groups: list[list[int]]  # the EP groups (global ranks, ascending: group rank = position)
    tokens: list[torch.Tensor]  # per global rank: [T_r, H]
    indices: list[torch.Tensor]  # [T_r, k], global expert ids
    weights: list[torch.Tensor]  # [T_r, k]
    grad_out: list[torch.Tensor]  # [T_r, H], the fixed gradient of each rank's output
    mx: bool = False


def top_k_routing(g: torch.Generator, num_tokens: int, num_experts: int, top_k: int,
                  banned: range = range(0)) -> torch.Tensor:
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores[:, list(banned)] = -1.0  # never chosen while k experts remain allowed
    return scores.topk(top_k, dim=-1).indices


def idle_experts(num_experts: int, ep_size: int) -> range:
    """The experts the idle_rank case never routes to: the last EP rank's (with one rank, its last half)."""
    offset, count = expert_ranges(num_experts, max(ep_size, 2))[-1]
    return range(offset, offset + count)


def make_case(name: str, layout: str) -> Case:
    """The same inputs on every rank and in the test process (fixed seeds)."""
    groups = LAYOUTS[layout]
    g = torch.Generator().manual_seed(CASES.index(name) * 100 + len(groups[0]))
    num_experts = 6 if name == "uneven_experts" else 8  # 6 on 4 ranks: 2, 2, 1, 1
    token_counts = [40 + 3 * r for r in range(WORLD)]  # different counts per rank
    if name == "empty_rank":
        token_counts[0] = 0
    tokens = [torch.randn(t, HIDDEN, generator=g) for t in token_counts]
    if name == "one_expert":
        # every token's only slot goes to the last expert: one rank computes, the others receive nothing
        indices = [torch.full((t, 1), num_experts - 1, dtype=torch.long) for t in token_counts]
    elif name == "idle_rank":
        banned = idle_experts(num_experts, len(groups[0]))
        indices = [top_k_routing(g, t, num_experts, 2, banned) for t in token_counts]
    else:
        indices = [top_k_routing(g, t, num_experts, 2) for t in token_counts]
    weights = [torch.rand(i.shape, generator=g) + 0.1 for i in indices]
    grad_out = [torch.randn(t, HIDDEN, generator=g) for t in token_counts]
    return Case(num_experts, groups, tokens, indices, weights, grad_out, mx=name == "mxfp8")


def full_experts(case: Case) -> GroupedExperts:
    torch.manual_seed(0)
    experts = GroupedExperts(case.num_experts, HIDDEN, INTERMEDIATE, nn.SiLU())
    experts.reset_parameters(std=0.1)  # outputs of order one: differences are relative ones
    if case.mx:
        experts.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    return experts


def local_experts(full: GroupedExperts, offset: int, count: int, mx: bool) -> GroupedExperts:
    local = GroupedExperts(count, HIDDEN, INTERMEDIATE, nn.SiLU())
    with torch.no_grad():
        local.gate_up_proj.copy_(full.gate_up_proj[offset:offset + count])
        local.down_proj.copy_(full.down_proj[offset:offset + count])
    if mx:
        local.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    return local


def watch_graphs() -> list:
    """Weak references to every task graph MegaMoE builds from now on (its pipelines' builders, wrapped)."""
    refs: list = []
    for name in ("forward_graph", "backward_graph"):
        built = getattr(WavePipeline, name)
        original = getattr(built, "__wrapped__", built)

        def recorded(self, *args, _original=original):
            graph, outputs = _original(self, *args)
            refs.append(weakref.ref(graph))
            return graph, outputs

        recorded.__wrapped__ = original
        setattr(WavePipeline, name, recorded)
    return refs


def shared_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(HIDDEN, SHARED_INTERMEDIATE), nn.SiLU(), nn.Linear(SHARED_INTERMEDIATE, HIDDEN))


def run_case(case: Case, rank: int, process_groups: dict[tuple[int, ...], object], counter: dict, *,
             waves: int | None = None, shared: bool = False) -> dict:
    """One layer forward and backward: ExpertParallel, or MegaMoE in `waves` waves; with `shared`,
    plus a shared-experts MLP (MegaMoE runs it inside its graph)."""
    members = next(g for g in case.groups if rank in g)
    group = process_groups[tuple(members)]
    ep = ExpertParallel(group, case.num_experts) if waves is None else MegaMoE(group, case.num_experts, waves)
    graph_refs = watch_graphs()
    offset, count = ep.local_range
    experts = local_experts(full_experts(case), offset, count, case.mx)
    mlp = shared_mlp() if shared else None
    tokens = case.tokens[rank].clone().requires_grad_()
    weights = case.weights[rank].clone().requires_grad_()
    counter["n"] = 0
    routed = shared_out = None
    if shared and waves is not None:
        routed, shared_out = ep(experts, tokens, case.indices[rank], weights, shared_experts=mlp)
        out = routed + shared_out
    else:
        out = ep(experts, tokens, case.indices[rank], weights)
        if shared:
            out = out + mlp(tokens)
    forward_exchanges = counter["n"]
    (out * case.grad_out[rank]).sum().backward()
    out_value = out.detach().clone()
    del out, routed, shared_out  # (no gc.collect(): the graphs must go by reference counting alone)
    result = {"range": (offset, count), "out": out_value, "tokens_grad": tokens.grad,
              "weights_grad": weights.grad, "gate_up_grad": experts.gate_up_proj.grad,
              "down_grad": experts.down_proj.grad,
              "exchanges": {"forward": forward_exchanges, "backward": counter["n"] - forward_exchanges}}
    if shared:
        result.update({f"shared_{name}": p.grad for name, p in mlp.named_parameters()})
    if waves is not None:
        # nothing of the layer's graphs outlives its backward (their buffers, the saved tensors)
        result["graphs_alive"] = sum(ref() is not None for ref in graph_refs)
    return result


def refusal(ep: ExpertParallel, experts: GroupedExperts, error: type[Exception]) -> str:
    """The message of the `error` a call of `ep` on one token raises ("" if none): raised before
    any collective, so that no rank waits for another."""
    try:
        ep(experts, torch.zeros(1, experts.hidden_dim), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    except error as raised:
        return str(raised)
    return ""


def wrong_local_experts_message() -> str:
    ep = ExpertParallel(dist.group.WORLD, 8)
    return refusal(ep, GroupedExperts(ep.local_range[1] + 1, HIDDEN, INTERMEDIATE, nn.SiLU()), ShapeError)


def run_all(rank: int) -> dict:
    """Every case on this rank of the 4-rank spawn (tests/dist/test_expert_parallel.py's, shared
    to start the ranks once), its all-to-alls counted."""
    counter = {"n": 0}
    all_to_all_single = dist.all_to_all_single

    def counted_all_to_all_single(*args, **kwargs):
        counter["n"] += 1
        return all_to_all_single(*args, **kwargs)

    dist.all_to_all_single = counted_all_to_all_single
    try:
        # every rank creates every group, in one order (new_group is collective over the world)
        process_groups = {tuple(range(WORLD)): dist.group.WORLD}
        for groups in LAYOUTS.values():
            process_groups.update({tuple(g): dist.new_group(g) for g in groups if len(g) < WORLD})
        results = {(layout, name): run_case(make_case(name, layout), rank, process_groups, counter)
                   for layout in LAYOUTS for name in CASES}
        for layout, name, waves, shared in MEGAMOE_RUNS:
            key = ("megamoe", layout, name, waves, shared)
            results[key] = run_case(make_case(name, layout), rank, process_groups, counter, waves=waves, shared=shared)
        for layout in LAYOUTS:  # the sequential layer with the same shared experts, MegaMoE's reference
            results["shared", layout] = run_case(make_case("random_top2", layout), rank, process_groups, counter,
                                                 shared=True)
    finally:
        dist.all_to_all_single = all_to_all_single
    results["wrong_local_experts"] = wrong_local_experts_message()
    try:
        MegaMoE(dist.group.WORLD, 10, 4)  # 10 experts on 4 ranks: 3, 3, 2, 2
    except ConfigError as error:
        results["too_many_waves"] = str(error)
    return results


@pytest.fixture(scope="module")
def dispatched(ep_spawn_4) -> list[dict]:
    return [results["dispatch"] for results in ep_spawn_4]


def most_local_experts(name: str, layout: str) -> int:
    case = make_case(name, layout)
    return max(count for _, count in expert_ranges(case.num_experts, len(case.groups[0])))


def wave_counts(name: str, layout: str) -> list[int]:
    """Every count from 1 to the most experts a rank holds in the EP layouts; with one rank per
    group (no exchange at all) the fewest and the most."""
    most = most_local_experts(name, layout)
    return [1, most] if layout == "ep1" else list(range(1, most + 1))


# MegaMoE: every case and layout at those wave counts, and with shared experts at the fewest and most
MEGAMOE_RUNS = [(layout, name, waves, False) for layout in LAYOUTS for name in CASES
                for waves in wave_counts(name, layout)]
MEGAMOE_RUNS += [(layout, "random_top2", waves, True) for layout in LAYOUTS
                 for waves in sorted({1, most_local_experts("random_top2", layout)})]


def one_process(case: Case, members: list[int]) -> dict:
    """All experts on the group's tokens concatenated in group-rank order; the loss is the sum of
    the ranks' losses, so expert-weight gradients are the sums each rank's slice must equal."""
    experts = full_experts(case)
    tokens = torch.cat([case.tokens[r] for r in members]).requires_grad_()
    weights = torch.cat([case.weights[r] for r in members]).requires_grad_()
    out = experts(tokens, torch.cat([case.indices[r] for r in members]), weights)
    (out * torch.cat([case.grad_out[r] for r in members])).sum().backward()
    return {"out": out.detach(), "tokens_grad": tokens.grad, "weights_grad": weights.grad,
            "gate_up_grad": experts.gate_up_proj.grad, "down_grad": experts.down_proj.grad}


def max_differences(per_rank: list[dict], layout: str, name: str) -> dict[str, float]:
    """Per quantity, the largest |EP - one process| over the ranks, relative to the largest |one process|."""
    case = make_case(name, layout)
    worst: dict[str, float] = {}
    for members in case.groups:
        with one_thread():  # as the ranks compute: a matmul's summation order depends on the threads
            want = one_process(case, members)
        start = 0
        for r in members:
            got, rows = per_rank[r][layout, name], case.tokens[r].shape[0]
            offset, count = got["range"]
            pairs = {key: (got[key], want[key][start:start + rows]) for key in ("out", "tokens_grad", "weights_grad")}
            pairs.update({key: (got[key], want[key][offset:offset + count]) for key in ("gate_up_grad", "down_grad")})
            for key, (a, b) in pairs.items():
                assert a.shape == b.shape, f"{name}, rank {r}, {key}: shape {tuple(a.shape)} != {tuple(b.shape)}"
                if not a.numel():
                    continue
                diff = float((a - b).abs().max()) / (float(want[key].abs().max()) or 1.0)
                worst[key] = max(worst.get(key, 0.0), diff)
            start += rows
    return worst


# Largest relative difference allowed, fp32 and MXFP8 alike. Measured in every layout: 0 for
# every quantity of every case. Within an expert the rows reach the grouped products in one
# process's order, each token sums its slots in one process's order, and each expert's weight
# gradient sums the same rows in the same order (its group), so MX quantizes the same blocks.
# With the reference on several threads instead of one the fp32 differences were up to 4.2e-7;
# 1e-6 leaves room for a matmul whose blocking depends on the rows of the whole product (a rank
# holds fewer experts than one process).
TOLERANCE = 1e-6


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", CASES)
def test_expert_parallel_matches_one_process(dispatched, layout, name):
    worst = max_differences(dispatched, layout, name)
    assert all(diff <= TOLERANCE for diff in worst.values()), f"{name}, {layout}: {worst}"


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max()) / (float(b.abs().max()) or 1.0) if a.numel() else 0.0


# Measured: 0 for every quantity of every run (each expert's products see the same rows in the
# same order; every token here sums at most two slots, whose order does not change a sum of two).
# 1e-6 is the relative tolerance the issue sets for MegaMoE against the sequential layer.
MEGAMOE_TOLERANCE = 1e-6


@pytest.mark.parametrize("layout, name, waves, shared", MEGAMOE_RUNS,
                         ids=[f"{layout}-{name}-{waves}waves" + ("-shared" if shared else "")
                              for layout, name, waves, shared in MEGAMOE_RUNS])
def test_megamoe_matches_the_sequential_layer(dispatched, layout, name, waves, shared):
    for r, results in enumerate(dispatched):
        got = results["megamoe", layout, name, waves, shared]
        want = results["shared", layout] if shared else results[layout, name]
        assert got["range"] == want["range"]
        keys = [key for key in want if key not in ("range", "exchanges")]
        assert got["graphs_alive"] == 0, f"rank {r}: {got['graphs_alive']} task graphs outlived the backward"
        assert set(keys) <= set(got)
        worst = {key: relative_difference(got[key], want[key]) for key in keys}
        assert all(diff <= MEGAMOE_TOLERANCE for diff in worst.values()), f"rank {r}: {worst}"
        assert got["exchanges"] == megamoe_exchanges(waves), f"rank {r}"


def test_each_layer_runs_three_exchanges_forward_and_two_backward(dispatched):
    for r, results in enumerate(dispatched):
        for layout in LAYOUTS:
            for name in CASES:
                assert results[layout, name]["exchanges"] == EXCHANGES, f"{layout}, {name}, rank {r}"


def test_cases_cover_what_they_are_named_for(dispatched):
    def computed(layout: str, name: str) -> list[bool]:  # whose local experts saw any row
        return [bool(res[layout, name]["down_grad"].abs().sum() > 0) for res in dispatched]

    last_group_rank = {"ep4": [False, False, False, True], "ep2": [False, False, True, True]}
    for layout, owners in last_group_rank.items():
        assert computed(layout, "one_expert") == owners, layout  # only the last expert's ranks
        assert computed(layout, "idle_rank") == [not o for o in owners], layout
    assert [res["ep4", "uneven_experts"]["range"] for res in dispatched] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert [res["ep2", "random_top2"]["range"] for res in dispatched] == [(0, 4), (0, 4), (4, 4), (4, 4)]
    assert all(res[layout, "empty_rank"]["out"].shape == (0, HIDDEN) for res in dispatched[:1] for layout in LAYOUTS)


def test_local_experts_of_the_wrong_count_are_refused(dispatched):
    message = dispatched[0]["wrong_local_experts"]
    assert "rank 0 of 4 holds experts 0..1 (2 of 8), but its GroupedExperts has 3" in message


def test_more_waves_than_a_rank_has_experts_are_refused(dispatched):
    assert dispatched[0]["too_many_waves"] == ("moe.waves must be between 1 and the most experts one EP rank holds "
                                               "(3: 10 experts over 4 ranks), got 4")


def test_expert_ranges_are_contiguous_and_differ_by_at_most_one():
    assert expert_ranges(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert expert_ranges(6, 4) == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert expert_ranges(8, 2) == [(0, 4), (4, 4)]
    assert expert_ranges(3, 3) == [(0, 1), (1, 1), (2, 1)]
    assert expert_ranges(5, 1) == [(0, 5)]


def test_fewer_experts_than_ranks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"over 4 ranks needs at least 4 experts .* has 3"):
        expert_ranges(3, 4)

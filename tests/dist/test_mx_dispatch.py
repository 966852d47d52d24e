"""MX dispatch (`moe.dispatch: mx`): with MXFP8 experts the rows travel to them as MX data
(hyperparallel.moe.exchange's [Note: MX dispatch]), on 2 gloo ranks, for ExpertParallel and
MegaMoE, against the same dispatcher sending the rows in the compute dtype.

The forward is equal to the bit (outputs), and so is the way back (token and routing-weight
gradients) and the down projection's weight gradient; the gate_up projection's weight gradient
quantizes the rows' MX values along the tokens, the one difference, held to an SQNR. The bytes
the traffic counter counts: the dispatch at most 0.55x bf16's, the rest unchanged, as are the
all-to-alls a layer issues (3 forward, 2 backward). The cases run in the session's shared
2-rank spawn (tests/dist/spawn.py: tests/dist/test_expert_parallel.py's on_ranks calls run_all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import traffic
from hyperparallel.errors import ConfigError
from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe
from hyperparallel.moe import GroupedExperts, MoEConfig
from hyperparallel.moe.dispatch import ExpertParallel, dispatch_format
from hyperparallel.moe.megamoe import MegaMoE
from hyperparallel.mx import quantize
from hyperparallel.parallel.expert_parallel import keep_local_experts
from tests.dist.test_moe_dispatch import refusal

WORLD = 2
HIDDEN, INTERMEDIATE = 80, 48  # 80: two whole blocks of 32 and a partial one of 16 per row
NUM_EXPERTS = 5  # 3 + 2 on 2 ranks
OUTLIERS = 4  # channels 200x the others: their row-wise blocks keep small values as FP8 subnormals
# name: (tokens per rank, tokens' dtype, experts' dtype, bf16 autocast, outlier channels)
CASES = {
    "bf16": ((37, 45), torch.bfloat16, torch.bfloat16, False, False),
    "bf16_outliers": ((37, 45), torch.bfloat16, torch.bfloat16, False, True),
    "fp32_autocast": ((37, 45), torch.float32, torch.float32, True, True),  # the trainer's mixed precision
    "fp32": ((37, 45), torch.float32, torch.float32, False, True),
    "empty_rank": ((0, 45), torch.bfloat16, torch.bfloat16, False, False),
}
DISPATCHERS = ("sequential", "megamoe")
# all_to_all_single calls per layer (the sequential layer's; MegaMoE in 2 waves: counts + 2 x 2, then 2 x 2)
EXCHANGES = {"sequential": {"forward": 3, "backward": 2}, "megamoe": {"forward": 5, "backward": 4}}


@dataclass
class Inputs:
    tokens: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor
    grad: torch.Tensor


def inputs(case: str, rank: int) -> Inputs:
    counts, dtype, _, _, outliers = CASES[case]
    g = torch.Generator().manual_seed(10 * list(CASES).index(case) + rank)
    tokens = torch.randn(counts[rank], HIDDEN, generator=g)
    if outliers:
        tokens[:, :OUTLIERS] *= 200
    indices = torch.rand(counts[rank], NUM_EXPERTS, generator=g).topk(2, dim=-1).indices
    weights = torch.rand(counts[rank], 2, generator=g) + 0.1
    grad = torch.randn(counts[rank], HIDDEN, generator=g)
    return Inputs(tokens.to(dtype), indices, weights, grad.to(dtype))


def experts_of(case: str, rank: int | None = None) -> GroupedExperts:
    """MXFP8 experts, all of them or (`rank`) those that rank holds."""
    torch.manual_seed(0)
    experts = GroupedExperts(NUM_EXPERTS, HIDDEN, INTERMEDIATE, nn.SiLU(), dtype=CASES[case][2])
    experts.reset_parameters(std=0.1)
    if rank is not None:
        keep_local_experts(experts, WORLD, rank)
    experts.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    return experts


def run_layer(case: str, dispatcher: str, dispatch: str, rank: int) -> dict:
    ep = (ExpertParallel(dist.group.WORLD, NUM_EXPERTS, dispatch=dispatch) if dispatcher == "sequential"
          else MegaMoE(dist.group.WORLD, NUM_EXPERTS, 2, dispatch=dispatch))
    experts = experts_of(case, rank)
    given = inputs(case, rank)
    tokens, weights = given.tokens.clone().requires_grad_(), given.weights.clone().requires_grad_()
    with traffic.counting() as forward, torch.autocast("cpu", torch.bfloat16, enabled=CASES[case][3]):
        out = ep(experts, tokens, given.indices, weights)
    with traffic.counting() as backward:
        out.backward(given.grad.to(out.dtype))
    calls = {"forward": sum(forward.calls.values()), "backward": sum(backward.calls.values())}
    sent = {name: n for (_, name), n in {**forward.named, **backward.named}.items()}
    return {"out": out.detach(), "tokens_grad": tokens.grad, "weights_grad": weights.grad,
            "gate_up_grad": experts.gate_up_proj.grad, "down_grad": experts.down_proj.grad, "calls": calls, "sent": sent}


def high_precision_experts_message() -> str:
    ep = ExpertParallel(dist.group.WORLD, NUM_EXPERTS, dispatch="mx")
    return refusal(ep, GroupedExperts(ep.local_range[1], HIDDEN, INTERMEDIATE, nn.SiLU()), ConfigError)


def run_all(rank: int) -> dict:
    """Every case on this rank of the shared 2-rank spawn."""
    results = {(case, dispatcher, dispatch): run_layer(case, dispatcher, dispatch, rank)
               for case in CASES for dispatcher in DISPATCHERS for dispatch in ("compute", "mx")}
    results["high_precision_experts"] = high_precision_experts_message()
    return results


@pytest.fixture(scope="module")
def dispatched(ep_spawn_2) -> list[dict]:
    return [results["mx_dispatch"] for results in ep_spawn_2]


RUNS = [(case, dispatcher) for case in CASES for dispatcher in DISPATCHERS]


@pytest.mark.parametrize("case, dispatcher", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_the_forward_and_the_input_gradients_equal_the_compute_dispatch_to_the_bit(dispatched, case, dispatcher):
    for r, results in enumerate(dispatched):
        mx, compute = results[case, dispatcher, "mx"], results[case, dispatcher, "compute"]
        for key in ("out", "tokens_grad", "weights_grad", "down_grad"):
            assert mx[key].dtype == compute[key].dtype and torch.equal(mx[key], compute[key]), f"rank {r}, {key}"


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    noise = (want.double() - got.double()).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(want.double().pow(2).sum() / noise))


# The gate_up gradients' SQNR, MX dispatch against compute dispatch. Measured: inf (equal to the
# bit) in the cases without outlier channels, 108.7-126.2 dB in those with them: E4M3 rounds to
# 3 mantissa bits whatever the power-of-two scale, so the MX values quantized again along the
# tokens come back as the rows would, but for elements one of the two blocks leaves an E4M3
# subnormal (more than ~2^13 under the block's largest value: an outlier's row neighbours). The
# MXFP8 recipe's own error against bf16 experts is 23 dB (docs/lowp.md). 88 dB: 100x the power
# of the largest difference measured.
GATE_UP_SQNR_DB = 88


@pytest.mark.parametrize("case, dispatcher", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_the_gate_up_weight_gradient_is_within_its_sqnr(dispatched, case, dispatcher):
    for r, results in enumerate(dispatched):
        mx, compute = results[case, dispatcher, "mx"], results[case, dispatcher, "compute"]
        assert sqnr_db(compute["gate_up_grad"], mx["gate_up_grad"]) >= GATE_UP_SQNR_DB, f"rank {r}"


def test_the_outlier_cases_measure_a_difference(dispatched):
    """(So the SQNR above is tested on a gradient that differs, not only on equal ones.)"""
    got = dispatched[0]["bf16_outliers", "sequential", "mx"]["gate_up_grad"]
    want = dispatched[0]["bf16_outliers", "sequential", "compute"]["gate_up_grad"]
    assert not torch.equal(got, want)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_dispatch_bytes_are_at_most_055x_bf16_s_and_the_rest_unchanged(dispatched, dispatcher):
    sent = {how: [results["bf16", dispatcher, how]["sent"] for results in dispatched] for how in ("compute", "mx")}
    total = {how: {name: sum(rank[name] for rank in per_rank) for name in per_rank[0]}
             for how, per_rank in sent.items()}
    assert set(total["mx"]) == {"counts", "dispatch", "combine", "dispatch grad", "combine grad"}
    ratio = total["mx"]["dispatch"] / total["compute"]["dispatch"]
    assert ratio <= 0.55, ratio
    assert ratio == pytest.approx((HIDDEN + math.ceil(HIDDEN / 32)) / (2 * HIDDEN))  # 1 byte an element, 1 a block
    for name in ("counts", "combine", "dispatch grad", "combine grad"):
        assert total["mx"][name] == total["compute"][name], name


def test_each_layer_issues_the_same_all_to_alls(dispatched):
    for r, results in enumerate(dispatched):
        for case, dispatcher in RUNS:
            for how in ("compute", "mx"):
                assert results[case, dispatcher, how]["calls"] == EXCHANGES[dispatcher], f"{case}, {how}, rank {r}"


def test_mx_rows_to_high_precision_experts_are_refused(dispatched):
    assert dispatched[0]["high_precision_experts"].startswith("moe.dispatch: mx sends the experts their rows as "
                                                              "MXFP8 data, and these experts run high precision")


def test_experts_given_their_rows_as_mx_data_compute_what_they_compute_from_the_rows():
    """One process, the CPU's padded groups included: the products on MX rows equal those on the
    rows (forward to the bit; the rows' input gradient too)."""
    experts = experts_of("bf16")
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(70, HIDDEN, generator=g).bfloat16()
    offsets = torch.tensor([0, 33, 33, 60, 70], dtype=torch.int32)  # an empty expert, sizes off the 32-row grid
    quantized = quantize(rows, 1)
    values = quantized.dequantize(torch.bfloat16)
    grad = torch.randn(70, HIDDEN, generator=g).bfloat16()
    results = []
    for x, q in ((rows, None), (values, quantized)):
        x = x.clone().requires_grad_()
        out = experts(x, offsets=offsets, quantized=q)
        out.backward(grad)
        results.append((out, x.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_auto_sends_mx_rows_to_mxfp8_experts_with_an_mxfp8_weight_gradient_only():
    experts = GroupedExperts(2, HIDDEN, INTERMEDIATE, nn.SiLU())
    assert dispatch_format("auto", experts) == "compute"
    experts.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    assert dispatch_format("auto", experts) == "mx" and dispatch_format("compute", experts) == "compute"
    experts.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True, wgrad="high_precision"))
    assert dispatch_format("auto", experts) == "compute" and dispatch_format("mx", experts) == "mx"


def test_an_unknown_dispatch_format_is_a_config_error():
    with pytest.raises(ConfigError, match=r"dispatch: Input should be 'auto', 'compute' or 'mx'"):
        MoEConfig(dispatch="fp8")
    with pytest.raises(ConfigError, match=r"one of compute, mx, got 'bf16'"):
        ExpertParallel(None, NUM_EXPERTS, dispatch="bf16")


@pytest.mark.parametrize("sections, world, message", [
    ({"moe": {"dispatch": "mx"}, "low_precision": {"enabled": True}, "parallel": {"dp_shard": 2}}, 2,
     r"^moe.dispatch: mx sends expert parallelism's rows as MX data, and parallel.ep is 1"),
    ({"moe": {"dispatch": "mx"}, "parallel": {"dp_shard": 2, "ep": 2}}, 2,
     r"^moe.dispatch: mx sends the experts their rows as MXFP8 data, and the experts do not train in MXFP8"),
    ({"moe": {"dispatch": "mx"}, "low_precision": {"enabled": True, "modules": ["linear"]},
      "parallel": {"dp_shard": 2, "ep": 2}}, 2, r"the experts do not train in MXFP8"),
])
def test_mx_dispatch_without_expert_parallelism_or_mxfp8_experts_is_named(sections, world, message):
    import re

    from hyperparallel.train.preflight import layout_problems
    from tests.train.test_user_errors import _config

    problems = layout_problems(_config("qwen3_moe", **sections), world)
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_mx_dispatch_with_expert_parallelism_and_mxfp8_experts_is_accepted():
    from hyperparallel.train.preflight import layout_problems
    from tests.train.test_user_errors import _config

    sections = {"moe": {"dispatch": "mx"}, "low_precision": {"enabled": True}, "parallel": {"dp_shard": 2, "ep": 2}}
    assert layout_problems(_config("qwen3_moe", **sections), 2) == []


def test_a_resumed_run_may_change_the_dispatch_format():
    """moe.dispatch is expert parallelism's, as the layout is: not in the config's fingerprint."""
    from tests.train.test_user_errors import _config

    fingerprints = {_config("qwen3_moe", moe={"dispatch": how}).fingerprint() for how in ("auto", "compute", "mx")}
    assert len(fingerprints) == 1

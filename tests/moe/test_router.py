"""TopKRouter computes what transformers' own routers compute (Qwen3MoeTopKRouter, softmax;
DeepseekV3TopkRouter, sigmoid with groups, correction bias and routed scaling, also Kimi K2's
shape), records what load balancing needs, and LoadBalancer updates the correction bias from
the loads of every rank.

Our router runs transformers' torch calls in the same order, so everything compared here was
measured bit-equal (logits, weights, indices, and the gradients w.r.t. input and router weight):
the checks are torch.equal, also for a router whose top_k exceeds the experts its groups reach
(with `fused` set too: it runs op by op). The aux loss is the same formula with its divisions grouped
differently: measured within 1 float32 ulp of transformers' load_balancing_loss_func (4.8e-7 on
4.19, over five seeds), checked to 2e-6 relative; its gradient w.r.t. the router weight within
1.7e-8 of transformers' (largest element 0.03 to 0.05), checked to 1e-5 of the largest element.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.checkpoint import checkpoint
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter, load_balancing_loss_func

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model, make_config
from hyperparallel.models.moe_blocks import router_from_hf
from hyperparallel.moe import LoadBalancer, TopKRouter, switch_aux_loss
from hyperparallel.moe.balance import read_figures

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
AUX_LOSS = {"rtol": 2e-6, "atol": 0.0}


def tiny(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


# (family, tiny config, overrides): DeepSeek-V3 (8 groups, 4 eligible), Kimi K2's tiny shape
# (4 groups, 2 eligible) and Kimi K2's own grouping (one group: every expert eligible); and the
# shape of transformers' own DeepSeek-V3 tests, whose top_k exceeds the experts the eligible groups
# reach (8 experts in 4 groups of 2, 2 eligible: 4 reachable), top 8 (every expert) and top 6 (which
# 2 of the 4 excluded experts come is torch.topk's order of -inf ties): see [Note: top_k beyond the
# reachable experts] (kernels/router_groups.py)
BEYOND_REACH = {"n_routed_experts": 8, "n_group": 4, "topk_group": 2}
CASES = {
    "qwen3_moe": ("qwen3_moe", "qwen3_moe_tiny", {}),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3_tiny", {}),
    "kimi_k2": ("kimi_k2", "kimi_k2_tiny", {}),
    "kimi_k2_one_group": ("kimi_k2", "kimi_k2_tiny", {"n_group": 1, "topk_group": 1}),
    "beyond_reach_top8": ("deepseek_v3", "deepseek_v3_tiny", BEYOND_REACH | {"num_experts_per_tok": 8}),
    "beyond_reach_top6": ("deepseek_v3", "deepseek_v3_tiny", BEYOND_REACH | {"num_experts_per_tok": 6}),
}


def hf_router(case: str, *, norm_topk_prob: bool = True, seed: int = 0, bias: bool = False, overrides=None):
    """transformers' router of a tiny config, with random weights (and a random correction bias)."""
    family, name, case_overrides = CASES[case]
    config = make_config(family, tiny(name) | case_overrides | (overrides or {}) | {"norm_topk_prob": norm_topk_prob})
    router = (Qwen3MoeTopKRouter if family == "qwen3_moe" else DeepseekV3TopkRouter)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.2)
        if bias:
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.05)
    return router


def tokens(router, n: int = 57, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, n, router.hidden_dim, generator=g).to(dtype)  # [batch, seq, hidden]: reshaped to [T, H]


def assert_same_grads(ours, hf, x):
    """The input's and the weight's gradients of one loss on the routing weights and logits, bitwise."""

    def grads(router):
        inp = x.clone().requires_grad_()
        logits, weights, _ = router(inp)
        g = torch.Generator()
        loss = (weights * torch.randn(weights.shape, generator=g.manual_seed(3))).sum() + \
            (logits * torch.randn(logits.shape, generator=g.manual_seed(4))).sum() * 0.1
        return torch.autograd.grad(loss, (inp, router.weight))

    for name, got, want in zip(("input", "weight"), grads(ours), grads(hf), strict=True):
        assert torch.equal(got, want), f"{name}: max abs diff {(got - want).abs().max().item()}"


def assert_same_routing(ours: TopKRouter, hf, x: torch.Tensor) -> None:
    got, want = ours(x), hf(x)
    for name, g, w in zip(("logits", "weights", "indices"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: max abs diff {(g.double() - w.double()).abs().max().item()}"


def test_router_from_hf_shares_the_weight_and_bias_objects():
    hf = hf_router("deepseek_v3", bias=True)
    ours = router_from_hf(hf)
    assert ours.weight is hf.weight and ours.e_score_correction_bias is hf.e_score_correction_bias
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in hf.named_buffers()]
    qwen = hf_router("qwen3_moe")
    assert router_from_hf(qwen).weight is qwen.weight and router_from_hf(qwen).e_score_correction_bias is None


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("case", list(CASES))
def test_routing_equals_transformers_on_random_tokens(case, norm_topk_prob):
    hf = hf_router(case, norm_topk_prob=norm_topk_prob, bias=case != "qwen3_moe")
    assert_same_routing(router_from_hf(hf), hf, tokens(hf))


@pytest.mark.parametrize("case", list(CASES))
def test_routing_equals_transformers_on_tied_scores(case):
    """Ties broken as transformers breaks them: experts with identical router rows (their scores
    tie for every token), and an all-zero input (every expert ties)."""
    hf = hf_router(case)
    with torch.no_grad():
        half = hf.num_experts // 2
        hf.weight[half:] = hf.weight[:half]
    ours = router_from_hf(hf)
    x = tokens(hf)
    assert_same_routing(ours, hf, x)
    assert_same_routing(ours, hf, torch.zeros_like(x))


@pytest.mark.parametrize("case", ["deepseek_v3", "kimi_k2"])
def test_correction_bias_changes_the_choice_as_in_transformers(case):
    hf = hf_router(case, bias=True)
    ours = router_from_hf(hf)
    x = tokens(hf)
    assert_same_routing(ours, hf, x)
    without_bias = copy.deepcopy(hf)
    without_bias.e_score_correction_bias.zero_()
    assert not torch.equal(hf(x)[2], without_bias(x)[2])  # the bias matters for these inputs


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
def test_bf16_tokens(case):
    """Qwen3-MoE in a bf16 model: bf16 router weight and logits, bf16 routing weights.
    DeepSeek: the router stays float32 and takes bf16 tokens, float32 logits."""
    hf = hf_router(case, bias=case == "deepseek_v3")
    if case == "qwen3_moe":
        hf.to(torch.bfloat16)
    ours = router_from_hf(hf)
    x = tokens(hf, dtype=torch.bfloat16)
    assert_same_routing(ours, hf, x)
    want_dtype = torch.bfloat16 if case == "qwen3_moe" else torch.float32
    assert ours(x)[0].dtype == ours(x)[1].dtype == want_dtype


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_transformers(case, norm_topk_prob):
    """Gradients of a random function of the routing weights and logits, w.r.t. the tokens and
    the router weight; our router on a deep copy, so that nothing is shared."""
    hf = hf_router(case, norm_topk_prob=norm_topk_prob, bias=case != "qwen3_moe")
    ours = router_from_hf(copy.deepcopy(hf))
    assert ours.weight is not hf.weight
    assert_same_grads(ours, hf, tokens(hf))


# -- what a training forward records --


def test_switch_aux_loss_equals_transformers_load_balancing_loss():
    hf = hf_router("qwen3_moe")
    logits, _, indices = hf(tokens(hf))
    want = load_balancing_loss_func((logits,), hf.num_experts, hf.top_k)
    got = switch_aux_loss(torch.softmax(logits, dim=-1), indices, hf.num_experts)
    torch.testing.assert_close(got, want, **AUX_LOSS)


def test_recorded_aux_loss_and_its_gradient_equal_transformers():
    hf = hf_router("qwen3_moe")
    ours = router_from_hf(copy.deepcopy(hf)).train()
    ours.load_balance, ours.recording = "aux_loss", True
    x = tokens(hf)
    logits, _, _ = hf(x)
    want = load_balancing_loss_func((logits,), hf.num_experts, hf.top_k)
    ours(x)
    torch.testing.assert_close(ours.aux_loss(), want, **AUX_LOSS)
    got_grad, = torch.autograd.grad(ours.aux_loss(), ours.weight)
    want_grad, = torch.autograd.grad(want, hf.weight)
    scale = want_grad.abs().max().item()
    torch.testing.assert_close(got_grad, want_grad, rtol=0.0, atol=1e-5 * scale)


def test_counts_are_recorded_in_training_only_when_a_balancer_watches():
    hf = hf_router("deepseek_v3", bias=True)
    ours = router_from_hf(hf)
    x = tokens(hf)
    ours.train()(x)
    assert ours.last_counts is None  # nothing asked for them
    ours.recording = True
    ours.eval()(x)
    assert ours.last_counts is None
    with torch.no_grad():
        ours.train()(x)
    assert ours.last_counts is None  # no graph, no training step
    _, _, indices = ours(x)
    assert torch.equal(ours.last_counts, torch.bincount(indices.reshape(-1), minlength=hf.num_experts))
    assert ours.last_probs is None and ours.aux_loss() is None  # load_balance is "none"


def test_recompute_records_the_same_counts_not_twice():
    hf = hf_router("qwen3_moe")
    x = tokens(hf).requires_grad_()
    records = []
    for recompute in (False, True):
        ours = router_from_hf(copy.deepcopy(hf)).train()
        ours.load_balance, ours.recording = "aux_loss", True
        _, weights, indices = checkpoint(ours, x, use_reentrant=False) if recompute else ours(x)
        first_probs, aux = ours.last_probs, ours.aux_loss()
        (weights.sum() + aux).backward()  # under recompute, the router runs again here
        # the record is still the first forward's: the recomputed one kept nothing
        assert ours.last_probs is first_probs
        records.append((ours.last_counts, aux.detach(), x.grad.clone()))
        x.grad = None
    (plain_counts, plain_aux, plain_grad), (counts, aux, grad) = records
    assert int(plain_counts.sum()) == x.shape[0] * x.shape[1] * hf.top_k
    assert torch.equal(counts, plain_counts) and torch.equal(aux, plain_aux)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=0)


@pytest.mark.parametrize("groups, top_groups, top_k, named", [
    (8, 4, 2, r"num_experts \(8\) must split into num_groups \(8\) groups of at least 2 experts"),
    (3, 1, 2, r"num_experts \(8\) must split into num_groups \(3\)"),
    (4, 5, 2, r"top_groups \(5\) must be in 1\.\.num_groups \(4\)"),
    (4, 1, 9, r"top_k \(9\) must be in 1\.\.num_experts \(8\)"),
    (1, 1, 0, r"top_k \(0\) must be in 1\.\.num_experts \(8\)"),
])
def test_group_limited_shapes_that_cannot_route_are_refused_when_made(groups, top_groups, top_k, named):
    """Shapes for which group-limited top-k is undefined fail when the router is made, naming
    the keys, not in forward (a group of one expert: torch.topk's "selected index k out of range").
    A top_k beyond the experts the eligible groups reach is defined (transformers routes it), and
    only such a router is not `fusable`."""
    with pytest.raises(ConfigError, match=f"router: {named}"):
        TopKRouter(16, 8, top_k, score="sigmoid", num_groups=groups, top_groups=top_groups, correction_bias=True)
    assert TopKRouter(16, 8, 2, score="sigmoid", num_groups=4, top_groups=1, correction_bias=True).fusable
    for top_k in (3, 8):  # beyond the 2 experts of the one eligible group
        assert not TopKRouter(16, 8, top_k, score="sigmoid", num_groups=4, top_groups=1, correction_bias=True).fusable


# -- top_k beyond the experts the eligible groups reach (CASES' beyond_reach_*) --


def test_routing_beyond_reach_takes_excluded_experts_as_transformers_does():
    """The test has teeth: with top 6 of 4 reachable, every token takes 2 of the 4 experts outside
    its eligible groups, not the 2 of lowest index for every token (torch.topk's order of -inf
    ties), and weights them by their real scores."""
    hf = hf_router("beyond_reach_top6", bias=True)
    logits, weights, indices = hf(tokens(hf))
    choice = logits.sigmoid() + hf.e_score_correction_bias
    groups = choice.view(-1, 4, 2).topk(2, dim=-1)[0].sum(dim=-1).topk(2, dim=-1)[1]
    eligible = torch.zeros(logits.shape[0], 4, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(2, 1)
    outside = ~eligible.gather(1, indices)
    assert torch.equal(outside.sum(dim=1), torch.full((logits.shape[0],), 2))
    assert len({tuple(sorted(row)) for row in indices[outside].view(-1, 2).tolist()}) > 1
    assert (weights[outside] > 0).all()
    assert_same_routing(router_from_hf(hf), hf, tokens(hf))


@pytest.mark.parametrize("case", ["beyond_reach_top8", "beyond_reach_top6"])
def test_fused_router_beyond_reach_runs_op_by_op(case, monkeypatch):
    """With `fused` set, a router that is not `fusable` never calls MegaGate: transformers' indices
    (the same tensors, not only the same sets per token), weights and gradients, bit for bit."""
    import hyperparallel.kernels.mega_gate as gate

    def refused(*args, **kwargs):
        raise AssertionError("MegaGate called for a router that is not fusable")

    monkeypatch.setattr(gate, "mega_gate", refused)
    hf = hf_router(case, bias=True)
    ours = router_from_hf(hf)
    ours.fused = True
    assert not ours.fusable and "op by op" in repr(ours)
    x = tokens(hf)
    assert_same_routing(ours, hf, x)
    _, _, indices = ours(x)
    assert [sorted(row) for row in indices.tolist()] == [sorted(row) for row in hf(x)[2].tolist()]
    assert_same_grads(ours, hf, x)


def test_use_kernels_counts_routers_beyond_reach_apart():
    from hyperparallel.models.kernels import use_kernels

    model = torch.nn.ModuleList([router_from_hf(hf_router(case, bias=True))
                                 for case in ("deepseek_v3", "beyond_reach_top8", "deepseek_v3")])
    report = use_kernels(model, mega_gate=True, mega_mhc=False)
    assert all(router.fused for router in model) and [router.fusable for router in model] == [True, False, True]
    assert (report.mega_gate, report.routers, report.op_by_op) == (2, 3, 1)
    assert report.summary(mega_gate=True, mega_mhc=False) == (
        "kernels: MegaGate on (2 routers; 1 whose top_k exceeds its reachable experts runs op by op, "
        "as transformers does)")
    off = use_kernels(model, mega_gate=False, mega_mhc=False)
    assert (off.mega_gate, off.op_by_op) == (0, 0) and off.summary(mega_gate=False, mega_mhc=False) == \
        "kernels: MegaGate off"


def test_counts_and_aux_loss_of_a_router_beyond_reach():
    """Load balancing reads the indices, excluded experts included: the counts are their bincount,
    the aux loss the Switch loss of transformers' indices and normalized scores."""
    hf = hf_router("beyond_reach_top6", bias=True)
    ours = router_from_hf(copy.deepcopy(hf)).train()
    ours.fused, ours.load_balance, ours.recording = True, "aux_loss", True
    x = tokens(hf)
    _, _, indices = ours(x)
    logits, _, want_indices = hf(x)
    assert torch.equal(indices, want_indices)
    assert torch.equal(ours.last_counts, torch.bincount(want_indices.reshape(-1), minlength=hf.num_experts))
    assert int(ours.last_counts.sum()) == want_indices.numel()
    scores = logits.sigmoid()
    want = switch_aux_loss(scores / scores.sum(dim=-1, keepdim=True), want_indices, hf.num_experts)
    torch.testing.assert_close(ours.aux_loss(), want, **AUX_LOSS)
    grad, = torch.autograd.grad(ours.aux_loss(), ours.weight)
    assert grad.isfinite().all() and grad.abs().max() > 0


@pytest.mark.parametrize("fused", [False, True], ids=["op_by_op", "mega_gate"])
def test_softmax_router_choosing_every_expert(fused):
    """Qwen3-MoE's shape with num_experts_per_tok == num_experts (one group: every expert
    reachable, so fusable): transformers' routing, bit for bit op by op; with MegaGate the same
    indices, and weights within MegaGate's 1e-6 (tests/kernels/test_mega_gate.py; measured 1.8e-7
    over five seeds)."""
    hf = hf_router("qwen3_moe", overrides={"num_experts_per_tok": 16})
    ours = router_from_hf(hf)
    ours.fused = fused
    assert ours.fusable and ours.top_k == ours.num_experts == 16
    x = tokens(hf)
    if not fused:
        assert_same_routing(ours, hf, x)
        return
    (logits, weights, indices), (want_logits, want_weights, want_indices) = ours(x), hf(x)
    assert torch.equal(logits, want_logits) and torch.equal(indices, want_indices)
    torch.testing.assert_close(weights, want_weights, rtol=0.0, atol=1e-6)


# -- LoadBalancer --


def test_bias_mode_needs_routers_with_a_correction_bias():
    model = build_model("qwen3_moe", config=tiny("qwen3_moe_tiny"))
    with pytest.raises(ConfigError, match=r"bias needs routers with a correction bias.*model\.layers\.0\.mlp\.gate"):
        LoadBalancer(model, "bias", bias_update_rate=0.001)
    with pytest.raises(ConfigError, match="one of aux_loss, bias, none"):
        LoadBalancer(model, "biased")


def test_aux_loss_mode_averages_the_layers_and_reports_the_step():
    model = torch.nn.ModuleList([router_from_hf(hf_router("qwen3_moe", seed=s)) for s in (0, 1)])
    balancer = LoadBalancer(model, "aux_loss", aux_loss_coef=0.01)
    x = tokens(model[0]).reshape(-1, model[0].hidden_dim)
    want = []
    for router in model:
        logits, _, _ = router(x)
        want.append(load_balancing_loss_func((logits,), router.num_experts, router.top_k))
    loss = balancer.aux_loss()
    torch.testing.assert_close(loss, 0.01 * torch.stack(want).mean(), **AUX_LOSS)
    loss.backward()
    balancer.after_backward()
    figures = read_figures(balancer.after_step())
    assert figures["aux_loss"] == pytest.approx(float(torch.stack(want).mean().detach()), rel=2e-6)


STEPS, MICRO_BATCHES, WORLD, RATE = 3, 2, 2, 0.01
LAYERS = ("deepseek_v3", "deepseek_v3")  # the routers of two MoE layers (different weights)


def router_model() -> torch.nn.ModuleList:
    """The routers of a DeepSeek-V3-style model, nothing else: layer i routes the tokens seen
    through its own fixed map; their loss is a random function of the routing weights."""
    return torch.nn.ModuleList([router_from_hf(hf_router(case, seed=10 + i)) for i, case in enumerate(LAYERS)])


def layer_inputs(x: torch.Tensor) -> list[torch.Tensor]:
    return [x, torch.tanh(x * 2)]


def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(19 + 7 * rank, 64, generator=g)  # different tokens, and a different count, per rank


def run_balance(rank: int) -> list[dict]:
    """This rank's part of the 2-rank balancing case (run in tests/dist/test_expert_parallel.py's
    2-rank spawn, to start the ranks once)."""
    model = router_model().train()
    balancer = LoadBalancer(model, "bias", bias_update_rate=RATE)
    results = []
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            x = micro_batch(step, micro, rank).requires_grad_()
            loss = sum((router(h)[1] * h[:, :1]).sum() for router, h in zip(model, layer_inputs(x), strict=True))
            loss.backward()
            balancer.after_backward()
        figures = read_figures(balancer.after_step())
        results.append({"bias": [r.e_score_correction_bias.clone() for r in model], "figures": figures})
    return results


def reference_balance() -> list[dict]:
    """By hand, in one process: route the tokens of every rank and micro-batch with transformers'
    routers, sum the loads, move each bias by RATE * sign(mean - load); the next step routes
    with the moved bias."""
    hf = [hf_router(case, seed=10 + i) for i, case in enumerate(LAYERS)]
    steps = []
    for step in range(STEPS):
        x = torch.cat([micro_batch(step, m, r) for m in range(MICRO_BATCHES) for r in range(WORLD)])
        loads = []
        for router, h in zip(hf, layer_inputs(x), strict=True):
            load = torch.bincount(router(h)[2].reshape(-1), minlength=router.num_experts).double()
            loads.append(load)
        imbalance = [float(load.max() / load.mean()) for load in loads]
        for router, load in zip(hf, loads, strict=True):
            router.e_score_correction_bias += RATE * torch.sign(load.mean() - load).float()
        steps.append({"bias": [r.e_score_correction_bias.clone() for r in hf], "loads": loads,
                      "imbalance": imbalance})
    return steps


def test_bias_balancing_over_two_ranks_equals_one_process_on_all_tokens(ep_spawn_2):
    per_rank = [results["balance"] for results in ep_spawn_2]
    assert len(per_rank) == WORLD
    want = reference_balance()
    for step, expected in enumerate(want):
        for rank, results in enumerate(per_rank):
            got = results[step]
            for layer, (b, w) in enumerate(zip(got["bias"], expected["bias"], strict=True)):
                assert torch.equal(b, w), f"step {step}, rank {rank}, layer {layer}: {(b - w).abs().max()}"
            assert got["figures"]["moe_imbalance"] == pytest.approx(max(expected["imbalance"]), rel=1e-12)
            assert got["figures"]["moe_imbalance_per_layer"] == [round(v, 4) for v in expected["imbalance"]]
    # the test has teeth: the loads move from step to step (the bias changes the routing), and
    # one rank's tokens alone would have moved the bias elsewhere
    assert not torch.equal(want[0]["loads"][0], want[1]["loads"][0])
    alone = hf_router(LAYERS[0], seed=10)
    x0 = torch.cat([micro_batch(0, m, 0) for m in range(MICRO_BATCHES)])
    load = torch.bincount(alone(x0)[2].reshape(-1), minlength=alone.num_experts).double()
    assert not torch.equal(RATE * torch.sign(load.mean() - load).float(), want[0]["bias"][0])

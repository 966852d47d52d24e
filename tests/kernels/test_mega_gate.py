"""MegaGate computes what transformers' own routers compute: Qwen3MoeTopKRouter (softmax, top-k
renormalized), DeepseekV3TopkRouter (sigmoid, correction bias, 8 groups of which 4 eligible,
routed scaling), DeepseekV4TopKRouter (sqrt-softplus, correction bias) and DeepseekV4HashRouter
(experts from the token-id table), on each backend: the native C kernel, the Triton kernels
(run by the Triton interpreter on CPU tensors) and the pure-torch reference.

The indices are equal (as per-row sets where transformers asks torch.topk for sorted=False),
the loads equal a bincount of them. The weights, the probability sums and every gradient
(w.r.t. the hidden states and the router weight, through the weights and through prob_sum) are
fp32 roundings of the same formulas, computed in another order or with another exp / log1p.
Largest absolute differences measured over these tests with 5 seeds (native / Triton):
    weights 1.8e-7 / 1.8e-7, prob_sum 2.4e-7 / 6.0e-7, gradients 7.2e-7 / 4.8e-7
(the gradients' largest are the router weight's of Qwen3-MoE, sums over the tokens; the
reference differs from transformers' sorted=False routers by 1.2e-7 too: their k weights are
summed in another order). TOL holds the bounds the design asks for: 1e-6 for the weights and
prob_sum (5x and 1.7x the largest measured: the sums of prob_sum reach 2-3, where 1e-6 is 4 ulp; the
interpreter's arithmetic is deterministic), 1e-5 for the gradients (14x).
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

with imports():
    import torch
    import torch.nn.functional as F
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from hyperparallel.errors import ConfigError, ShapeError
    from hyperparallel.kernels.mega_gate import backend_for, mega_gate, mega_gate_reference, native, run_backend
    from hyperparallel.kernels.triton_support import triton

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # the Triton kernels take CPU tensors

BACKENDS = [
    "reference",
    pytest.param("native", marks=pytest.mark.skipif(native.LIB is None, reason="native library not built")),
    pytest.param("triton", marks=pytest.mark.skipif(triton is None, reason="triton not installed")),
]
# Largest absolute differences allowed (see the module docstring for the measured ones)
TOL = {"weights": 1e-6, "prob_sum": 1e-6, "grad": 1e-5}
MEASURED: dict[str, float] = {}  # the largest difference seen per quantity (read by a report script)


def assert_near(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    MEASURED[what] = max(MEASURED.get(what, 0.0), diff)
    assert diff <= TOL[what], f"{what}: max abs diff {diff:.3g} > {TOL[what]:.3g}"


def by_expert(indices: torch.Tensor, *values: torch.Tensor):
    """Each row's experts in increasing order, the values permuted alike (sorted=False outputs)."""
    order = indices.argsort(dim=-1)
    return (indices.gather(1, order), *(v.gather(1, order) for v in values))


# ------------------------------------------------------------------- transformers' routers

H, TOKENS = 32, (3, 19)  # 57 tokens


def qwen3(num_experts=16, top_k=4, norm=True):
    return Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=num_experts, num_experts_per_tok=top_k,
                                             norm_topk_prob=norm))


def deepseek_v3(num_experts=32, top_k=4, groups=8, top_groups=4):
    return DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=num_experts, num_experts_per_tok=top_k,
                                                 n_group=groups, topk_group=top_groups, routed_scaling_factor=2.5,
                                                 norm_topk_prob=True))


def v4_config(num_experts=16, top_k=4):
    return DeepseekV4Config(hidden_size=H, n_routed_experts=num_experts, num_experts_per_tok=top_k, vocab_size=64,
                            routed_scaling_factor=1.5)


def randomized(router, seed: int):
    """Random weights and, where the router has them, a random nonzero correction bias and a
    random token-id table of distinct experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * 0.3)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.05)
        if hasattr(router, "tid2eid"):
            vocab = router.tid2eid.shape[0]
            router.tid2eid.copy_(torch.rand(vocab, router.num_experts, generator=g).topk(router.top_k, dim=-1).indices)
    return router


def hidden(seed: int) -> torch.Tensor:
    return torch.randn(*TOKENS, H, generator=torch.Generator().manual_seed(seed + 100))


def ours(backend, router, x, input_ids=None, **options):
    """Our logits (transformers' linear) through MegaGate; x and the weight as fresh leaves."""
    x = x.detach().clone().requires_grad_()
    weight = router.weight.detach().clone().requires_grad_()
    logits = F.linear(x.reshape(-1, H), weight)
    bias = getattr(router, "e_score_correction_bias", None)
    hashed = router.tid2eid[input_ids.reshape(-1)] if input_ids is not None else None
    out = run_backend(backend, logits, None if hashed is not None else bias, hash_indices=hashed, **options)
    return out, x, weight


def theirs(router, x, input_ids=None):
    x = x.detach().clone().requires_grad_()
    router.weight.grad = None
    args = (x,) if input_ids is None else (x, input_ids)
    _, weights, indices = router(*args)
    return weights, indices, x


def cotangent(tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """[T, E]: a random cotangent per (token, expert), so that the loss does not depend on the
    order of each row's k slots."""
    return torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed + 200))


def check_against(router, backend, seed, *, sorted_like_ours, input_ids=None, **options):
    x = hidden(seed)
    weights, indices, hf_x = theirs(router, x, input_ids)
    (w, i, counts, prob_sum), our_x, our_weight = ours(backend, router, x, input_ids, **options)
    assert i.dtype == torch.int64 and w.dtype == torch.float32 and prob_sum is None
    if sorted_like_ours:
        assert torch.equal(i, indices)
        assert_near("weights", w, weights)
    else:
        got_i, got_w = by_expert(i, w)
        want_i, want_w = by_expert(indices, weights)
        assert torch.equal(got_i, want_i)
        assert_near("weights", got_w, want_w)
    assert torch.equal(counts, torch.bincount(indices.reshape(-1), minlength=router.num_experts))

    g = cotangent(i.shape[0], router.num_experts, seed)
    (weights * g.gather(1, indices)).sum().backward()
    (w * g.gather(1, i)).sum().backward()
    assert_near("grad", our_x.grad, hf_x.grad)
    assert_near("grad", our_weight.grad, router.weight.grad)


SEEDS = [0, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_softmax(backend, seed, norm):
    router = randomized(qwen3(norm=norm), seed)
    check_against(router, backend, seed, sorted_like_ours=True, score="softmax", top_k=router.top_k,
                  norm_topk_prob=norm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("groups,top_groups", [(8, 4), (4, 1), (1, 1)])
def test_deepseek_v3_sigmoid_groups_bias(backend, seed, groups, top_groups):
    router = randomized(deepseek_v3(groups=groups, top_groups=top_groups), seed)
    check_against(router, backend, seed, sorted_like_ours=False, score="sigmoid", top_k=router.top_k,
                  num_groups=groups, top_groups=top_groups, routed_scaling_factor=router.routed_scaling_factor,
                  norm_eps=1e-20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_deepseek_v4_sqrtsoftplus_bias(backend, seed):
    router = randomized(DeepseekV4TopKRouter(v4_config()), seed)
    check_against(router, backend, seed, sorted_like_ours=False, score="sqrtsoftplus", top_k=router.top_k,
                  routed_scaling_factor=router.routed_scaling_factor, norm_eps=1e-20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_deepseek_v4_hash_router(backend, seed):
    router = randomized(DeepseekV4HashRouter(v4_config()), seed)
    input_ids = torch.randint(0, router.tid2eid.shape[0], TOKENS, generator=torch.Generator().manual_seed(seed))
    check_against(router, backend, seed, sorted_like_ours=True, input_ids=input_ids, score="sqrtsoftplus",
                  top_k=router.top_k, routed_scaling_factor=router.routed_scaling_factor, norm_eps=1e-20)


# ------------------------------------------------------------------ prob_sum, ties, options


def probs_sum_torch(logits: torch.Tensor, score: str) -> torch.Tensor:
    """The aux loss's per-token distribution (TopKRouter.aux_loss), summed over the tokens."""
    if score == "softmax":
        return F.softmax(logits, dim=-1, dtype=torch.float).sum(0)
    probs = logits.sigmoid() if score == "sigmoid" else F.softplus(logits).sqrt()
    return (probs / probs.sum(dim=-1, keepdim=True)).sum(0)


CASES = {  # mega_gate options of each family
    "softmax": dict(score="softmax", top_k=4),
    "sigmoid_groups": dict(score="sigmoid", top_k=4, num_groups=8, top_groups=4, routed_scaling_factor=2.5,
                           norm_eps=1e-20),
    "sqrtsoftplus": dict(score="sqrtsoftplus", top_k=4, routed_scaling_factor=1.5, norm_eps=1e-20),
}


def logits_and_bias(seed: int, tokens=57, num_experts=32, bias=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    return logits, (torch.randn(num_experts, generator=g) * 0.05 if bias else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_prob_sum_and_its_gradient(backend, case):
    options = CASES[case]
    logits, bias = logits_and_bias(3, bias=case != "softmax")
    a = logits.clone().requires_grad_()
    weights, indices, counts, prob_sum = run_backend(backend, a, bias, aux_probs=True, **options)
    b = logits.clone().requires_grad_()
    want = probs_sum_torch(b, options["score"])
    assert_near("prob_sum", prob_sum, want)
    gw, gs = torch.randn(weights.shape), torch.randn(prob_sum.shape)
    ((weights * gw).sum() + (prob_sum * gs).sum()).backward()
    ref_weights = mega_gate_reference(b, bias, **options)[0]
    ((ref_weights * gw).sum() + (want * gs).sum()).backward()
    assert_near("grad", a.grad, b.grad)
    # only prob_sum used: the gradient of the distribution alone
    a.grad = b.grad = None
    run_backend(backend, a, bias, aux_probs=True, **options)[3].mul(gs).sum().backward()
    probs_sum_torch(b, options["score"]).mul(gs).sum().backward()
    assert_near("grad", a.grad, b.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_ties_go_to_the_lower_expert_index(backend, case):
    """Logits of a few values only. Equal values come by lower index: a stable descending sort's
    order (torch.topk's order of equal values is unspecified, and on CPU not by index). Where no
    tie straddles the k-th place, the experts are torch.topk's."""
    options = CASES[case]
    k = options["top_k"]
    logits, _ = logits_and_bias(4, tokens=64, bias=False)
    logits = (logits * 1.5).round() / 2  # about nine distinct values
    weights, indices, counts, _ = run_backend(backend, logits, None, **options)
    ref_weights, ref_indices, _, _ = mega_gate_reference(logits, None, **options)
    assert torch.equal(indices, ref_indices)
    assert_near("weights", weights, ref_weights)
    assert torch.equal(counts, torch.bincount(indices.reshape(-1), minlength=logits.shape[1]))
    if options.get("num_groups", 1) > 1:
        return
    probs = F.softmax(logits, dim=-1) if case == "softmax" else F.softplus(logits).sqrt()
    assert torch.equal(indices, probs.sort(dim=-1, descending=True, stable=True).indices[:, :k])
    ranked = probs.sort(dim=-1, descending=True).values
    clear = ranked[:, k - 1] > ranked[:, k]  # the k-th value differs from the next
    assert clear.sum() >= 10 and (~clear).sum() >= 10  # both kinds of rows occur
    topk = probs.topk(k, dim=-1).indices
    assert torch.equal(indices[clear].sort(dim=-1).values, topk[clear].sort(dim=-1).values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_table_repeating_an_expert(backend):
    """transformers zero-initializes tid2eid: every slot the same expert; gradients add up."""
    logits, _ = logits_and_bias(5, tokens=20, num_experts=16, bias=False)
    hashed = torch.randint(0, 3, (20, 4), generator=torch.Generator().manual_seed(5))
    options = dict(score="sqrtsoftplus", top_k=4, routed_scaling_factor=1.5, norm_eps=1e-20, hash_indices=hashed)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, i, counts, _ = run_backend(backend, a, None, **options)
    ref_w, ref_i, ref_counts, _ = mega_gate_reference(b, None, **options)
    assert torch.equal(i, hashed) and torch.equal(counts, ref_counts)
    assert_near("weights", w, ref_w)
    g = torch.randn(w.shape)
    (w * g).sum().backward()
    (ref_w * g).sum().backward()
    assert_near("grad", a.grad, b.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_experts_and_slots(backend):
    """E = 1024 in 16 groups (8 eligible), k = 64, and E not a power of two (tiles padded)."""
    for num_experts, k, groups, top_groups in [(1024, 64, 16, 8), (96, 6, 1, 1)]:
        logits, bias = logits_and_bias(8, tokens=9, num_experts=num_experts)
        options = dict(score="sigmoid", top_k=k, num_groups=groups, top_groups=top_groups, norm_eps=1e-20,
                       aux_probs=True)
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        w, i, counts, prob_sum = run_backend(backend, a, bias, **options)
        ref_w, ref_i, ref_counts, ref_prob_sum = mega_gate_reference(b, bias, **options)
        assert torch.equal(i, ref_i) and torch.equal(counts, ref_counts)
        assert_near("weights", w, ref_w)
        assert_near("prob_sum", prob_sum, ref_prob_sum)
        g = torch.randn(w.shape)
        ((w * g).sum() + prob_sum.sum()).backward()
        ((ref_w * g).sum() + ref_prob_sum.sum()).backward()
        assert_near("grad", a.grad, b.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    w, i, counts, prob_sum = run_backend(backend, torch.zeros(0, 8), None, score="softmax", top_k=2, aux_probs=True)
    assert w.shape == (0, 2) and i.shape == (0, 2)
    assert torch.equal(counts, torch.zeros(8, dtype=torch.int64)) and torch.equal(prob_sum, torch.zeros(8))


@pytest.mark.skipif(native.LIB is None, reason="native library not built")
def test_native_is_deterministic_and_the_cpu_default():
    assert backend_for(torch.device("cpu")) == "native"
    logits, bias = logits_and_bias(6, tokens=300, num_experts=64)
    first = mega_gate(logits, bias, aux_probs=True, **CASES["sigmoid_groups"])
    again = mega_gate(logits, bias, aux_probs=True, **CASES["sigmoid_groups"])
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ compile


@pytest.mark.skipif(native.LIB is None, reason="native library not built")
def test_compiles_whole_to_the_custom_ops():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    options = CASES["sqrtsoftplus"]
    logits, bias = logits_and_bias(7)
    gw, gs = torch.randn(57, 4), torch.randn(32)

    def loss(x):
        weights, indices, counts, prob_sum = mega_gate(x * 2.0, bias, aux_probs=True, **options)
        return (weights * gw).sum() + (prob_sum * gs).sum(), indices, counts

    graphs = {}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind] = gm.code  # AOTAutograd's forward and backward graphs, run as they are
            return make_boxed_func(gm.forward)
        return compile_graph

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    compiled = torch.compile(loss, backend=backend, fullgraph=True)
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, want = compiled(a), loss(b)
    got[0].backward()
    want[0].backward()
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(got[0], want[0]) and torch.equal(a.grad, b.grad)
    assert "hyperparallel.mega_gate_cpu.default" in graphs["forward"]
    assert "hyperparallel.mega_gate_cpu_backward.default" in graphs["backward"]
    torch._dynamo.reset()


# -------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call,error,match", [
    (lambda: mega_gate(torch.zeros(4, 8, dtype=torch.float64), None, score="softmax", top_k=2), ShapeError, "logits"),
    (lambda: mega_gate(torch.zeros(8), None, score="softmax", top_k=2), ShapeError, "logits"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="relu", top_k=2), ConfigError, "score"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="softmax", top_k=9), ConfigError, "top_k"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="softmax", top_k=0), ConfigError, "top_k"),
    (lambda: mega_gate(torch.zeros(4, 8), torch.zeros(7), score="sigmoid", top_k=2), ShapeError, "correction_bias"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, num_groups=3), ConfigError, "num_groups"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, num_groups=4, top_groups=5), ConfigError,
     "top_groups"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, num_groups=8), ConfigError, "num_groups"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=9, num_groups=4, top_groups=2), ConfigError,
     "top_k"),
    # a top_k beyond the experts the eligible groups reach is defined (transformers routes it, and moe's
    # TopKRouter does, op by op: it is not `fusable`), but not for MegaGate, which says so
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=5, num_groups=4, top_groups=2), ConfigError,
     r"top_k \(5\) exceeds the 4 experts that top_groups \(2\) of num_groups \(4\) groups reach.*op by op"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, hash_indices=torch.zeros(4, 3).long()),
     ShapeError, "hash_indices"),
    (lambda: mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, hash_indices=torch.zeros(4, 2)),
     ShapeError, "hash_indices"),
    (lambda: run_backend("cuda", torch.zeros(4, 8), None, score="softmax", top_k=2), ConfigError, "backend"),
])
def test_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(native.LIB is None, reason="native library not built")
def test_hash_index_out_of_range():
    with pytest.raises(ShapeError, match="hash_indices"):
        mega_gate(torch.zeros(4, 8), None, score="sigmoid", top_k=2, hash_indices=torch.full((4, 2), 8))

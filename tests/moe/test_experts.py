"""GroupedExperts computes what transformers' eager experts loop computes, gradients included;
swap_moe_blocks puts it (inside a MoEBlock) in place of transformers' sparse MoE blocks.

Tolerances: float32 results agree with the loop to rtol 1e-5 / atol 1e-5 on values of order 1 (the
matmuls sum in another order); bfloat16 results to rtol 2e-2 plus an atol of two bf16 ulps of the
tensor's largest element (sums of top-k slots cancel, and the bf16 rounding of each slot shows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from hyperparallel.errors import ShapeError
from hyperparallel.models import get_family, make_config, swap_moe_blocks
from hyperparallel.moe import (
    GroupedExperts,
    HighPrecision,
    MoEBlock,
    add_rows_to_tokens,
    gather_rows,
    grouped_mm,
    native_grouped_mm_supported,
    padded_slots,
)
from hyperparallel.moe import grouped_matmul as grouped_mm_module

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def assert_close_bf16(got, want):
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2.0**-6 * want.abs().max().item())


def tiny_config(family: str, name: str):
    return make_config(get_family(family), yaml.safe_load((CONFIGS / name).read_text()))


def reference_grouped_mm(a, b, offsets):
    starts = [0, *offsets.tolist()[:-1]]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offsets.tolist(), strict=True))])


@pytest.fixture(params=["native", "padded_bmm"])
def path(request, monkeypatch):
    """Run a test once through torch._grouped_mm and once through the padded-bmm fallback."""
    if request.param == "padded_bmm":
        monkeypatch.setattr(grouped_mm_module, "native_grouped_mm_supported", lambda a, b: False)
    return request.param


@pytest.mark.parametrize("b_layout", ["row_major", "transposed_weight"])
def test_grouped_mm_matches_per_group_matmul(path, b_layout):
    torch.manual_seed(0)
    a = torch.randn(13, 32, requires_grad=True)
    if b_layout == "row_major":
        b = torch.randn(5, 32, 24, requires_grad=True)
        b_used = b
    else:  # how experts pass their [E, N, K] weights
        b = torch.randn(5, 24, 32, requires_grad=True)
        b_used = b.transpose(-2, -1)
    offsets = torch.tensor([4, 4, 9, 13, 13], dtype=torch.int32)  # groups 1 and 4 are empty

    out = grouped_mm(a, b_used, offsets)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b), grad)
    ref = reference_grouped_mm(a, b_used, offsets)
    ref_grads = torch.autograd.grad(ref, (a, b), grad)

    torch.testing.assert_close(out, ref, **FP32)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)
    if path == "native":
        assert grads[1].stride() == b.stride()  # the weight gradient arrives in the weight's layout, no copy


def test_native_backward_takes_an_expanded_gradient():
    # torch's own _grouped_mm backward rejects the zero-stride gradient that .sum() produces
    a = torch.randn(6, 16, requires_grad=True)
    b = torch.randn(3, 16, 8, requires_grad=True)
    grouped_mm(a, b, torch.tensor([2, 2, 6], dtype=torch.int32)).sum().backward()
    assert a.grad is not None and b.grad is not None and torch.all(b.grad[1] == 0)


def test_native_rule():
    f32, bf16 = torch.float32, torch.bfloat16
    assert native_grouped_mm_supported(torch.empty(3, 64), torch.empty(2, 64, 96))
    assert native_grouped_mm_supported(torch.empty(3, 8, dtype=bf16), torch.empty(2, 8, 16, dtype=bf16))
    # strides must be multiples of 16 bytes: 4 float32 or 8 bfloat16 elements
    assert not native_grouped_mm_supported(torch.empty(3, 62), torch.empty(2, 62, 96))
    assert not native_grouped_mm_supported(torch.empty(3, 64), torch.empty(2, 64, 90))
    assert not native_grouped_mm_supported(torch.empty(3, 60, dtype=bf16), torch.empty(2, 60, 96, dtype=bf16))
    assert not native_grouped_mm_supported(
        torch.empty(3, 64, dtype=torch.float64), torch.empty(2, 64, 96, dtype=torch.float64)
    )
    assert not native_grouped_mm_supported(torch.empty(3, 64, dtype=f32), torch.empty(2, 64, 96, dtype=bf16))
    assert native_grouped_mm_supported(torch.empty(3, 64), torch.empty(2, 96, 64).transpose(-2, -1))
    assert not native_grouped_mm_supported(torch.empty(3, 64), torch.empty(2, 64, 192)[:, :, ::2])


def test_unaligned_shapes_fall_back_and_stay_correct():
    a, b = torch.randn(7, 6, dtype=torch.float64), torch.randn(3, 6, 5, dtype=torch.float64)
    offsets = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(a, b, offsets), reference_grouped_mm(a, b, offsets))


def test_grouped_mm_shape_errors():
    with pytest.raises(ShapeError, match=r"a \[M,K\] and b \[E,K,N\]"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 6, 3), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ShapeError, match="offsets of shape"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 3), torch.tensor([4], dtype=torch.int32))


def hf_experts(family: str, config_name: str, dtype=torch.float32):
    config = tiny_config(family, config_name)
    config._experts_implementation = "eager"  # the reference: transformers' loop over experts
    experts_class = Qwen3MoeExperts if family == "qwen3_moe" else DeepseekV3Experts
    torch.manual_seed(1)
    experts = experts_class(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
    return experts, config


def routing(num_tokens: int, num_experts: int, top_k: int, idle: int, weight_dtype):
    """top-k distinct experts per token, never the last `idle` experts; positive weights."""
    scores = torch.rand(num_tokens, num_experts)
    scores[:, num_experts - idle :] = -1.0
    index = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, dtype=weight_dtype).requires_grad_()
    return index, weights


def run(module, hidden, index, weights):
    """Output and gradients w.r.t. inputs, routing weights and both 3-D parameters."""
    out = module(hidden, index, weights)
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad(out, (hidden, weights, module.gate_up_proj, module.down_proj), grad)
    return out, grads


CASES = [("qwen3_moe", "qwen3_moe_tiny.yaml"), ("deepseek_v3", "kimi_k2_tiny.yaml")]


@pytest.mark.parametrize(("family", "config_name"), CASES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_matches_hf_experts_fp32(path, family, config_name, num_tokens):
    experts, config = hf_experts(family, config_name)
    top_k = config.num_experts_per_tok
    torch.manual_seed(2)
    hidden = torch.randn(num_tokens, config.hidden_size, requires_grad=True)
    index, weights = routing(num_tokens, experts.num_experts, top_k, idle=3, weight_dtype=torch.float32)

    if path == "native":  # the tiny shapes are aligned, so the native kernel really runs
        assert native_grouped_mm_supported(hidden, experts.down_proj.transpose(-2, -1))
    want = run(experts, hidden, index, weights)
    got = run(GroupedExperts.from_hf(experts), hidden, index, weights)  # the same Parameter objects
    torch.testing.assert_close(got[0], want[0], **FP32)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, **FP32)
    if num_tokens:
        assert torch.all(got[1][2][-3:] == 0) and torch.all(got[1][3][-3:] == 0)  # idle experts: zero gradient


@pytest.mark.parametrize(("family", "config_name"), CASES)
def test_no_tokens(path, family, config_name):
    experts, config = hf_experts(family, config_name)
    hidden = torch.randn(0, config.hidden_size, requires_grad=True)
    index, weights = routing(0, experts.num_experts, config.num_experts_per_tok, idle=0, weight_dtype=torch.float32)
    out, grads = run(GroupedExperts.from_hf(experts), hidden, index, weights)
    assert out.shape == (0, config.hidden_size)
    assert torch.all(grads[2] == 0) and torch.all(grads[3] == 0)


@pytest.mark.parametrize(("family", "config_name"), CASES)
def test_matches_hf_experts_bf16(path, family, config_name):
    experts, config = hf_experts(family, config_name, dtype=torch.bfloat16)
    torch.manual_seed(3)
    hidden = torch.randn(29, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    # DeepSeek's router hands float32 weights to bf16 experts; Qwen3-MoE's casts them to the hidden dtype.
    weight_dtype = torch.float32 if family == "deepseek_v3" else torch.bfloat16
    index, weights = routing(29, experts.num_experts, config.num_experts_per_tok, idle=2, weight_dtype=weight_dtype)

    want = run(experts, hidden, index, weights)
    got = run(GroupedExperts.from_hf(experts), hidden, index, weights)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    assert_close_bf16(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert g.dtype == w.dtype
        assert_close_bf16(g, w)


@pytest.mark.parametrize(("family", "config_name", "moe_layers"),
                         [("qwen3_moe", "qwen3_moe_tiny.yaml", 2), ("kimi_k2", "kimi_k2_tiny.yaml", 2)])
def test_swap_moe_blocks_keeps_parameter_and_buffer_objects_and_names(family, config_name, moe_layers):
    from hyperparallel.models import build_model

    config = yaml.safe_load((CONFIGS / config_name).read_text())
    model = build_model(family, config=config, grouped_experts=False)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())  # DeepSeek's routers hold e_score_correction_bias
    keys = list(model.state_dict())

    assert swap_moe_blocks(model) == moe_layers  # kimi_k2_tiny's first layer is dense
    assert swap_moe_blocks(model) == 0  # nothing left to swap
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert len(blocks) == moe_layers and all(isinstance(b.experts, GroupedExperts) for b in blocks)


def test_from_hf_rejects_a_layout_it_cannot_run():
    experts, _ = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    E, H, inter = experts.down_proj.shape
    experts.down_proj = torch.nn.Parameter(torch.zeros(E, H, inter + 32))
    with pytest.raises(ShapeError, match="down_proj"):
        GroupedExperts.from_hf(experts)
    experts, _ = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    experts.has_bias = True
    with pytest.raises(ShapeError, match="has_bias"):
        GroupedExperts.from_hf(experts)


def test_padded_slots_lay_groups_out_on_aligned_starts():
    # 6 rows sorted by expert: expert 0 has 3, expert 1 none, expert 2 has 3; align 4
    token_of_row = torch.tensor([5, 0, 2, 1, 4, 3])
    expert_of_row = torch.tensor([0, 0, 0, 2, 2, 2])
    offsets = torch.tensor([3, 3, 6], dtype=torch.int32)
    token_of_slot, row_slot, ends = padded_slots(token_of_row, expert_of_row, offsets, num_tokens=6, align=4)
    assert ends.tolist() == [4, 4, 8] and ends.dtype == torch.int32
    assert row_slot.tolist() == [0, 1, 2, 4, 5, 6]
    assert token_of_slot.tolist() == [5, 0, 2, 6, 1, 4, 3, 6]  # 6 = the zero row


@pytest.mark.parametrize(("family", "config_name"), CASES)
def test_under_bf16_autocast_experts_run_in_bf16_like_hf_eager_experts(family, config_name):
    """fp32 experts under bf16 autocast: the products in bf16 (padded groups on the CPU), as
    transformers' eager loop gets from autocast; outputs and fp32 parameter gradients agree."""
    experts, config = hf_experts(family, config_name)
    torch.manual_seed(4)
    hidden = torch.randn(45, config.hidden_size, requires_grad=True)
    index, weights = routing(45, experts.num_experts, config.num_experts_per_tok, idle=2, weight_dtype=torch.float32)
    grouped = GroupedExperts.from_hf(experts)
    assert HighPrecision().group_alignment(hidden.device, torch.bfloat16) > 1  # the padded layout is what runs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(experts, hidden, index, weights)
        got = run(grouped, hidden, index, weights)
        exact = run(grouped, hidden.double().float(), index, weights)  # same input again: same numbers
    torch.testing.assert_close(got[0], exact[0], rtol=0, atol=0)
    assert got[1][2].dtype == torch.float32  # parameter gradients stay in the parameters' dtype
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        assert_close_bf16(g.float(), w.float())


def test_grouped_mm_traces_under_torch_compile():
    torch.manual_seed(5)
    a = torch.randn(40, 16, requires_grad=True)
    b = torch.randn(3, 24, 16, requires_grad=True)  # an [E, N, K] weight seen as [E, K, N]
    offsets = torch.tensor([10, 10, 40], dtype=torch.int32)

    def f(a, b):
        return (grouped_mm(a, b.transpose(-2, -1), offsets).sin() * 2).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    want = torch.autograd.grad(f(a, b), (a, b))
    got = torch.autograd.grad(compiled(a, b), (a, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_padded_layout_has_a_fixed_length_under_compile():
    """Under torch.compile the padded layout has the worst-case length (no host sync); the last group
    takes the slack, and experts computed that way give the eager results."""
    token_of_row = torch.tensor([5, 0, 2, 1, 4, 3])
    expert_of_row = torch.tensor([0, 0, 0, 2, 2, 2])
    offsets = torch.tensor([3, 3, 6], dtype=torch.int32)
    slots = torch.compile(padded_slots, backend="aot_eager", fullgraph=True)
    token_of_slot, row_slot, ends = slots(token_of_row, expert_of_row, offsets, num_tokens=6, align=4)
    assert ends.tolist() == [4, 4, 16]  # 6 rows + 3 groups x 3 short, rounded up to 4
    assert row_slot.tolist() == [0, 1, 2, 4, 5, 6]
    assert token_of_slot.tolist() == [5, 0, 2, 6, 1, 4, 3] + [6] * 9
    experts, config = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    grouped = GroupedExperts.from_hf(experts)
    torch.manual_seed(6)
    hidden = torch.randn(33, config.hidden_size, requires_grad=True)
    index, weights = routing(33, experts.num_experts, config.num_experts_per_tok, idle=1, weight_dtype=torch.float32)
    compiled = torch.compile(grouped, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(grouped, hidden, index, weights)
        got = run(compiled, hidden, index, weights)
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        assert_close_bf16(g.float(), w.float())



def test_row_gathers_and_sums_are_checked_custom_ops():
    """gather_rows and add_rows_to_tokens: schemas, fake kernels and autograd as torch.library
    checks them, and each other's backward (index_select's and index_add's gradients)."""
    torch.manual_seed(7)
    source = torch.randn(6, 5, requires_grad=True)
    index = torch.tensor([4, 0, 0, 5, 2, 4, 1])
    torch.library.opcheck(torch.ops.hyperparallel.gather_rows, (source, index))
    torch.library.opcheck(torch.ops.hyperparallel.sum_rows_into, (torch.randn(7, 5, requires_grad=True), index, 6))
    rows = torch.randn(7, 5, requires_grad=True)
    grad = torch.randn(6, 5)
    want = torch.autograd.grad(source.index_select(0, index), source, rows.detach())
    torch.testing.assert_close(torch.autograd.grad(gather_rows(source, index), source, rows.detach()), want,
                               rtol=0, atol=0)
    summed = add_rows_to_tokens(rows, index, 6)
    torch.testing.assert_close(summed, torch.zeros(6, 5).index_add(0, index, rows), rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(summed, rows, grad)[0], grad.index_select(0, index), rtol=0, atol=0)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_compiled_experts_leave_row_gathers_and_sums_to_aten(autocast):
    """Under Inductor's decompositions, the experts' forward and backward graphs hold no index_add
    and no accumulating index_put (which Inductor's CPU code runs as an atomic add per element):
    the permutation's gathers and sums are the custom ops, run by ATen's kernels."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table

    experts, config = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    grouped = GroupedExperts.from_hf(experts)
    graphs = []

    def keep(gm, example_inputs):
        calls = [node for node in gm.graph.nodes if node.op == "call_function"]
        accumulating = {"index_put(accumulate)" for node in calls if "index_put" in str(node.target)
                        and (node.kwargs.get("accumulate") or (len(node.args) > 3 and node.args[3]))}
        graphs.append({str(node.target) for node in calls} | accumulating)
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep,
                                     decompositions=select_decomp_table())

    torch.manual_seed(8)
    hidden = torch.randn(33, config.hidden_size, requires_grad=True)
    index, weights = routing(33, experts.num_experts, config.num_experts_per_tok, idle=1, weight_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = run(grouped, hidden, index, weights)
        got = run(torch.compile(grouped, backend=backend, fullgraph=True), hidden, index, weights)
    assert len(graphs) == 2  # forward and backward
    for ops in graphs:
        assert not {op for op in ops if "index_add" in op or "accumulate" in op}  # (padded_slots' index_put is a store)
        assert "hyperparallel.gather_rows.default" in ops and "hyperparallel.sum_rows_into.default" in ops
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):  # (the decompositions round otherwise)
        assert_close_bf16(g.float(), w.float()) if autocast else torch.testing.assert_close(g, w, **FP32)


# -- run_sorted: the products alone, on rows already ordered by expert --


class RecordingRecipe:
    """A recipe that runs another's products and records the group ends they ran on."""

    def __init__(self, inner):
        self.inner, self.offsets = inner, []

    def group_alignment(self, device, dtype):
        return self.inner.group_alignment(device, dtype)

    def compute_dtype(self, hidden_states):
        return self.inner.compute_dtype(hidden_states)

    def products(self, experts, rows, offsets):
        self.offsets.append(offsets.tolist())
        return self.inner.products(experts, rows, offsets)

    def describe(self):
        return "recording " + self.inner.describe()


SORTED_COUNTS = [3, 0, 40, 1, 0, 33, 2, 0, 5, 0, 0, 7, 1, 0, 9, 4]  # 16 experts: empty and off the 32-row grid


def sorted_rows(config):
    """Rows ordered by expert, their offsets, and the same rows as a top-1 routing with weight 1."""
    counts = torch.tensor(SORTED_COUNTS)
    assert len(counts) == config.num_experts
    torch.manual_seed(7)
    rows = torch.randn(int(counts.sum()), config.hidden_size, requires_grad=True)
    index = torch.repeat_interleave(torch.arange(len(counts)), counts).unsqueeze(1)  # already sorted
    return rows, counts.cumsum(0).to(torch.int32), index, torch.ones(index.shape)


def run_sorted_and_grads(grouped, rows, offsets):
    out = grouped.run_sorted(rows, offsets)
    grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out, torch.autograd.grad(out, (rows, grouped.gate_up_proj, grouped.down_proj), grad)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32_unpadded", "bf16_autocast_padded"])
def test_run_sorted_equals_forward_on_sorted_rows(autocast):
    """run_sorted(rows, offsets) is forward's per-row products: forward of the same rows routed
    top-1 to their own expert with weight 1 gives the same bits, gradients included; under bf16
    autocast on the CPU both run on groups padded to 32 rows, in fp32 on the groups as they are."""
    experts, config = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    grouped = GroupedExperts.from_hf(experts)
    grouped.recipe = RecordingRecipe(HighPrecision())
    rows, offsets, index, ones = sorted_rows(config)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        got = run_sorted_and_grads(grouped, rows, offsets)
        via_forward = grouped(rows, index, ones)
        grad = torch.linspace(-1, 1, via_forward.numel()).view_as(via_forward)
        want = (via_forward, torch.autograd.grad(via_forward, (rows, grouped.gate_up_proj, grouped.down_proj), grad))

    assert got[0].dtype == rows.dtype  # in the rows' dtype, whatever the products ran in
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)
    run_sorted_groups, forward_groups = grouped.recipe.offsets
    assert run_sorted_groups == forward_groups
    if autocast:
        padded = torch.tensor(SORTED_COUNTS).add(31).div(32, rounding_mode="floor").mul(32).cumsum(0).tolist()
        assert run_sorted_groups == padded
    else:
        assert run_sorted_groups == offsets.tolist()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32_unpadded", "bf16_autocast_padded"])
def test_run_sorted_matches_hf_experts_on_sorted_rows(autocast):
    """Against transformers' eager loop, the same top-1 routing with weight 1."""
    experts, config = hf_experts("qwen3_moe", "qwen3_moe_tiny.yaml")
    grouped = GroupedExperts.from_hf(experts)
    rows, offsets, index, ones = sorted_rows(config)
    params = (rows, grouped.gate_up_proj, grouped.down_proj)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        got = run_sorted_and_grads(grouped, rows, offsets)
        hf_out = experts(rows, index, ones)
        grad = torch.linspace(-1, 1, hf_out.numel(), dtype=hf_out.dtype).view_as(hf_out)
        want = (hf_out, torch.autograd.grad(hf_out, params, grad))
    for g, w in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        if autocast:
            assert_close_bf16(g.float(), w.float())
        else:
            torch.testing.assert_close(g, w, **FP32)


def test_parameters_all_experts_share_are_named_for_expert_parallelism():
    from hyperparallel.parallel.expert_parallel import keep_local_experts, shared_by_experts

    experts = GroupedExperts(4, 8, 16, torch.nn.SiLU())
    assert shared_by_experts(experts) == []
    experts.has_post_expert_norm, experts.post_expert_norm = True, torch.nn.LayerNorm(8)
    assert shared_by_experts(experts) == ["post_expert_norm.weight", "post_expert_norm.bias"]
    keep_local_experts(experts, ep=2, ep_rank=1)  # (the norm is not sliced per expert: preflight refuses ep)
    assert experts.gate_up_proj.shape[0] == 2 and experts.post_expert_norm.weight.shape == (8,)

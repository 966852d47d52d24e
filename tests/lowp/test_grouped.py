"""MXExpertsRecipe: GroupedExperts with MXFP8 products (what lowp.convert sets on experts), the
same module and Parameters, MX products that are exact, weight copies made once per weight
version, and numerics and saved memory measured against the high-precision recipe.

On the CPU the products run on groups padded with zero rows to multiples of 32 (the recipe's
group alignment): zero rows change no block, so none of the results below depend on it.

Exactness, stated precisely:
- with the reference backend the module equals, bit for bit (torch.equal), a per-expert loop that
  quantizes each operand with the reference backend and multiplies in float64 (MX products of
  these sizes are exact in float64, so both round the same exact value once);
- with the CPU backend each product equals that float64 product to float32 accumulation accuracy:
  |got - exact| <= (K + 1) * 2**-24 * (|A| @ |B|), K the length of the sum;
- through the whole module, the CPU backend's float32 rounding can move an intermediate value
  across an FP8 rounding boundary, so there the check is a 60 dB SQNR, not equality.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import hyperparallel.lowp.grouped as lowp_grouped
from hyperparallel import mx, versions
from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe, convert
from hyperparallel.lowp.grouped import _MXGroupedLinear, _quantize_weight, _Recipe
from hyperparallel.moe import GroupedExperts

E, H, INTER, TOP_K = 8, 64, 96, 2


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())).item()


def make_experts(dtype=torch.float32) -> GroupedExperts:
    experts = GroupedExperts(E, H, INTER, nn.SiLU(), dtype=dtype)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        experts.reset_parameters(std=0.05)
    return experts


def make_batch(tokens=120, dtype=torch.float32, top_k_index=None):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    if top_k_index is None:  # distinct experts per token, as a router's top-k gives
        top_k_index = torch.rand(tokens, E, generator=g).topk(TOP_K, dim=-1).indices
    weights = torch.rand(tokens, top_k_index.shape[1], generator=g)  # float32, as routers give
    return x.requires_grad_(), top_k_index, weights


def run(module, x, top_k_index, weights):
    """Forward and backward with a fixed output gradient; returns (out, dx, d gate_up, d down)."""
    x = x.detach().requires_grad_()
    for p in module.parameters():
        p.grad = None
    out = module(x, top_k_index, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    grads = [None if p.grad is None else p.grad.clone() for p in (module.gate_up_proj, module.down_proj)]
    return out.detach(), x.grad, *grads


def mx_of(experts, backend=None, save_weight_copy=True, **config) -> GroupedExperts:
    """A second GroupedExperts on `experts`' Parameter objects, with the MXFP8 recipe (so that
    `experts` itself keeps computing in high precision)."""
    module = GroupedExperts.from_hf(experts)
    module.recipe = MXExpertsRecipe(LowPrecisionConfig(**config), backend=backend, save_weight_copy=save_weight_copy)
    return module


def mx_linear(x, w, offsets, recipe: _Recipe, grad_enabled=True):
    """One MX projection, with W's two MX copies made as the recipe makes them."""
    return _MXGroupedLinear.apply(x, w, _quantize_weight(w.detach(), recipe, along_n=True), offsets, recipe,
                                  grad_enabled)


def padded_rows(top_k_index: torch.Tensor, align: int = 32) -> int:
    """How many rows the products run on: each expert's (token, slot) pairs padded to `align`."""
    counts = torch.bincount(top_k_index.reshape(-1), minlength=E)
    return int(((counts + align - 1) // align * align).sum())


# -- the spec, by hand: one expert at a time, each operand quantized by the reference backend --


def ref_q(t: torch.Tensor, axis: int) -> torch.Tensor:
    return mx.quantize(t, axis, backend="reference").dequantize(torch.float64, backend="reference")


class _ReferenceLinear(torch.autograd.Function):
    """x [m, K] @ w [N, K]^T for one expert; every product in float64 from quantized operands."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (ref_q(x, 1) @ ref_q(w, 1).T).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        # blocks along N for dgrad; along this expert's tokens for wgrad (they start at row 0 here)
        return (ref_q(dy, 1) @ ref_q(w, 0)).to(x.dtype), (ref_q(dy, 0).T @ ref_q(x, 0)).to(w.dtype)


def reference_experts(module, x, top_k_index, weights):
    """transformers' eager experts loop with _ReferenceLinear for every projection."""
    out = torch.zeros_like(x)
    for e in range(module.gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == e)  # token order: the stable sort's order
        if len(token) == 0:
            continue
        gate, up = _ReferenceLinear.apply(x[token], module.gate_up_proj[e]).chunk(2, dim=-1)
        rows = _ReferenceLinear.apply(module.act_fn(gate) * up, module.down_proj[e])
        out = out.index_add(0, token, (rows * weights[token, slot, None]).to(x.dtype))
    return out


class _Reference(nn.Module):
    """`module`'s Parameters, computed by reference_experts (subclasses change the computation)."""

    def __init__(self, module):
        super().__init__()
        self.inner = module

    @property
    def gate_up_proj(self):
        return self.inner.gate_up_proj

    @property
    def down_proj(self):
        return self.inner.down_proj

    def forward(self, x, top_k_index, weights):
        return reference_experts(self.inner, x, top_k_index, weights)


# -- the module and its parameters --


def test_convert_sets_the_recipe_on_the_same_module_and_parameters():
    experts = make_experts()
    model = nn.ModuleDict({"experts": experts})
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    report = convert(model, LowPrecisionConfig(enabled=True))
    assert report.replaced == ["experts"] and not report.skipped
    assert model.experts is experts and isinstance(experts.recipe, MXExpertsRecipe)
    assert all(p is params[n] for n, p in model.named_parameters()) and list(model.state_dict()) == keys
    assert (experts.num_experts, experts.hidden_dim, experts.intermediate_dim) == (E, H, INTER)
    assert "mxfp8" in repr(experts)
    assert convert(model, LowPrecisionConfig(enabled=True)).replaced == []  # already MXFP8: left alone
    # what convert sets computes what the recipe built by hand computes
    batch = make_batch()
    for got, want in zip(run(experts, *batch), run(mx_of(experts), *batch), strict=True):
        assert torch.equal(got, want)


def test_convert_skips_transformers_experts_and_names_swap_moe_blocks():
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K)
    hf = Qwen3MoeExperts(config)
    params = dict(hf.named_parameters())
    model = nn.ModuleDict({"experts": hf})
    report = convert(model, LowPrecisionConfig(enabled=True))
    assert report.replaced == [] and [name for name, _ in report.skipped] == ["experts"]
    assert "swap_moe_blocks" in report.skipped[0][1] and "GroupedExperts" in report.skipped[0][1]
    assert "skipped experts:" in report.summary()
    assert model.experts is hf and not hasattr(hf, "recipe")
    assert all(p is params[n] for n, p in hf.named_parameters())


def test_the_recipe_on_transformers_parameters_matches_transformers_experts():
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K,
                            experts_implementation="eager")
    hf = Qwen3MoeExperts(config)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for p in hf.parameters():
            nn.init.normal_(p, std=0.05)
    converted = mx_of(hf)
    assert converted.gate_up_proj is hf.gate_up_proj and converted.down_proj is hf.down_proj
    assert converted.act_fn is hf.act_fn
    batch = make_batch()
    with torch.no_grad():
        assert sqnr(hf(*batch), converted(*batch)) > 20


def test_convert_works_on_the_meta_device():
    with torch.device("meta"):
        experts = GroupedExperts(E, H, INTER, nn.SiLU())
    convert(nn.ModuleDict({"experts": experts}), LowPrecisionConfig(enabled=True))
    assert isinstance(experts.recipe, MXExpertsRecipe) and experts.gate_up_proj.is_meta


def test_convert_skips_experts_in_a_dtype_the_kernels_cannot_take():
    experts = make_experts(torch.float64)
    report = convert(nn.ModuleDict({"experts": experts}), LowPrecisionConfig(enabled=True))
    assert [name for name, _ in report.skipped] == ["experts"] and "torch.float64" in report.skipped[0][1]
    assert not isinstance(experts.recipe, MXExpertsRecipe)


# -- exactness --


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 accumulation error bound of a @ b (sum length K) rounded once to float32."""
    return (a.shape[-1] + 1) * 2.0**-24 * (a.abs() @ b.abs())


@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 48)])  # 40 and 48: partial blocks, no dual pass
def test_each_product_is_the_reference_product_to_float32_accumulation(n, k):
    sizes = [0, 1, 31, 33, 0, 70, 32, 5]  # empty experts and groups off the 32-row grid
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes), k, generator=g).requires_grad_()
    w = (torch.randn(len(sizes), n, k, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(sum(sizes), n, generator=g)
    recipe = _Recipe("rceil", "mxfp8", "columnwise", True, "cpu")
    y = mx_linear(x, w, offsets, recipe)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32

    starts = [0, *offsets.tolist()[:-1]]
    groups = [(s, e) for s, e in zip(starts, offsets.tolist(), strict=True)]
    for gi, (s, e) in enumerate(groups):
        xq, dyq = ref_q(x[s:e].detach(), 1), ref_q(dy[s:e], 1)
        want = xq @ ref_q(w[gi].detach(), 1).T
        assert ((y[s:e] - want).abs() <= _bound(xq, ref_q(w[gi].detach(), 1).T)).all()
        want = dyq @ ref_q(w[gi].detach(), 0)
        assert ((dx[s:e] - want).abs() <= _bound(dyq, ref_q(w[gi].detach(), 0))).all()
        if e == s:
            assert torch.equal(dw[gi], torch.zeros_like(dw[gi]))  # an expert without tokens gets no grad
            continue
        a, b = ref_q(dy[s:e], 0).T, ref_q(x[s:e].detach(), 0)
        assert ((dw[gi] - a @ b).abs() <= _bound(a, b)).all()


def test_reference_backend_module_equals_the_hand_computed_spec():
    experts = make_experts()
    batch = make_batch(tokens=60)
    for got, want in zip(run(mx_of(experts, "reference"), *batch), run(_Reference(experts), *batch), strict=True):
        assert torch.equal(got, want)


def test_cpu_backend_module_matches_the_hand_computed_spec():
    experts = make_experts()
    batch = make_batch(tokens=60)
    for got, want in zip(run(mx_of(experts, "cpu"), *batch), run(_Reference(experts), *batch), strict=True):
        assert sqnr(want, got) > 60


# -- numerics against the high-precision experts --


def test_sqnr_against_bf16_grouped_experts():
    experts = make_experts(torch.bfloat16)
    batch = make_batch(tokens=200, dtype=torch.bfloat16)
    want = run(experts, *batch)
    got = run(mx_of(experts), *batch)
    assert [t.dtype for t in got] == [torch.bfloat16] * 4
    out, dx, d_gate_up, d_down = (sqnr(w, g) for w, g in zip(want, got, strict=True))
    print(f"SQNR dB: output {out:.2f}, input grad {dx:.2f}, gate_up grad {d_gate_up:.2f}, down grad {d_down:.2f}")
    # Two chained MX projections with a SwiGLU between cannot reach 25 dB on random data: each
    # FP8 operand alone is ~31.5 dB, a product of two ~28.5, the chain ~23.5 (fake-quant in
    # float64 gives the same figures), hence 23 dB for the output and 22 for the gradients.
    assert out >= 23 and dx >= 23 and d_gate_up >= 22 and d_down >= 22


def test_single_product_sqnr_against_bf16():
    sizes = [50, 0, 31, 33, 90, 1, 64, 131]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(sizes), H, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(len(sizes), 2 * INTER, H, generator=g) * 0.05).bfloat16().requires_grad_()
    dy = torch.randn(sum(sizes), 2 * INTER, generator=g).bfloat16()
    y = mx_linear(x, w, offsets, _Recipe("rceil", "mxfp8", "columnwise", True, None))
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    y_ref = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    want = (y_ref, *torch.autograd.grad(y_ref, (x, w), dy))
    assert all(sqnr(r, t) >= 27 for r, t in zip(want, got, strict=True))


# -- routing --


@pytest.mark.parametrize(
    "counts",
    [
        [0, 1, 31, 33, 0, 0, 2, 3],  # group sizes off the 32-row grid, empty experts
        [0, 0, 0, 140, 0, 0, 0, 0],  # one expert takes every row
        [0, 0, 0, 0, 0, 0, 0, 1],  # a single (token, slot) pair
    ],
)
def test_empty_and_skewed_routing(counts):
    top_k_index = torch.repeat_interleave(torch.arange(E), torch.tensor(counts)).reshape(-1, 1)
    top_k_index = top_k_index[torch.randperm(len(top_k_index), generator=torch.Generator().manual_seed(5))]
    experts = make_experts()
    batch = make_batch(tokens=len(top_k_index), top_k_index=top_k_index)
    got = run(mx_of(experts), *batch)
    want = run(_Reference(experts), *batch)
    hp = run(experts, *batch)
    for g, w, h in zip(got, want, hp, strict=True):
        assert sqnr(w, g) > 60 and sqnr(h, g) > 20
    for e, n in enumerate(counts):
        if n == 0:
            assert not got[2][e].any() and not got[3][e].any()


def test_no_tokens():
    out, dx, d_gate_up, d_down = run(mx_of(make_experts()), *make_batch(tokens=0))
    assert out.shape == (0, H) and dx.shape == (0, H)
    assert not d_gate_up.any() and not d_down.any()


# -- what forward keeps for backward --


def saved_bytes(module, x, top_k_index, weights) -> tuple[int, int]:
    """(activation bytes, weight-copy bytes) that autograd keeps, each storage counted once;
    the module's Parameters (kept by reference, not copied) are left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = (storage.nbytes(), t.dim() == 3)  # 3-D: copies of [E, N, K] weights
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, top_k_index, weights)
    del out
    activations = sum(n for n, is_weight in kept.values() if not is_weight)
    return activations, sum(n for n, is_weight in kept.values() if is_weight)


def input_copy_bytes(rows: int, width: int = H) -> int:
    """An input of `rows` (padded) rows kept as its FP8 grouped column-wise copy: a byte an
    element, plus rows // 32 + E rows of scale bytes."""
    return rows * width + (rows // 32 + E) * width


def test_saved_bytes_against_bf16_grouped_experts():
    experts = make_experts(torch.bfloat16)
    x, top_k_index, weights = make_batch(tokens=200, dtype=torch.bfloat16)
    hp_act, hp_weights = saved_bytes(experts, x, top_k_index, weights)
    mx_act, mx_weights = saved_bytes(mx_of(experts), x, top_k_index, weights)
    no_copy = mx_of(experts, save_weight_copy=False)
    no_copy_act, no_copy_weights = saved_bytes(no_copy, x, top_k_index, weights)
    weight_bytes = 2 * (E * 2 * INTER * H + E * H * INTER)
    print(
        f"saved activation bytes: high precision {hp_act}, MXFP8 {mx_act}, ratio {mx_act / hp_act:.3f}; "
        f"MX weight copies {mx_weights} ({mx_weights / weight_bytes:.3f} of the bf16 weights)"
    )
    # MX keeps gate_up's input as its FP8 column-wise copy and gate_up's output in bf16 (the gated
    # activation and the down projection's input are rebuilt from it), both over the padded rows,
    # then only small things: per (token, slot) pair its routing weight and two int64 indices (its
    # token, its padded slot), per padded slot the token it reads, the offsets. Nothing of size
    # [pairs, H]: summing the weighted rows into their tokens needs only their tokens in backward
    # (index_add would keep its whole source).
    pairs, rows = top_k_index.numel(), padded_rows(top_k_index)
    big = input_copy_bytes(rows) + rows * 2 * INTER * 2
    small = pairs * (weights.element_size() + 2 * 8) + rows * 8 + 1024
    assert big <= mx_act <= big + small, f"{mx_act - big - small} bytes more than the activations above"
    # the high-precision recipe keeps the bf16 input and gate, up and act(gate): measured 0.516
    assert mx_act < 0.55 * hp_act
    # dgrad's copies of both weights blocked along N (FP8 data, a scale byte per 32), and only with
    # save_weight_copy; GroupedExperts keeps its Parameters, which cost nothing extra
    assert hp_weights == 0 and no_copy_weights == 0 and no_copy_act == mx_act
    assert mx_weights == weight_bytes // 2 * 33 // 32


def test_frozen_weights_get_no_grad_and_keep_no_input_copy():
    experts = make_experts(torch.bfloat16)
    batch = make_batch(dtype=torch.bfloat16)
    trainable = run(mx_of(experts), *batch)
    trainable_bytes = saved_bytes(mx_of(experts), *batch)
    experts.requires_grad_(False)
    frozen = run(mx_of(experts), *batch)
    frozen_bytes = saved_bytes(mx_of(experts), *batch)
    assert frozen[2] is None and frozen[3] is None
    assert torch.equal(frozen[0], trainable[0]) and torch.equal(frozen[1], trainable[1])
    assert trainable_bytes[0] - frozen_bytes[0] == input_copy_bytes(padded_rows(batch[1]))
    assert frozen_bytes[1] == trainable_bytes[1]  # dgrad still needs the weights along N


def test_no_grad_forward_keeps_nothing_and_matches_training():
    experts = make_experts()
    x, top_k_index, weights = make_batch()
    with torch.no_grad():
        out = mx_of(experts)(x, top_k_index, weights)
    assert torch.equal(out, run(mx_of(experts), x, top_k_index, weights)[0])


# -- variants --


def test_save_input_original_and_requantized_weights_give_identical_results():
    experts = make_experts(torch.bfloat16)
    batch = make_batch(dtype=torch.bfloat16)
    default = run(mx_of(experts), *batch)
    for module in (
        mx_of(experts, save_input="original"),
        mx_of(experts, save_weight_copy=False),
    ):
        for got, want in zip(run(module, *batch), default, strict=True):
            assert torch.equal(got, want)
    original_bytes = saved_bytes(mx_of(experts, save_input="original"), *batch)[0]
    assert saved_bytes(mx_of(experts), *batch)[0] < original_bytes


def test_high_precision_wgrad():
    experts = make_experts(torch.bfloat16)
    batch = make_batch(tokens=200, dtype=torch.bfloat16)
    hp = run(experts, *batch)
    mxfp8 = run(mx_of(experts), *batch)
    got = run(mx_of(experts, wgrad="high_precision"), *batch)
    assert torch.equal(got[0], mxfp8[0]) and torch.equal(got[1], mxfp8[1])  # forward and dgrad unchanged
    for i in (2, 3):
        assert got[i].dtype == torch.bfloat16
        assert sqnr(hp[i], got[i]) > sqnr(hp[i], mxfp8[i]) + 1  # wgrad no longer quantized
        assert sqnr(hp[i], got[i]) > 22


def test_high_precision_wgrad_fallback_for_unaligned_sizes():
    # K = 40 bf16 is 80 bytes, not a multiple of 16: torch._grouped_mm cannot take it
    sizes = [3, 0, 37, 20]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(sum(sizes), 40, generator=g).requires_grad_()
    w = torch.randn(len(sizes), 32, 40, generator=g).requires_grad_()
    recipe = _Recipe("rceil", "high_precision", "columnwise", True, None)
    dy = torch.randn(sum(sizes), 32, generator=g)
    (dw,) = torch.autograd.grad(mx_linear(x.half(), w, offsets, recipe), (w,), dy.half())
    starts = [0, *offsets.tolist()[:-1]]
    want = torch.stack([dy[s:e].T @ x[s:e].detach() for s, e in zip(starts, offsets.tolist(), strict=True)])
    assert dw.dtype == torch.float32
    torch.testing.assert_close(dw, want, rtol=1e-2, atol=2e-2)


def test_activation_recompute_gives_identical_results():
    # a checkpointed layer reruns forward in backward: the quantized copies must come out the same
    module = mx_of(make_experts(torch.bfloat16))
    batch = make_batch(dtype=torch.bfloat16)
    want = run(module, *batch)

    class Checkpointed(_Reference):
        def forward(self, *args):
            return checkpoint(self.inner, *args, use_reentrant=False)

    for got, w in zip(run(Checkpointed(module), *batch), want, strict=True):
        assert torch.equal(got, w)


# -- weight copies: made once per weight version --


@pytest.fixture
def quantize_calls(monkeypatch):
    """The weights (by identity) that the recipe makes MX copies of, call by call."""
    calls = []

    def counted(weight, r, along_n):
        calls.append(weight.untyped_storage().data_ptr())
        return _quantize_weight(weight, r, along_n)

    monkeypatch.setattr(lowp_grouped, "_quantize_weight", counted)
    return calls


def test_weight_copies_are_made_once_per_weight_version(quantize_calls):
    experts = make_experts(torch.bfloat16)
    module = mx_of(experts)
    gate_up, down = (p.untyped_storage().data_ptr() for p in (experts.gate_up_proj, experts.down_proj))
    batch = make_batch(dtype=torch.bfloat16)

    def new_copies(step) -> list:
        """The weights that `step` made new copies of; what it computes equals a module with no
        cache at all (a fresh recipe), so reused copies are never stale."""
        before = len(quantize_calls)
        got = step()
        made = quantize_calls[before:]
        for g, w in zip(got, run(mx_of(experts), *batch), strict=True):
            assert torch.equal(g, w)
        del quantize_calls[before:]  # the fresh module's own calls
        return sorted(made)

    assert new_copies(lambda: run(module, *batch)) == sorted([gate_up, down])  # the first micro-batch
    assert new_copies(lambda: run(module, *batch)) == []  # the second: the same copies

    class Checkpointed(_Reference):
        def forward(self, *args):
            return checkpoint(self.inner, *args, use_reentrant=False)

    assert new_copies(lambda: run(Checkpointed(module), *batch)) == []  # recompute in backward: the same copies

    with torch.no_grad():
        experts.gate_up_proj.add_(1)  # an in-place update bumps _version
    assert new_copies(lambda: run(module, *batch)) == [gate_up]
    versions.bump(experts.down_proj)  # a write that bypasses _version, announced
    assert new_copies(lambda: run(module, *batch)) == [down]

    run(module, *batch)  # gradients for the optimizer
    optimizer = torch.optim.AdamW(experts.parameters(), lr=0.1, fused=True)
    version = experts.gate_up_proj._version
    optimizer.step()
    assert experts.gate_up_proj._version == version  # fused AdamW writes without bumping _version ...
    assert new_copies(lambda: run(module, *batch)) == sorted([gate_up, down])  # ... and still gets new copies


def test_without_save_weight_copy_every_forward_quantizes_anew(quantize_calls):
    module = mx_of(make_experts(torch.bfloat16), save_weight_copy=False)
    batch = make_batch(dtype=torch.bfloat16)
    run(module, *batch)
    run(module, *batch)
    assert len(quantize_calls) == 4  # both weights, both micro-batches (backward re-quantizes W itself)

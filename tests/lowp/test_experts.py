"""MXGroupedExperts: the same Parameters as the module it replaces, MX products that are exact,
and numerics and saved memory measured against the high-precision GroupedExperts.

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

from hyperparallel import mx
from hyperparallel.errors import ShapeError
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.experts import MXGroupedExperts, _MXGroupedLinear, _Recipe
from hyperparallel.models import GroupedExperts

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


def mx_of(experts, backend=None, **config):
    return MXGroupedExperts.from_experts(experts, LowPrecisionConfig(**config), backend=backend)


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


# -- parameters --


def test_from_grouped_experts_adopts_the_same_parameters():
    experts = make_experts()
    converted = mx_of(experts)
    assert converted.gate_up_proj is experts.gate_up_proj
    assert converted.down_proj is experts.down_proj
    assert converted.act_fn is experts.act_fn
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in experts.named_parameters()]
    assert converted.state_dict().keys() == experts.state_dict().keys()
    assert (converted.num_experts, converted.hidden_dim, converted.intermediate_dim) == (E, H, INTER)


def test_from_transformers_experts_adopts_the_same_parameters_and_matches_grouped_experts():
    config = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        experts_implementation="eager",
    )
    hf = Qwen3MoeExperts(config)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for p in hf.parameters():
            nn.init.normal_(p, std=0.05)
    converted = mx_of(hf)
    assert converted.gate_up_proj is hf.gate_up_proj and converted.down_proj is hf.down_proj
    assert converted.act_fn is hf.act_fn
    assert dict(converted.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    # the same computation whether the Parameters came from transformers or from GroupedExperts
    via_grouped = mx_of(GroupedExperts.from_hf(hf))
    batch = make_batch()
    for got, want in zip(run(converted, *batch), run(via_grouped, *batch), strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert sqnr(hf(*batch), converted(*batch)) > 20


def test_from_experts_works_on_the_meta_device():
    with torch.device("meta"):
        experts = GroupedExperts(E, H, INTER, nn.SiLU())
    converted = mx_of(experts)
    assert converted.gate_up_proj is experts.gate_up_proj and converted.gate_up_proj.is_meta


def test_from_experts_rejects_a_layout_it_cannot_run():
    experts = make_experts()
    experts.down_proj = nn.Parameter(torch.zeros(E, H, INTER + 32))
    with pytest.raises(ShapeError, match="down_proj"):
        mx_of(experts)
    experts = make_experts()
    experts.has_bias = True
    with pytest.raises(ShapeError, match="has_bias"):
        mx_of(experts)


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
    y = _MXGroupedLinear.apply(x, w, offsets, recipe, True)
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
    y = _MXGroupedLinear.apply(x, w, offsets, _Recipe("rceil", "mxfp8", "columnwise", True, None), True)
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
    """An input kept as its FP8 grouped column-wise copy: a byte an element, plus rows // 32 + E
    rows of scale bytes."""
    return rows * width + (rows // 32 + E) * width


def test_saved_bytes_against_bf16_grouped_experts():
    experts = make_experts(torch.bfloat16)
    x, top_k_index, weights = make_batch(tokens=200, dtype=torch.bfloat16)
    hp_act, hp_weights = saved_bytes(experts, x, top_k_index, weights)
    mx_act, mx_weights = saved_bytes(mx_of(experts), x, top_k_index, weights)
    no_copy = MXGroupedExperts.from_experts(experts, LowPrecisionConfig(), save_weight_copy=False)
    no_copy_act, no_copy_weights = saved_bytes(no_copy, x, top_k_index, weights)
    weight_bytes = 2 * (E * 2 * INTER * H + E * H * INTER)
    print(
        f"saved activation bytes: GroupedExperts {hp_act}, MXGroupedExperts {mx_act}, ratio {mx_act / hp_act:.3f}; "
        f"MX weight copies {mx_weights} ({mx_weights / weight_bytes:.3f} of the bf16 weights)"
    )
    # MX keeps gate_up's input as its FP8 column-wise copy and gate_up's output in bf16 (the gated
    # activation and the down projection's input are rebuilt from it), then only small things:
    # routing weights, indices, offsets (no index_add source)
    rows = top_k_index.numel()
    big = input_copy_bytes(rows) + rows * 2 * INTER * 2
    assert big <= mx_act <= big + rows * (weights.element_size() + 8) + 1024
    assert mx_act < 0.5 * hp_act
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
    assert trainable_bytes[0] - frozen_bytes[0] == input_copy_bytes(batch[1].numel())
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
        MXGroupedExperts.from_experts(experts, LowPrecisionConfig(), save_weight_copy=False),
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
    (dw,) = torch.autograd.grad(_MXGroupedLinear.apply(x.half(), w, offsets, recipe, True), (w,), dy.half())
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

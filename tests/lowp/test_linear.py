"""MXLinear: the products it runs, their numerics, what it keeps for backward, and where it works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperparallel import mx
from hyperparallel.lowp import LowPrecisionConfig, MXLinear
from hyperparallel.lowp.memory import saved_activation_bytes

E4M3 = torch.float8_e4m3fn


def pair(in_f=128, out_f=96, bias=True, dtype=torch.bfloat16, seed=0, **cfg):
    torch.manual_seed(seed)
    linear = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    reference = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    reference.load_state_dict(linear.state_dict())
    return MXLinear.from_linear(linear, LowPrecisionConfig(enabled=True, **cfg)), reference


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())).item()


def run(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad if module.bias is not None else None


def test_the_three_products_are_blocked_along_their_sums_exactly():
    # Every product recomputed by hand with the reference backend: same bytes in, same results out.
    module, _ = pair(bias=True)
    x = torch.randn(70, 128, dtype=torch.bfloat16)
    dy = torch.randn(70, 96, dtype=torch.bfloat16)
    y, dx, dw, db = run(module, x, dy)
    w, b = module.weight.detach(), module.bias.detach()
    ref = dict(backend="reference")
    y_ref = (mx.mx_mm(mx.quantize(x, 1, **ref), mx.quantize(w, 1, **ref).t(), torch.float32, **ref) + b.float())
    dx_ref = mx.mx_mm(mx.quantize(dy, 1, **ref), mx.quantize(w, 0, **ref), torch.bfloat16, **ref)
    dw_ref = mx.mx_mm(mx.quantize(dy, 0, **ref).t(), mx.quantize(x, 0, **ref), torch.float32, **ref)
    assert torch.equal(y, y_ref.to(torch.bfloat16))
    assert torch.equal(dx, dx_ref)
    assert torch.equal(dw, dw_ref.to(torch.bfloat16))
    assert torch.equal(db, dy.float().sum(0).to(torch.bfloat16))
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == module.weight.dtype


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sqnr_against_the_bf16_module(seed):
    module, reference = pair(256, 192, seed=seed)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16)
    dy = torch.randn(4, 64, 192, dtype=torch.bfloat16)
    got, want = run(module, x, dy), run(reference, x, dy)
    assert sqnr(want[0], got[0]) >= 25  # output
    assert sqnr(want[1], got[1]) >= 23  # input grad
    assert sqnr(want[2], got[2]) >= 22  # weight grad


@pytest.mark.parametrize("variant", [dict(wgrad="high_precision"), dict(save_input="original"),
                                     dict(scale_mode="floor")])
def test_variants_stay_close(variant):
    module, reference = pair(**variant)
    x = torch.randn(50, 128, dtype=torch.bfloat16)
    dy = torch.randn(50, 96, dtype=torch.bfloat16)
    got, want = run(module, x, dy), run(reference, x, dy)
    assert min(sqnr(want[i], got[i]) for i in range(3)) >= 22


def saved_bytes(module, x) -> int:
    return saved_activation_bytes(lambda: module(x))


def test_forward_keeps_about_half_the_bytes_of_bf16():
    module, reference = pair(256, 256, bias=False)
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    ratio = saved_bytes(module, x) / saved_bytes(reference, x)
    assert ratio <= 0.55, ratio


def test_a_frozen_weight_keeps_no_input_copy():
    module, _ = pair(bias=False)
    x = torch.randn(64, 128, dtype=torch.bfloat16, requires_grad=True)
    trainable = saved_bytes(module, x)
    module.weight.requires_grad_(False)
    frozen = saved_bytes(module, x)
    assert frozen < trainable
    module(x).sum().backward()
    assert module.weight.grad is None and x.grad is not None


def test_weight_copies_are_made_once_per_weight_version(monkeypatch):
    module, _ = pair()
    calls = []
    real = mx.quantize_dual

    def counting(t, **kw):
        calls.append(tuple(t.shape))
        return real(t, **kw)

    monkeypatch.setattr(mx, "quantize_dual", counting)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    for _ in range(3):  # three micro-batches
        module(x).sum().backward()
    assert calls.count((96, 128)) == 1
    with torch.no_grad():
        module.weight.add_(0.01)  # an in-place update
    module(x).sum().backward()
    assert calls.count((96, 128)) == 2
    fused = torch.optim.AdamW(module.parameters(), lr=0.1, fused=True)  # writes without bumping _version
    version = module.weight._version
    fused.step()
    assert module.weight._version == version
    module(x).sum().backward()
    assert calls.count((96, 128)) == 3


def test_three_d_and_non_contiguous_inputs():
    module, reference = pair()
    x = torch.randn(3, 128, 40, dtype=torch.bfloat16).transpose(1, 2)  # [3, 40, 128], not contiguous
    dy = torch.randn(3, 40, 96, dtype=torch.bfloat16)
    got, want = run(module, x, dy), run(reference, x, dy)
    assert got[0].shape == (3, 40, 96) and got[1].shape == x.shape
    assert sqnr(want[0], got[0]) >= 25 and sqnr(want[1], got[1]) >= 23


def test_recompute_gives_the_same_gradients():
    module, _ = pair()
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    dy = torch.randn(40, 96, dtype=torch.bfloat16)
    plain = run(module, x, dy)
    module.weight.grad = module.bias.grad = None
    xr = x.clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(module, xr, use_reentrant=False).backward(dy)
    assert torch.equal(xr.grad, plain[1]) and torch.equal(module.weight.grad, plain[2])


def test_fp32_weights_get_fp32_grads():
    module, reference = pair(dtype=torch.float32)
    x = torch.randn(30, 128)
    dy = torch.randn(30, 96)
    got, want = run(module, x, dy), run(reference, x, dy)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    assert sqnr(want[2], got[2]) >= 22


def test_torch_compile_traces_forward_and_backward_without_graph_breaks():
    module, _ = pair(bias=True)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    eager = run(module, x, torch.ones(64, 96, dtype=torch.bfloat16))
    module.weight.grad = module.bias.grad = None
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    got = run(compiled, x, torch.ones(64, 96, dtype=torch.bfloat16))
    for a, b in zip(eager, got, strict=True):
        assert torch.equal(a, b)

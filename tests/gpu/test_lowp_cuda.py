"""MXFP8 modules on a CUDA GPU against the same modules on the CPU: MXLinear and GroupedExperts
with the MXFP8 recipe, bf16, forward and backward, on the same weights and inputs.

Both sides quantize the same values to the same bytes (tests/gpu/test_mx_cuda.py); the products
then accumulate in fp32 in another order (cuBLAS, or the forced Triton GEMM, against oneDNN), and each
bf16 rounding after that can move a value by an ulp, which the next quantization can turn into a
different FP8 code: so the outputs and gradients agree to about bf16's precision, in norm.

Run by scripts/gpu_check.sh on a lent GPU (docs/gpu.md); skipped without one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyperparallel.lowp import LowPrecisionConfig, MXLinear, convert
from hyperparallel.moe import GroupedExperts
from hyperparallel.mx import gemm_path
from tests.gpu.helpers import CUDA, assert_near, leaf_like, requires_cuda

pytestmark = requires_cuda

CPU = torch.device("cpu")
OUT_REL = 1e-2  # bf16: 2^-8 relative per rounding, a few roundings deep
GRAD_REL = 2e-2


def run(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor, *args):
    """Output, input grad and every parameter's grad of one forward + backward."""
    x = leaf_like(x, next(module.parameters()).device)
    out = module(x, *(a.to(x.device) for a in args))
    out.backward(cotangent.to(x.device))
    return out, x.grad, [p.grad for p in module.parameters()]


def compare(got, want, what: str) -> None:
    out, dx, dws = got
    rout, rdx, rdws = want
    assert out.device.type == CUDA.type
    assert_near(out, rout, OUT_REL, f"{what} output")
    assert_near(dx, rdx, GRAD_REL, f"{what} input grad")
    for k, (dw, rdw) in enumerate(zip(dws, rdws, strict=True)):
        assert_near(dw, rdw, GRAD_REL, f"{what} weight grad {k}")


@pytest.mark.parametrize("gemm", [None, "triton"], ids=["automatic", "triton"])
@pytest.mark.parametrize("wgrad", ["mxfp8", "high_precision"])
@pytest.mark.parametrize("tokens,features", [(256, (512, 384)), (4096, (2048, 2048)), (100, (96, 72))])
def test_mx_linear_cuda_matches_cpu(tokens, features, wgrad, gemm, monkeypatch):
    # automatic: the device's path (Hopper: dequantize); triton: the forced Triton GEMM on all
    # three of MXLinear's products (the CPU side dequantizes either way)
    fan_in, fan_out = features
    torch.manual_seed(0)
    base = nn.Linear(fan_in, fan_out, bias=True).to(torch.bfloat16)
    config = LowPrecisionConfig(enabled=True, wgrad=wgrad)
    results = []
    for device in (CUDA, CPU):
        linear = nn.Linear(fan_in, fan_out, bias=True, device=device, dtype=torch.bfloat16)
        linear.load_state_dict(base.state_dict())
        model = nn.Sequential(linear)
        convert(model, config)
        assert isinstance(model[0], MXLinear)
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, fan_in, generator=g).to(torch.bfloat16)
        cot = torch.randn(tokens, fan_out, generator=g).to(torch.bfloat16)
        if gemm is not None and device == CUDA:
            monkeypatch.setenv(gemm_path.ENV, gemm)
        else:
            monkeypatch.delenv(gemm_path.ENV, raising=False)
        results.append(run(model, x, cot))
    compare(results[0], results[1], "MXLinear")


def experts_on(device, base: GroupedExperts, enabled: bool) -> nn.Module:
    wrapper = nn.Module()
    wrapper.experts = GroupedExperts(base.num_experts, base.hidden_dim, base.intermediate_dim, nn.SiLU(),
                                     device=device, dtype=torch.bfloat16)
    wrapper.experts.load_state_dict(base.state_dict())
    convert(wrapper, LowPrecisionConfig(enabled=enabled))
    return wrapper.experts


@pytest.mark.parametrize("enabled", [True, False], ids=["mxfp8", "bf16"])
@pytest.mark.parametrize("tokens,hidden,intermediate,experts,top_k",
                         [(64, 64, 96, 4, 2), (1024, 512, 768, 8, 2), (4096, 2048, 1024, 16, 4)])
def test_grouped_experts_cuda_matches_cpu(tokens, hidden, intermediate, experts, top_k, enabled):
    torch.manual_seed(0)
    base = GroupedExperts(experts, hidden, intermediate, nn.SiLU(), dtype=torch.bfloat16)
    base.reset_parameters(0.02)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    weights, index = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(torch.bfloat16)
    cot = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    got = run(experts_on(CUDA, base, enabled), x, cot, index, weights)
    want = run(experts_on(CPU, base, enabled), x, cot, index, weights)
    compare(got, want, "GroupedExperts " + ("mxfp8" if enabled else "bf16"))

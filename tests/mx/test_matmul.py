"""MX matmuls against the float64 product of the dequantized operands."""

from __future__ import annotations

import pytest
import torch

from hyperparallel import mx
from hyperparallel.errors import ShapeError
from hyperparallel.mx.matmul import operand_dtype

BACKENDS = ["cpu", "reference"]


def assert_fp32_accumulation_accurate(out, a64, b64):
    """|out - a@b| within fp32 accumulation error plus one rounding to out's dtype."""
    exact = a64 @ b64
    bound = a64.abs() @ b64.abs()
    k = a64.shape[-1]
    out_eps = torch.finfo(out.dtype).eps
    tol = k * torch.finfo(torch.float32).eps * bound + out_eps * exact.abs() + 1e-30
    err = (out.double() - exact).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item()}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 96, 40), (33, 70, 5), (1, 32, 1), (0, 64, 8)])
def test_mx_mm(backend, out_dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = mx.quantize(torch.randn(m, k, generator=g).bfloat16(), 1)
    b = mx.quantize(torch.randn(k, n, generator=g).bfloat16(), 0, elem_dtype=torch.float8_e5m2)
    out = mx.mx_mm(a, b, out_dtype, backend=backend)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_fp32_accumulation_accurate(out, a.dequantize(torch.float64), b.dequantize(torch.float64))


def test_operand_dtype_follows_the_output_dtype_alone():
    assert operand_dtype(torch.bfloat16) == torch.bfloat16
    assert operand_dtype(torch.float16) == torch.float16
    assert operand_dtype(torch.float32) == torch.float32
    assert operand_dtype(torch.bfloat16, "reference") == torch.float64


def test_fp32_products_are_exact_at_both_ends_of_e8m0():
    # Block scales near both ends of E8M0 (2^-127, 2^119): every MX value is an fp32 number.
    x = torch.randn(8, 64) * 2.0**120
    x[:, 0] = 1.5 * 2.0**127
    for a in (mx.quantize(x, 1), mx.quantize(torch.randn(16, 64) * 2.0**-120, 1)):
        b = mx.quantize(torch.randn(64, 4) * 2.0**-125, 0)
        assert torch.equal(a.dequantize(torch.float32).double(), a.dequantize(torch.float64))
        out = mx.mx_mm(a, b, torch.float32)
        assert_fp32_accumulation_accurate(out, a.dequantize(torch.float64), b.dequantize(torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_forward_form(backend):
    g = torch.Generator().manual_seed(1)
    offsets = torch.tensor([5, 5, 40, 77])
    x = torch.randn(77, 64, generator=g)
    w = torch.randn(4, 64, 24, generator=g)
    a, b = mx.quantize(x, 1), mx.quantize(w, 1)
    out = mx.mx_grouped_mm(a, b, offsets, torch.float32, backend=backend)
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        assert_fp32_accumulation_accurate(out[start:end], a64[start:end], b64[e])
        start = end


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_weight_grad_form(backend):
    g = torch.Generator().manual_seed(2)
    offsets = torch.tensor([0, 33, 34, 70])
    x = torch.randn(70, 48, generator=g)  # tokens sorted by expert
    dy = torch.randn(70, 16, generator=g)
    a = mx.quantize_grouped(x, offsets).t()  # [K, M] blocked along the grouped M
    b = mx.quantize_grouped(dy, offsets)  # [M, N]
    out = mx.mx_grouped_mm(a, b, offsets, torch.float32, backend=backend)
    assert out.shape == (4, 48, 16)
    assert bool((out[0] == 0).all())  # the empty expert gets a zero gradient
    a64, b64 = a.dequantize(torch.float64), b.dequantize(torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        assert_fp32_accumulation_accurate(out[e], a64[:, start:end], b64[start:end])
        start = end


def test_wrong_axis_is_refused():
    a = mx.quantize(torch.randn(8, 32), 0)  # blocked along M, not K
    b = mx.quantize(torch.randn(32, 8), 0)
    with pytest.raises(ShapeError, match="a is blocked along axis 0"):
        mx.mx_mm(a, b)
    with pytest.raises(ShapeError, match="a.shape\\[1\\] must equal b.shape\\[0\\]"):
        mx.mx_mm(mx.quantize(torch.randn(8, 32), 1), mx.quantize(torch.randn(64, 8), 0))
    with pytest.raises(ShapeError, match="must be an MXTensor"):
        mx.mx_mm(torch.randn(8, 32), b)


def test_grouped_mm_refuses_mismatched_groups():
    x = torch.randn(40, 32)
    offsets = torch.tensor([10, 40])
    a = mx.quantize_grouped(x, offsets).t()
    b = mx.quantize_grouped(torch.randn(40, 8), torch.tensor([20, 40]))
    with pytest.raises(ShapeError, match="b must be quantized with quantize_grouped and these offsets"):
        mx.mx_grouped_mm(a, b, offsets)
    with pytest.raises(ShapeError, match="3 offsets for 2 experts"):
        mx.mx_grouped_mm(mx.quantize(x, 1), mx.quantize(torch.randn(2, 32, 8), 1), torch.tensor([10, 20, 40]))


def test_nan_block_poisons_only_its_outputs():
    x = torch.randn(4, 64)
    x[1, 40] = float("nan")  # row 1, second block along K
    a = mx.quantize(x, 1)
    b = mx.quantize(torch.randn(64, 8), 0)
    out = mx.mx_mm(a, b, torch.float32)
    assert bool(out[1].isnan().all())
    finite_rows = torch.tensor([0, 2, 3])
    a64, b64 = a.dequantize(torch.float64)[finite_rows], b.dequantize(torch.float64)
    assert_fp32_accumulation_accurate(out[finite_rows], a64, b64)


def test_bf16_operands_round_only_below_bf16s_subnormals():
    # [Note: MX values in the compute dtype]: a block whose values sit below bf16's normal range
    # dequantizes to bf16 subnormals, each within half of bf16's smallest subnormal (2^-133) of
    # its exact value; every other block is exact.
    x = torch.randn(16, 128)
    # one block of tiny values: its scale clamps to E8M0's smallest, 2^-127, and its E4M3
    # subnormal elements go down to 2^-136 (here 3 * 2^-136), below bf16's 2^-133
    x[3, 32:64] = torch.linspace(-1, 1, 32) * 2.0**-121
    x[3, 33] = 3 * 2.0**-136
    a = mx.quantize(x, 1)
    exact, in_bf16 = a.dequantize(torch.float64), a.dequantize(torch.bfloat16).double()
    err = (in_bf16 - exact).abs()
    assert float(err.max()) <= 2.0**-134 and float(err.max()) > 0  # the corner is real, and bounded
    err[3, 32:64] = 0
    assert float(err.max()) == 0
    b = mx.quantize(torch.randn(128, 8), 0)
    rows = torch.tensor([0, 1, 2, 4])  # rows without the tiny block: bf16 products exact to fp32 accumulation
    out = mx.mx_mm(a, b, torch.bfloat16)
    assert_fp32_accumulation_accurate(out[rows], exact[rows], b.dequantize(torch.float64))


def test_bias_joins_the_accumulator():
    g = torch.Generator().manual_seed(3)
    a = mx.quantize(torch.randn(8, 64, generator=g).bfloat16(), 1)
    b = mx.quantize(torch.randn(64, 16, generator=g).bfloat16(), 0)
    bias = torch.randn(16, generator=g).bfloat16()
    out = mx.mx_mm(a, b, torch.bfloat16, bias=bias)
    expected = torch.addmm(bias, a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16))
    assert torch.equal(out, expected)
    with pytest.raises(ShapeError, match="bias must be \\[16\\]"):
        mx.mx_mm(a, b, bias=torch.zeros(8))

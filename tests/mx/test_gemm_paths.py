"""The GEMM paths of MX products: cuBLAS's scale layout, the choice by compute capability, and the
Triton kernel (run by Triton's interpreter on CPU tensors).

The interpreter multiplies the decoded tiles in fp32 (its numpy has no bf16: see
`triton_mm.bf16_operands`), so the kernel's bf16 `tl.dot` branch runs only on a GPU
(tests/gpu/, scripts/gpu_check.sh); the decode, the masks and the accumulation are checked here."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

with imports():
    import torch

    from hyperparallel import mx
    from hyperparallel.errors import BackendError
    from hyperparallel.mx import gemm_path
    from hyperparallel.mx.backends import triton_mm
    from hyperparallel.mx.blocked_scales import to_blocked, to_blocked_reference
    from tests.mx.test_matmul import assert_fp32_accumulation_accurate

SMALL_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (256, 8), (33, 12), (300, 3)])
def test_the_scale_layout_is_cublas_tiles(shape):
    scale = torch.randint(0, 255, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(shape[0]))
    blocked = to_blocked(scale.view(torch.float8_e8m0fnu))
    assert blocked.dtype == torch.float8_e8m0fnu
    assert torch.equal(blocked.view(torch.uint8), to_blocked_reference(scale))
    rows, cols = -(-shape[0] // 128) * 128, -(-shape[1] // 4) * 4
    assert blocked.numel() == rows * cols  # padded to whole 128 x 4 tiles
    if shape[0] > 32:  # row 1 of a tile sits 16 bytes in, row 32 right after row 0's 4 columns
        assert int(blocked.view(torch.uint8)[16]) == int(scale[1, 0])
        assert int(blocked.view(torch.uint8)[4]) == int(scale[32, 0])


def mx_operands(m, k, n, device="cpu"):
    g = torch.Generator().manual_seed(m + k + n)
    a = mx.quantize(torch.randn(m, k, generator=g).bfloat16().to(device), 1)
    b = mx.quantize(torch.randn(n, k, generator=g).bfloat16().to(device), 1).t()  # a weight's row-wise copy, as MXLinear's
    return a, b


@pytest.fixture
def capability(monkeypatch):
    """Pretend a CUDA device of the given capability (the operands stay CPU tensors: only the
    choice is tested, so the device they report is patched too)."""
    def pretend(major_minor):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: major_minor)
        monkeypatch.setattr(gemm_path, "_capability", lambda device: major_minor)
        monkeypatch.setattr("hyperparallel.kernels.triton_support.unavailable_reason", lambda device: None)
    return pretend


@pytest.mark.parametrize("major_minor, expected", [((10, 0), "scaled_mm"), ((12, 0), "scaled_mm"), ((9, 0), "dequantize"),
                                                   ((8, 0), "dequantize")])
def test_the_path_follows_the_compute_capability(capability, major_minor, expected):
    capability(major_minor)
    a, b = mx_operands(64, 128, 32)
    path, why = gemm_path.plan(a, b, torch.bfloat16)
    assert path == expected, why


def test_hopper_takes_the_triton_gemm_only_when_forced(capability, monkeypatch):
    # see gemm_path's [Note: the automatic path on Hopper]
    capability((9, 0))
    a, b = mx_operands(64, 128, 32)
    assert gemm_path.plan(a, b, torch.bfloat16) == (
        "dequantize", "compute capability 9.0: no MX tensor cores (the fastest exact path here, docs/mx.md)")
    assert gemm_path.plan(a, b, torch.bfloat16, forced="triton") == ("triton", "forced")
    capability((8, 0))
    with pytest.raises(BackendError, match=r"HYPERPARALLEL_MX_GEMM=triton: the triton GEMM needs FP8 conversions "
                                           r"\(compute capability 8.9\+\); this is 8.0"):
        gemm_path.plan(a, b, torch.bfloat16, forced="triton")


def test_the_cpu_and_the_reference_backend_dequantize():
    a, b = mx_operands(64, 128, 32)
    assert gemm_path.plan(a, b, torch.bfloat16)[0] == "dequantize"
    assert gemm_path.plan(a, b, torch.bfloat16, backend="reference") == ("dequantize", "the reference backend: fp64 products")


def test_blackwell_falls_back_with_the_reason_when_a_product_does_not_fit(capability):
    capability((10, 0))
    a, b = mx_operands(64, 100, 32)  # K not a multiple of 32
    assert gemm_path.plan(a, b, torch.bfloat16) == (
        "dequantize", "scaled_mm needs K a multiple of 32 and M, N multiples of 16; this is 64x100x32")
    a, b = mx_operands(64, 128, 32)
    path, why = gemm_path.plan(a, b, torch.float32)
    assert path == "dequantize" and why == "scaled_mm writes bf16 here, not torch.float32"


def test_a_forced_path_runs_or_says_why_not(monkeypatch):
    a, b = mx_operands(64, 128, 32)
    monkeypatch.setenv(gemm_path.ENV, "scaled_mm")
    with pytest.raises(BackendError, match="HYPERPARALLEL_MX_GEMM=scaled_mm: scaled_mm needs MX tensor cores .* this is a cpu tensor"):
        mx.mx_mm(a, b)
    monkeypatch.setenv(gemm_path.ENV, "tensor_cores")
    with pytest.raises(BackendError, match="'tensor_cores' is no MX GEMM path; choose one of"):
        mx.mx_mm(a, b)
    monkeypatch.setenv(gemm_path.ENV, "dequantize")
    assert gemm_path.plan(a, b, torch.bfloat16) == ("dequantize", "forced")


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(40, 96, 24), (33, 70, 17)])
def test_the_triton_gemm_is_the_mx_product(out_dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g)
    x[0, :32] *= 2.0**-100  # a block of small scale
    a = mx.quantize(x, 1)
    b = mx.quantize(torch.randn(k, n, generator=g), 0, elem_dtype=torch.float8_e5m2)
    bias = torch.randn(n, generator=g)
    out = triton_mm.mx_mm(a, b, out_dtype, bias, tile=SMALL_TILE)
    assert out.dtype == out_dtype and out.shape == (m, n)
    # the bias as one more term of the sum: a row of b against a column of ones
    a64 = torch.cat([a.dequantize(torch.float64), torch.ones(m, 1, dtype=torch.float64)], 1)
    b64 = torch.cat([b.dequantize(torch.float64), bias.double()[None]], 0)
    assert_fp32_accumulation_accurate(out, a64, b64)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("block_k", [64, 128])  # two and four MX blocks a tile, the last ones partly past K
@pytest.mark.parametrize("layout", ["forward", "grads"])
@pytest.mark.parametrize("k", [70, 200])
def test_the_triton_gemm_on_wider_tiles_and_both_layouts(block_k, layout, k):
    # forward: a row-major, b K-contiguous (a weight's [N, K] copy transposed); grads: a a
    # transposed view of a copy blocked down its rows, b N-contiguous (MXLinear's dgrad / wgrad)
    m, n = 37, 29
    g = torch.Generator().manual_seed(k + block_k)
    x, w = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    if layout == "forward":
        a, b = mx.quantize(x, 1), mx.quantize(w.t().contiguous(), 1, elem_dtype=torch.float8_e5m2).t()
    else:
        a, b = mx.quantize(x.t().contiguous(), 0).t(), mx.quantize(w, 0, elem_dtype=torch.float8_e5m2)
    tile = dict(SMALL_TILE, BLOCK_K=block_k)
    out = triton_mm.mx_mm(a, b, torch.float32, tile=tile)
    assert_fp32_accumulation_accurate(out, a.dequantize(torch.float64), b.dequantize(torch.float64))


def test_the_triton_gemm_takes_whole_mx_blocks_along_k():
    a, b = mx_operands(32, 64, 32)
    with pytest.raises(ValueError, match="BLOCK_K must be whole MX blocks \\(a multiple of 32\\), not 48"):
        triton_mm.mx_mm(a, b, torch.float32, tile=dict(SMALL_TILE, BLOCK_K=48))


@pytest.mark.usefixtures("triton_interpreter")
def test_forcing_triton_runs_mx_mm_through_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_mm, "TILE", SMALL_TILE)
    monkeypatch.setattr(triton_mm, "mx_mm", lambda *args: calls.append(args) or torch.zeros(40, 24))
    monkeypatch.setenv(gemm_path.ENV, "triton")
    a, b = mx_operands(40, 64, 24)
    mx.mx_mm(a, b)
    assert len(calls) == 1


@pytest.mark.usefixtures("triton_interpreter")
def test_nan_blocks_and_the_smallest_scale_decode_exactly():
    x = torch.randn(32, 64)
    x[3, 5] = float("nan")
    x[7, 32:] = torch.linspace(-1, 1, 32) * 2.0**-121  # scale byte 0 (2^-127), E4M3 subnormals
    a = mx.quantize(x, 1)
    b = mx.quantize(torch.eye(64), 0)
    out = triton_mm.mx_mm(a, b, torch.float32, tile=SMALL_TILE)  # a @ I: a's values themselves
    expected = a.dequantize(torch.float32)
    assert out[3].isnan().all()  # NaN x 0 is NaN: the NaN block's row, as in any product
    others = torch.arange(32) != 3
    assert torch.equal(out[others], expected[others])



@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("elem_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_every_fp8_code_decodes_as_torch_does(elem_dtype):
    # each of the 256 codes alone in its row (E5M2's infinities 0x7C / 0xFC and its NaNs among them),
    # times a b whose first row is ones: each output is the code's value times 1, plus zeros
    data = torch.zeros(256, 32, dtype=torch.uint8)
    data[:, 0] = torch.arange(256, dtype=torch.uint8)
    scale = torch.full((256, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^0
    a = mx.MXTensor(data.view(elem_dtype), scale, 1)
    ones_row = torch.zeros(32, 8)
    ones_row[0] = 1
    out = triton_mm.mx_mm(a, mx.quantize(ones_row, 0), torch.float32, tile=SMALL_TILE)
    expected = data[:, :1].view(elem_dtype).float().expand(256, 8)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] scale bytes back from cuBLAS's tiled layout (to_blocked undone by the
    index formula of to_blocked_reference)."""
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    r = torch.arange(padded_rows)[:, None]
    c = torch.arange(padded_cols)[None, :]
    tile = (r // 128) * (padded_cols // 4) + c // 4
    index = tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return blocked.view(torch.uint8)[index][:rows, :cols]


def cublas_mx_product(a, b, scale_a, scale_b, out_dtype):
    """What torch._scaled_mm computes with MX block scales, from the operands as cuBLAS reads them:
    a [M, K] row-major, b [K, N] column-major, each operand's scales [rows, K/32] tiled."""
    assert a.is_contiguous() and b.t().is_contiguous(), "cuBLAS takes a row-major and b column-major"
    (m, k), n = a.shape, b.shape[1]
    assert scale_a.numel() == -(-m // 128) * 128 * -(-(k // 32) // 4) * 4  # whole tiles
    assert scale_b.numel() == -(-n // 128) * 128 * -(-(k // 32) // 4) * 4
    powers_a = torch.exp2(from_blocked(scale_a, m, k // 32).double() - 127).repeat_interleave(32, 1)
    powers_b = torch.exp2(from_blocked(scale_b, n, k // 32).double() - 127).repeat_interleave(32, 1)
    return ((a.double() * powers_a) @ (b.t().double() * powers_b).t()).to(out_dtype)


def test_the_scale_layout_undone_gives_the_scales_back():
    scale = torch.randint(0, 255, (300, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(from_blocked(to_blocked(scale), 300, 7), scale)


def test_every_mxlinear_product_on_blackwell_equals_the_dequantize_path(capability, monkeypatch):
    # forward, input grad and weight grad: three products of three operand layouts, each given to
    # torch._scaled_mm (here its arithmetic, from the bytes and tiled scales it is handed) as
    # cuBLAS takes them; the results equal the dequantize path's on the CPU
    from hyperparallel.lowp import LowPrecisionConfig, MXLinear

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 160, bias=False).bfloat16()
    x = torch.randn(96, 64, generator=g).bfloat16()
    dy = torch.randn(96, 160, generator=g).bfloat16()

    def run():
        layer = MXLinear.from_linear(linear, LowPrecisionConfig())
        layer.weight.grad = None
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        return y, xi.grad, layer.weight.grad

    expected = run()  # the CPU: the dequantize path
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, out_dtype: calls.append(args[0].shape) or
                        cublas_mx_product(*args, out_dtype))
    capability((10, 0))
    got = run()
    assert calls == [(96, 64), (96, 160), (160, 96)]  # forward [M, K], input grad, weight grad (dy.t())
    for g_, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g_, e, rtol=2**-7, atol=0)  # measured: equal (one bf16 ulp for another CPU's order)

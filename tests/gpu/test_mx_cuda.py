"""MX quantization and products on a CUDA GPU: the Triton backend on CUDA tensors, byte for byte
against the pure-torch reference on the same inputs on the CPU; `mx_mm` on each GEMM path
(`HYPERPARALLEL_MX_GEMM`) against the reference's fp64 product, the forced Triton GEMM on every
operand layout, format and code.

Run by scripts/gpu_check.sh on a lent GPU (docs/gpu.md); skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from hyperparallel import mx
from hyperparallel.errors import BackendError
from hyperparallel.mx import gemm_path
from tests.gpu.helpers import CUDA, assert_same_bytes, assert_same_values, requires_cuda
from tests.mx.cases import random_input, special_rows

pytestmark = requires_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [(E4M3, "rceil"), (E4M3, "floor"), (E5M2, "rceil"), (E5M2, "floor")]
FORMAT_IDS = ["e4m3-rceil", "e4m3-floor", "e5m2-rceil", "e5m2-floor"]


def same_mx(got: mx.MXTensor, want: mx.MXTensor) -> None:
    assert got.device.type == CUDA.type and got.axis == want.axis
    assert_same_bytes(got.scale, want.scale, "scale")
    assert_same_bytes(got.data, want.data, "data")


def check_quantize(x: torch.Tensor, axis: int, elem, mode: str, out_dtypes=(torch.float32, torch.bfloat16)) -> None:
    got = mx.quantize(x.to(CUDA), axis, scale_mode=mode, elem_dtype=elem, backend="triton")
    want = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem, backend="reference")
    same_mx(got, want)
    for dtype in out_dtypes:
        assert_same_values(mx.dequantize(got, dtype, backend="triton"), mx.dequantize(want, dtype, backend="reference"),
                           f"dequantize to {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_quantize_corner_cases(dtype, elem, mode):
    """Zero blocks, -0, subnormals, values past the E4M3 max, NaN / Inf, bf16 max, ..."""
    x = special_rows(dtype)
    check_quantize(x, 1, elem, mode, out_dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check_quantize(x.t().contiguous(), 0, elem, mode)


@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (2, 65, 3), (100,), (1024, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3-rceil", "e5m2-floor"])
def test_quantize_random_shapes_every_axis(shape, dtype, elem, mode):
    x = random_input(shape, dtype, seed=len(shape) * 1000 + shape[0], specials=True)
    for axis in range(len(shape)):
        check_quantize(x, axis, elem, mode)


@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_quantize_every_16_bit_input(elem, mode):
    """Every bf16 and fp16 bit pattern (NaN, Inf, subnormals, -0 included), 64 to a row."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        x = patterns.view(dtype).reshape(-1, 64)
        check_quantize(x, 1, elem, mode, out_dtypes=())
        check_quantize(x.t().contiguous(), 0, elem, mode, out_dtypes=())


@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (65, 33), (97, 2), (2048, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_quantize_dual(shape, dtype, elem, mode):
    x = random_input(shape, dtype, seed=shape[0] + 17 * shape[1], specials=True)
    got = mx.quantize_dual(x.to(CUDA), scale_mode=mode, elem_dtype=elem, backend="triton")
    want = mx.quantize_dual(x, scale_mode=mode, elem_dtype=elem, backend="reference")
    for g, w in zip(got, want, strict=True):
        same_mx(g, w)


GROUP_ENDS = [
    [0, 1, 1, 32, 64, 97, 97, 128],  # empty groups (first, middle, last-but-one), sizes 1, 31, 32, 33
    [33, 33, 64, 96, 97],  # groups that start inside a block of the plain layout
    [128],
    [0, 0, 128, 128],
    [500, 1100, 1100, 2500, 4096],  # the trainer's scale: thousands of tokens over a few experts
]


@pytest.mark.parametrize("ends", GROUP_ENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elem,mode", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3-rceil", "e5m2-floor"])
def test_quantize_grouped(ends, dtype, elem, mode):
    rows = ends[-1]
    x = random_input((rows, 40 if rows < 1000 else 512), dtype, seed=rows + len(ends), specials=True)
    x[5:9, 3] = 0.0
    for index_dtype in (torch.int64, torch.int32):
        offsets = torch.tensor(ends, dtype=index_dtype)
        got = mx.quantize_grouped(x.to(CUDA), offsets.to(CUDA), scale_mode=mode, elem_dtype=elem, backend="triton")
        want = mx.quantize_grouped(x, offsets, scale_mode=mode, elem_dtype=elem, backend="reference")
        same_mx(got, want)
        for out in (torch.float32, torch.bfloat16):
            assert_same_values(mx.dequantize(got, out, backend="triton"), mx.dequantize(want, out, backend="reference"))
            # the transposed view that the weight-gradient product reads
            assert_same_values(mx.dequantize(got.t(), out, backend="triton"),
                               mx.dequantize(want.t(), out, backend="reference"))


@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_dequantize_every_code_and_scale(elem):
    """Each of the 256 codes under each of the 256 scale bytes (0xFF is NaN, byte 0 is 2**-127)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(elem)
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    want = mx.MXTensor(data, scale, 1)
    got = mx.MXTensor(data.to(CUDA), scale.to(CUDA), 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g, w = mx.dequantize(got, dtype, backend="triton"), mx.dequantize(want, dtype, backend="reference")
        assert_same_values(g, w)
        g = g.cpu()
        assert torch.equal(g.signbit() | g.isnan(), w.signbit() | w.isnan())


# ------------------------------------------------------------------------------ mx_mm, per path

MM_SHAPES = [(256, 512, 384), (100, 96, 72), (2048, 4096, 1024)]


@pytest.mark.parametrize("path", gemm_path.PATHS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", MM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mx_mm_each_gemm_path(path, out_dtype, shape, monkeypatch):
    M, K, N = shape
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(CUDA)
    w = torch.randn(K, N, generator=g).to(torch.bfloat16).to(CUDA)
    a = mx.quantize(x, 1)
    b = mx.quantize(w.t().contiguous(), 1).t()  # a row-major [N, K] transposed: what scaled_mm takes
    monkeypatch.delenv(gemm_path.ENV, raising=False)
    want = mx.mx_mm(a, b, out_dtype, backend="reference")  # fp64 products, one rounding
    monkeypatch.setenv(gemm_path.ENV, path)
    try:
        got = mx.mx_mm(a, b, out_dtype)
    except BackendError as error:
        pytest.skip(f"{path}: {error}")
    assert got.device.type == CUDA.type and got.dtype == out_dtype and got.shape == (M, N)
    # exact MX values, fp32 accumulation in another order, one rounding: a bf16 output within one
    # of its ulps (2^-7 relative at most), an fp32 one within fp32 summation error
    rtol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5
    scale = want.abs().max().item()
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rtol, atol=scale * 1e-5)


def operands(M: int, K: int, N: int, layout: str, elem_b: torch.dtype):
    """a [M, K] and b [K, N], both blocked along K, in MXLinear's layouts: "forward" (a row-major,
    b a weight's [N, K] copy transposed: K contiguous in both) or "grads" (a a transposed view of a
    copy blocked down its rows, b N-contiguous: the input- and weight-grad products')."""
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(CUDA)
    w = torch.randn(K, N, generator=g).to(torch.bfloat16).to(CUDA)
    if layout == "forward":
        return mx.quantize(x, 1), mx.quantize(w.t().contiguous(), 1, elem_dtype=elem_b).t()
    return mx.quantize(x.t().contiguous(), 0).t(), mx.quantize(w, 0, elem_dtype=elem_b)


@pytest.mark.parametrize("path", ["triton", "dequantize"])
@pytest.mark.parametrize("layout", ["forward", "grads"])
@pytest.mark.parametrize("elem_b", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(100, 70, 72), (300, 512, 384)], ids=lambda s: "x".join(map(str, s)))
def test_mx_mm_on_every_layout_and_format(path, layout, elem_b, bias, out_dtype, shape, monkeypatch):
    # the forced Triton GEMM (the hardware's FP8 conversion and bf16 tensor-core products, which the
    # interpreter does not run) on both operand layouts MXLinear hands it, K not a multiple of 32,
    # E5M2 operands and a bias; the dequantize path beside it
    M, K, N = shape
    a, b = operands(M, K, N, layout, elem_b)
    b_bias = torch.randn(N, generator=torch.Generator().manual_seed(N)).to(out_dtype).to(CUDA) if bias else None
    monkeypatch.delenv(gemm_path.ENV, raising=False)
    want = mx.mx_mm(a, b, out_dtype, bias=b_bias, backend="reference")
    monkeypatch.setenv(gemm_path.ENV, path)
    got = mx.mx_mm(a, b, out_dtype, bias=b_bias)
    assert got.device.type == CUDA.type and got.dtype == out_dtype and got.shape == (M, N)
    rtol = 2**-7 if out_dtype == torch.bfloat16 else 1e-5  # as test_mx_mm_each_gemm_path
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rtol, atol=want.abs().max().item() * 1e-5)


@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
# (scales that keep every value an fp32 normal or infinite: below that a GPU may flush, docs/mx.md;
# scale bytes 0 and 255 are bit arithmetic, the same on the interpreter, tests/mx/test_gemm_paths.py)
@pytest.mark.parametrize("scale_byte", [20, 127, 140, 254])
def test_the_triton_gemm_decodes_every_code_on_the_gpu(elem, scale_byte, monkeypatch):
    # each of the 256 codes alone in its row, times a b whose first row is ones: each output is the
    # code's value times its block's scale, as the hardware's conversion gives it (NaN and infinity
    # codes included; the interpreter's conversion ignores them, tests/mx/test_gemm_paths.py)
    data = torch.zeros(256, 32, dtype=torch.uint8)
    data[:, 0] = torch.arange(256, dtype=torch.uint8)
    scale = torch.full((256, 1), scale_byte, dtype=torch.uint8)
    a = mx.MXTensor(data.view(elem).to(CUDA), scale.view(torch.float8_e8m0fnu).to(CUDA), 1)
    ones_row = torch.zeros(32, 8)
    ones_row[0] = 1
    monkeypatch.setenv(gemm_path.ENV, "triton")
    got = mx.mx_mm(a, mx.quantize(ones_row.to(CUDA), 0), torch.float32)
    power = 2.0 ** (scale_byte - 127)
    want = (data[:, :1].view(elem).double() * power).float().expand(256, 8)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)

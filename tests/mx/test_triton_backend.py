"""The Triton kernels, byte for byte against the reference, run by the Triton interpreter on CPU
(tests/triton_interpreter.py: set before triton is imported and while these tests run).
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

with imports():
    pytest.importorskip("triton")
    import torch

    from hyperparallel.kernels import triton_support
    from hyperparallel.mx import reference
    from hyperparallel.mx.backends import triton as tb
    from tests.mx.cases import BF16_MAX, random_input, special_rows

pytestmark = pytest.mark.usefixtures("triton_interpreter")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FORMATS = [(E4M3, "rceil"), (E4M3, "floor"), (E5M2, "rceil"), (E5M2, "floor")]
FORMAT_IDS = ["e4m3-rceil", "e4m3-floor", "e5m2-rceil", "e5m2-floor"]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same(got, expected) -> None:
    """Quantized tensors (data or scale) equal in shape, dtype, layout and every byte."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert got.is_contiguous()
    assert torch.equal(u8(got), u8(expected))


def assert_same_values(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def check_quantize(x: torch.Tensor, axis: int, elem, mode: str, out_dtypes=(torch.float32, torch.bfloat16)) -> None:
    data, scale = tb.quantize(x, axis, elem, mode)
    ref_data, ref_scale = reference.quantize(x, axis, elem, mode)
    assert_same(scale, ref_scale)
    assert_same(data, ref_data)
    for dtype in out_dtypes:
        assert_same_values(tb.dequantize(data, scale, axis, None, dtype), reference.dequantize(data, scale, axis, None, dtype))


def test_unavailable_reason(monkeypatch):
    assert tb.unavailable_reason(torch.device("cpu")) is None
    assert tb.unavailable_reason(torch.device("meta"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "TRITON_INTERPRET=1" in tb.unavailable_reason(torch.device("cpu"))
    if not torch.cuda.is_available():
        assert tb.unavailable_reason(torch.device("cuda")) is not None
    monkeypatch.setattr(triton_support, "triton", None)
    assert "triton" in tb.unavailable_reason(torch.device("cuda"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_corner_cases(dtype, elem, mode):
    """Zero blocks, -0, subnormals, values at and past the E4M3 max, NaN/Inf, bf16 max, ..."""
    x = special_rows(dtype)
    for axis in (0, 1):
        x_axis = x if axis == 1 else x.t().contiguous()
        check_quantize(x_axis, axis, elem, mode, out_dtypes=(torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("shape", [(1, 1), (3, 70), (64, 96), (33, 65), (2, 3, 40), (2, 65, 3), (5, 40, 1), (100,)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_random_shapes_every_axis(shape, dtype, elem, mode):
    x = random_input(shape, dtype, seed=len(shape) * 1000 + shape[0], specials=True)
    for axis in range(len(shape)):
        check_quantize(x, axis, elem, mode)


def test_negative_axis_and_strided_input():
    x = random_input((40, 70), torch.float32, seed=5, specials=False)
    assert_same(tb.quantize(x, -1, E4M3, "rceil")[0], reference.quantize(x, 1, E4M3, "rceil")[0])
    strided = random_input((70, 40), torch.bfloat16, seed=6, specials=True).t()  # not contiguous
    check_quantize(strided, 1, E4M3, "rceil")
    check_quantize(strided, 0, E5M2, "floor")


@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_every_16_bit_input(elem, mode):
    """Every bf16 and fp16 bit pattern (NaN, Inf, subnormals, -0 included), 64 to a row."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        x = patterns.view(dtype).reshape(-1, 64)
        check_quantize(x, 1, elem, mode, out_dtypes=())
        check_quantize(x.t().contiguous(), 0, elem, mode, out_dtypes=())


@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_random_fp32_bit_patterns(elem, mode):
    """Finite fp32 inputs whose blocks span many binades, subnormal inputs and products included."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (128, 64), generator=g, dtype=torch.int64)
    low = torch.randint(0, 250, (128, 1), generator=g)
    span = torch.randint(0, 40, (128, 1), generator=g)
    exponent = (low + (torch.rand(128, 64, generator=g) * (span + 1)).long()).clamp(0, 254)
    x = ((bits & ~(0xFF << 23)) | (exponent << 23)).to(torch.int32).view(torch.float32)
    check_quantize(x, 1, elem, mode)
    check_quantize(x, 0, elem, mode)


@pytest.mark.parametrize("shape", [(0, 40), (1, 40), (40, 0), (0, 0), (1, 1), (31, 1), (1, 33), (2, 0, 3)])
def test_degenerate_shapes(shape):
    x = random_input(shape, torch.bfloat16, seed=3, specials=False)
    for axis in range(len(shape)):
        check_quantize(x, axis, E4M3, "rceil")
    if len(shape) == 2:
        for got, expected in zip(tb.quantize_dual(x, E4M3, "rceil"), reference.quantize_dual(x, E4M3, "rceil"), strict=True):
            assert_same(got, expected)


@pytest.mark.parametrize("shape", [(1, 1), (3, 70), (64, 96), (33, 65), (65, 33), (1, 160), (97, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem,mode", FORMATS, ids=FORMAT_IDS)
def test_quantize_dual(shape, dtype, elem, mode):
    x = random_input(shape, dtype, seed=shape[0] + 17 * shape[1], specials=True)
    got = tb.quantize_dual(x, elem, mode)
    for a, b in zip(got, reference.quantize_dual(x, elem, mode), strict=True):
        assert_same(a, b)


def test_quantize_dual_is_one_kernel_over_the_corner_cases(monkeypatch):
    launches = []
    launch = tb._launch
    monkeypatch.setattr(tb, "_launch", lambda kernel, *args, **kw: (launches.append(kernel), launch(kernel, *args, **kw)))
    for dtype in DTYPES:
        x = special_rows(dtype)
        for elem, mode in FORMATS:
            launches.clear()
            got = tb.quantize_dual(x, elem, mode)
            assert len(launches) == 1
            for a, b in zip(got, reference.quantize_dual(x, elem, mode), strict=True):
                assert_same(a, b)


GROUP_OFFSETS = [
    [0, 1, 1, 32, 64, 97, 97, 128],  # empty groups (first, middle, last-but-one), sizes 1, 31, 32, 33
    [33, 33, 64, 96, 97],  # groups that start inside a block of the plain layout
    [128],  # one group
    [0, 0, 128, 128],
]


@pytest.mark.parametrize("ends", GROUP_OFFSETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("elem,mode", [(E4M3, "rceil"), (E5M2, "floor")], ids=["e4m3-rceil", "e5m2-floor"])
def test_quantize_grouped(ends, dtype, elem, mode):
    rows = ends[-1]
    x = random_input((rows, 40), dtype, seed=rows + len(ends), specials=True)
    x[5:9, 3] = 0.0
    for index_dtype in (torch.int64, torch.int32):
        offsets = torch.tensor(ends, dtype=index_dtype)
        data, scale = tb.quantize_grouped(x, offsets, elem, mode)
        ref_data, ref_scale = reference.quantize_grouped(x, offsets, elem, mode)
        assert_same(scale, ref_scale)
        assert_same(data, ref_data)
        for dtype_out in (torch.float32, torch.bfloat16):
            expected = reference.dequantize(data, scale, 0, offsets, dtype_out)
            assert_same_values(tb.dequantize(data, scale, 0, offsets, dtype_out), expected)
            # the transposed view that MXTensor.t() makes
            got_t = tb.dequantize(data.t(), scale.t(), 1, offsets, dtype_out)
            assert_same_values(got_t, reference.dequantize(data.t(), scale.t(), 1, offsets, dtype_out))


def test_quantize_grouped_without_rows():
    x = torch.empty(0, 5, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 0, 0])
    data, scale = tb.quantize_grouped(x, offsets, E4M3, "rceil")
    ref_data, ref_scale = reference.quantize_grouped(x, offsets, E4M3, "rceil")
    assert_same(data, ref_data)
    assert_same(scale, ref_scale)  # every scale row unused: byte 0


@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_dequantize_every_code_and_scale(elem):
    """Each of the 256 codes under each of the 256 scale bytes (0xFF is NaN, byte 0 is 2**-127)."""
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(elem)  # row r: every code
    scale = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # float64 goes to the reference
        got = tb.dequantize(data, scale, 1, None, dtype)
        expected = reference.dequantize(data, scale, 1, None, dtype)
        assert_same_values(got, expected)
        assert torch.equal(got.signbit() | got.isnan(), expected.signbit() | expected.isnan())
    columns = tb.dequantize(data.t().contiguous(), scale.t().contiguous(), 0, None, torch.bfloat16)
    assert_same_values(columns, reference.dequantize(data.t().contiguous(), scale.t().contiguous(), 0, None, torch.bfloat16))
    view = tb.dequantize(data.t(), scale.t(), 0, None, torch.float32)  # a transposed view
    assert_same_values(view, reference.dequantize(data.t(), scale.t(), 0, None, torch.float32))


def test_bf16_max_saturates_and_round_trips():
    x = torch.full((2, 32), BF16_MAX, dtype=torch.bfloat16)
    x[1] = -BF16_MAX
    x[0, 1] = 447.0
    for elem, mode in FORMATS:
        check_quantize(x, 1, elem, mode)

"""The native CPU kernels, byte for byte against the reference, with every instruction set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyperparallel import mx
from hyperparallel.kernels import LEVELS, use_isa
from hyperparallel.mx import reference
from tests import instruction_sets
from tests.mx.cases import random_input, special_rows

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["rceil", "floor"]
ISAS = list(LEVELS)  # generic, avx2, avx512: the kernels of each level the processor has
isa = instruction_sets.isa  # the fixture: each level the processor has


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_quantization(got: mx.MXTensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    assert got.data.shape == data.shape and got.scale.shape == scale.shape
    assert got.data.dtype == data.dtype and got.scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(u8(got.scale), u8(scale)), "scales differ"
    assert torch.equal(u8(got.data), u8(data)), "elements differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
@pytest.mark.parametrize("axis", [0, 1])
def test_corner_cases(isa, dtype, mode, elem, axis):
    x = special_rows(dtype)
    x = x if axis == 1 else x.t().contiguous()
    got = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem)
    assert_same_quantization(got, *reference.quantize(x, axis, elem, mode))
    expected = reference.dequantize(got.data, got.scale, axis, None, torch.float32)
    torch.testing.assert_close(got.dequantize(torch.float32), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(0, 40), (1, 40), (40, 0), (1, 1), (31, 1), (1, 33)])
@pytest.mark.parametrize("axis", [0, 1])
def test_degenerate_shapes(isa, shape, axis):
    x = random_input(shape, torch.bfloat16, seed=3, specials=False)
    assert_same_quantization(mx.quantize(x, axis), *reference.quantize(x, axis, E4M3, "rceil"))
    if len(shape) == 2 and shape[0] and shape[1]:
        row, col = mx.quantize_dual(x)
        assert_same_quantization(row, *reference.quantize(x, 1, E4M3, "rceil"))
        assert_same_quantization(col, *reference.quantize(x, 0, E4M3, "rceil"))


shapes = st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    axis=st.integers(0, 2),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(MODES),
    elem=st.sampled_from([E4M3, E5M2]),
    seed=st.integers(0, 2**31 - 1),
    specials=st.booleans(),
    level=st.sampled_from(ISAS),
)
def test_random_tensors_any_axis(shape, axis, dtype, mode, elem, seed, specials, level):
    axis = axis % len(shape)
    x = random_input(shape, dtype, seed, specials)
    use_isa(level)
    try:
        got = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(got, *reference.quantize(x, axis, elem, mode))
        expected = reference.dequantize(got.data, got.scale, axis, None, torch.float32)
        torch.testing.assert_close(got.dequantize(), expected, rtol=0, atol=0, equal_nan=True)
        expected = reference.dequantize(got.data, got.scale, axis, None, torch.bfloat16)
        torch.testing.assert_close(got.dequantize(torch.bfloat16), expected, rtol=0, atol=0, equal_nan=True)
    finally:
        use_isa("avx512")


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 200),
    k=st.integers(1, 1100),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31 - 1),
    specials=st.booleans(),
    level=st.sampled_from(ISAS),
)
def test_dual_equals_two_single_axis_quantizations(m, k, dtype, mode, seed, specials, level):
    x = random_input((m, k), dtype, seed, specials)
    use_isa(level)
    try:
        row, col = mx.quantize_dual(x, scale_mode=mode)
    finally:
        use_isa("avx512")
    assert (row.axis, col.axis) == (1, 0)
    assert_same_quantization(row, *reference.quantize(x, 1, E4M3, mode))
    assert_same_quantization(col, *reference.quantize(x, 0, E4M3, mode))


group_sizes = st.lists(st.sampled_from([0, 1, 5, 31, 32, 33, 64, 70]), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(
    sizes=group_sizes,
    k=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(MODES),
    elem=st.sampled_from([E4M3, E5M2]),
    seed=st.integers(0, 2**31 - 1),
    level=st.sampled_from(ISAS),
)
def test_grouped(sizes, k, dtype, mode, elem, seed, level):
    offsets = torch.tensor(sizes).cumsum(0)
    x = random_input((int(offsets[-1]), k), dtype, seed, specials=True)
    use_isa(level)
    try:
        got = mx.quantize_grouped(x, offsets, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(got, *reference.quantize_grouped(x, offsets, elem, mode))
        expected = reference.dequantize(got.data, got.scale, 0, offsets, torch.float32)
        torch.testing.assert_close(got.dequantize(), expected, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got.t().dequantize(), expected.t(), rtol=0, atol=0, equal_nan=True)
    finally:
        use_isa("avx512")


def test_grouped_blocks_restart_at_group_starts():
    # Two groups of 20 rows: the second group's values are 2^20 times larger, so if blocks did
    # not restart at row 20 the first group's elements would all underflow to zero.
    x = torch.cat([torch.full((20, 4), 1.0), torch.full((20, 4), 2.0**20)])
    got = mx.quantize_grouped(x, torch.tensor([20, 40]))
    assert got.scale.shape == (40 // 32 + 2, 4)
    torch.testing.assert_close(got.dequantize(), x)


def test_non_contiguous_input_and_transposed_dequantize(isa):
    x = random_input((48, 80), torch.bfloat16, seed=5, specials=False)
    view = x.t()  # [80, 48], not contiguous
    got = mx.quantize(view, 0)
    assert_same_quantization(got, *reference.quantize(view.contiguous(), 0, E4M3, "rceil"))
    t = got.t()
    assert t.axis == 1 and t.shape == (48, 80)
    torch.testing.assert_close(t.dequantize(), got.dequantize().t(), rtol=0, atol=0)


def test_custom_ops_pass_opcheck():
    x = random_input((40, 70), torch.bfloat16, seed=1, specials=False)
    offsets = torch.tensor([10, 10, 40])
    torch.library.opcheck(torch.ops.hyperparallel.mx_quantize_cpu, (x, 1, E4M3, "rceil"))
    torch.library.opcheck(torch.ops.hyperparallel.mx_quantize_dual_cpu, (x, E4M3, "floor"))
    torch.library.opcheck(torch.ops.hyperparallel.mx_quantize_grouped_cpu, (x, offsets, E5M2, "rceil"))
    q = mx.quantize(x, 0)
    # the schema check multiplies inputs, which torch cannot do for float8 inputs: skip only it
    tests = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.hyperparallel.mx_dequantize_cpu, (q.data, q.scale, 0, None, torch.bfloat16), test_utils=tests
    )


def test_torch_compile_traces_through_quantize():
    def f(x):
        q = mx.quantize(x * 2, 1)
        return q.dequantize(torch.float32) + 1

    x = random_input((32, 64), torch.float32, seed=2, specials=False)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_every_bf16_bit_pattern(isa, mode, elem):
    # All 65536 bf16 values, shuffled into blocks so that each meets many different scales.
    bits = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    # 64 x 1024: rows of 32 blocks and 512-column tiles take the wide bf16 fast paths
    x = bits[torch.randperm(len(bits), generator=torch.Generator().manual_seed(7))].reshape(64, 1024)
    x = torch.where(torch.isfinite(x), x, 0)  # NaN/Inf blocks are covered elsewhere; keep blocks finite
    for axis in (0, 1):
        got = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(got, *reference.quantize(x, axis, elem, mode))
    row, col = mx.quantize_dual(x, scale_mode=mode, elem_dtype=elem)
    assert_same_quantization(row, *reference.quantize(x, 1, elem, mode))
    assert_same_quantization(col, *reference.quantize(x, 0, elem, mode))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_corner_cases_in_wide_tiles(isa, dtype, mode, elem):
    # The corner-case rows tiled to 1094 columns and 76 rows: whole 512-column tiles, groups of
    # 16 row blocks and partial tails, with NaN/Inf blocks, subnormals and saturation inside them.
    base = special_rows(dtype)
    x = base.repeat(7, 16)[:76, : 1024 + 70]
    x[50:, 200:] = x[50:, 200:] * 2.0**-9  # more lanes that land on element subnormals
    for axis in (0, 1):
        got = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(got, *reference.quantize(x, axis, elem, mode))
    for k in (1024, 1024 + 70):
        row, col = mx.quantize_dual(x[:, :k].contiguous(), scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(row, *reference.quantize(x[:, :k], 1, elem, mode))
        assert_same_quantization(col, *reference.quantize(x[:, :k], 0, elem, mode))
    offsets = torch.tensor([0, 7, 40, 40, 76])
    got = mx.quantize_grouped(x, offsets, scale_mode=mode, elem_dtype=elem)
    assert_same_quantization(got, *reference.quantize_grouped(x, offsets, elem, mode))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_blocks_of_neighbouring_values(isa, dtype, mode, elem):
    # Every finite bf16 magnitude, in ascending order, so that each block holds neighbours and
    # its scale is set by them: blocks made only of subnormals and tiny normals get scales
    # near 2^-127, where fp32-subnormal inputs land on normal elements.
    magnitudes = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    signs = torch.randint(0, 2, (len(magnitudes),), generator=torch.Generator().manual_seed(3)) * 2 - 1
    values = torch.cat([magnitudes * signs.to(torch.bfloat16), torch.zeros(64 * 512 - len(magnitudes), dtype=torch.bfloat16)])
    x = values.reshape(64, 512).to(dtype)  # rows of 16 whole blocks; 512-wide tiles
    for axis in (0, 1):
        got = mx.quantize(x, axis, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(got, *reference.quantize(x, axis, elem, mode))
    row, col = mx.quantize_dual(x, scale_mode=mode, elem_dtype=elem)
    assert_same_quantization(row, *reference.quantize(x, 1, elem, mode))
    assert_same_quantization(col, *reference.quantize(x, 0, elem, mode))
    xt = x.t().contiguous()  # columns of neighbours: the column-wise kernels see them too
    got = mx.quantize(xt, 0, scale_mode=mode, elem_dtype=elem)
    assert_same_quantization(got, *reference.quantize(xt, 0, elem, mode))


def test_wide_rows_span_several_column_chunks():
    # 4096 + 544 columns: column-wise and dual tasks start at column 4096 too, and the tail
    # chunk is not a multiple of 512
    x = random_input((40, 4096 + 544), torch.bfloat16, seed=11, specials=True)
    for axis in (0, 1):
        assert_same_quantization(mx.quantize(x, axis), *reference.quantize(x, axis, E4M3, "rceil"))
    row, col = mx.quantize_dual(x)
    assert_same_quantization(row, *reference.quantize(x, 1, E4M3, "rceil"))
    assert_same_quantization(col, *reference.quantize(x, 0, E4M3, "rceil"))


def test_outputs_large_enough_for_streaming_stores(isa):
    # >= 16 MiB of codes switches the kernels to non-temporal stores
    x = random_input((4100, 4128), torch.bfloat16, seed=12, specials=True)
    for axis in (0, 1):
        assert_same_quantization(mx.quantize(x, axis), *reference.quantize(x, axis, E4M3, "rceil"))
    row, col = mx.quantize_dual(x)
    assert_same_quantization(row, *reference.quantize(x, 1, E4M3, "rceil"))
    assert_same_quantization(col, *reference.quantize(x, 0, E4M3, "rceil"))


def test_grouped_keeps_its_own_offsets_and_ignores_autograd():
    offsets = torch.tensor([10, 40])
    x = torch.randn(40, 64, requires_grad=True)
    got = mx.quantize_grouped(x, offsets)
    offsets[0] = 30  # the caller reuses its routing buffer
    assert got.group_offsets.tolist() == [10, 40]
    assert not got.data.requires_grad
    expected = reference.quantize_grouped(x.detach(), torch.tensor([10, 40]), E4M3, "rceil")
    assert_same_quantization(got, *expected)


def test_torch_compile_traces_dual_and_grouped():
    def f(x, offsets):
        row, col = mx.quantize_dual(x)
        g = mx.quantize_grouped(x, offsets)
        return row.dequantize() + col.dequantize() + g.dequantize()

    x = random_input((64, 96), torch.float32, seed=4, specials=False)
    offsets = torch.tensor([20, 20, 64])
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, offsets), f(x, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_dual_subnormal_inputs_under_tiny_scales(isa, mode, elem):
    # Blocks of bf16 subnormals (both signs, zeros too) led by one value that sets the scale, for
    # every leading exponent from the subnormals up to 2^-100: every tiny scale the wide bf16
    # dual kernel can meet, including those whose exponent offset is zero or negative.
    g = torch.Generator().manual_seed(5)
    patterns = torch.cat([torch.arange(0, 128), torch.arange(0, 128) + 0x8000]).to(torch.int16)
    for lead in range(0x0001, 0x0D80, 0x40):
        bits = patterns[torch.randint(0, len(patterns), (32 * 512,), generator=g)].reshape(32, 512)
        bits[:, ::32] = lead + torch.randint(0, 0x40, (32, 16), generator=g).to(torch.int16)
        bits[::7, :] = lead  # rows that lead the column blocks
        x = bits.view(torch.bfloat16)
        row, col = mx.quantize_dual(x, scale_mode=mode, elem_dtype=elem)
        assert_same_quantization(row, *reference.quantize(x, 1, elem, mode))
        assert_same_quantization(col, *reference.quantize(x, 0, elem, mode))

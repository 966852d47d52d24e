"""The reference itself against the OCP MX definition, computed independently in float64."""

from __future__ import annotations

import math

import pytest
import torch

from hyperparallel.mx import reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
EMAX = {E4M3: 8, E5M2: 15}


def fp8_table(dtype):
    """All finite codes of a format with their values, from torch's own decoding."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).to(torch.float64)
    finite = torch.isfinite(values)
    return codes[finite], values[finite]


def nearest_even(v: torch.Tensor, dtype) -> torch.Tensor:
    """Round float64 values to the format by brute force: the nearest finite value, ties to the
    even code, zero keeping the sign of v, saturating at +-max."""
    codes, values = fp8_table(dtype)
    v = v.clamp(-MAX[dtype], MAX[dtype])
    dist = (v[:, None] - values[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    odd = (codes & 1).bool()[None, :]
    wrong_sign = (codes >= 128)[None, :] != torch.signbit(v)[:, None]
    penalty = torch.where(nearest, odd.int() * 2 + wrong_sign.int(), 99)
    return codes[penalty.argmin(dim=1)]


@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_every_bf16_value_rounds_to_nearest_even(elem):
    # One block per bf16 bit pattern of magnitude <= 1, next to a 1 that fixes the scale.
    bits = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vals = bits[torch.isfinite(bits) & (bits.abs() <= 1.0)]
    blocks = torch.stack([vals, torch.ones_like(vals)], dim=1)
    data, scale = reference.quantize(blocks, 1, elem, "floor")
    assert bool((scale.view(torch.uint8) == 127 - EMAX[elem]).all())
    scaled = vals.to(torch.float64) * 2.0 ** EMAX[elem]
    assert torch.equal(data.view(torch.uint8)[:, 0], nearest_even(scaled, elem))


@pytest.mark.parametrize("elem", [E4M3, E5M2])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_scale_matches_log2_definition(elem, mode):
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.rand(4000, generator=g, dtype=torch.float64) * 250 - 125).float()
    amax = torch.cat([amax, torch.tensor([1.75, 3.5, 448.0, 448.0 * 1.0000001, 2.0**-126, 2.0**-149])])
    blocks = torch.stack([amax, amax / 3], dim=1)
    _, scale = reference.quantize(blocks, 1, elem, mode)
    for a, byte in zip(amax.tolist(), scale.view(torch.uint8)[:, 0].tolist(), strict=True):
        if mode == "floor":
            e = math.floor(math.log2(a)) - EMAX[elem]
        else:
            e = math.ceil(math.log2(a / MAX[elem]))
            # guard against log2 rounding of exact powers of two
            if 2.0**e / 2 * MAX[elem] >= a:
                e -= 1
        assert byte == max(-127, min(127, e)) + 127, a


def test_hand_computed_corner_cases():
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    x[1, 0] = torch.finfo(torch.bfloat16).max
    x[2, 0] = 2.0**-133  # smallest bf16 subnormal, alone in its block
    x[3, 5] = float("nan")
    for mode, max_byte, max_code in (("rceil", 247, 0x78), ("floor", 246, 0x7E)):
        data, scale = reference.quantize(x, 1, E4M3, mode)
        s = scale.view(torch.uint8)[:, 0].tolist()
        d = data.view(torch.uint8)
        assert s[0] == 0 and bool((d[0] == 0).all())  # zero block: byte 0, zero codes
        assert s[1] == max_byte and int(d[1, 0]) == max_code  # 255 -> 256 (rceil), 510 -> 448 (floor)
        assert s[2] == 0 and int(d[2, 0]) == 0x08  # 2^-133 * 2^127 = 2^-6, the least E4M3 normal
        assert s[3] == 0xFF and bool((d[3] == 0x7F).all())


def test_dequantize_is_exact_in_float64():
    x = torch.randn(8, 64, dtype=torch.float64)
    data, scale = reference.quantize(x.float(), 1, E4M3, "rceil")
    out = reference.dequantize(data, scale, 1, None, torch.float64)
    s = 2.0 ** (scale.view(torch.uint8).double() - 127)
    expected = data.double() * s.repeat_interleave(32, dim=1)
    assert torch.equal(out, expected)

"""Inputs that exercise every corner of the MX semantics, shared by the conformance tests."""

from __future__ import annotations

import torch

BF16_MAX = torch.finfo(torch.bfloat16).max
BF16_TINY_SUBNORMAL = 2.0**-133


def special_rows(dtype: torch.dtype) -> torch.Tensor:
    """A [12, 70] tensor whose rows are each a distinct corner case (blocks of 32, 32 and 6)."""
    g = torch.Generator().manual_seed(1234)
    rows = torch.randn(12, 70, generator=g)
    rows[0] = 0.0  # all-zero blocks
    rows[1] = -0.0
    rows[2] = torch.randn(70, generator=g) * 2.0**-130  # subnormal fp32 inputs
    rows[3] = 447.0 + torch.rand(70, generator=g) * 40  # around and beyond the E4M3 max
    rows[4, 5] = float("nan")  # one NaN poisons the first block only
    rows[5, 40] = float("inf")
    rows[6, 69] = float("-inf")  # in the trailing partial block
    rows[7] = torch.randn(70, generator=g) * 1e4
    rows[7, :32] = rows[7, :32].clamp(-1, 1)
    rows[7, 3] = 1.75 * 2.0**3  # exactly max_normal * 2^k: rceil must not round up
    rows[8] = torch.linspace(-1, 1, 70) * 2.0**-6  # values landing on E4M3 subnormals
    rows[9] = torch.randn(70, generator=g) * 2.0**100
    rows[10] = torch.randn(70, generator=g) * 2.0**-100
    rows[11, :] = 1.0
    rows[11, 0] = 1.0 + 2**-7  # just above a power of two: rceil rounds up, floor does not
    x = rows.to(dtype)
    if dtype == torch.bfloat16:
        x[3, 0] = BF16_MAX
        x[3, 33] = -BF16_MAX
        x[2, 7] = BF16_TINY_SUBNORMAL
    if dtype == torch.float16:
        x[9] = torch.randn(70, generator=g).to(dtype) * 60000 / 4
        x[10] = torch.full((70,), 2.0**-24, dtype=dtype)  # fp16 subnormals
    return x


def random_input(shape, dtype, seed: int, specials: bool) -> torch.Tensor:
    """Random values with a different magnitude per row, optionally with NaN/Inf/zeros mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.dim() and x.numel():
        exponents = torch.randint(-20, 20, x.shape[:-1] + (1,), generator=g).float()
        x = x * torch.exp2(exponents)
    if specials and x.numel():
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (4,), generator=g)
        flat[picks[0]] = float("nan")
        flat[picks[1]] = float("inf")
        flat[picks[2]] = 0.0
        flat[picks[3]] = 2.0**-140
    return x.to(dtype)

"""The MX specification in plain PyTorch: readable, slow, and the oracle of every test.

Semantics (identical, byte for byte, in every backend):
- Blocks of 32 consecutive values along the quantized axis; a trailing partial block is allowed.
- Scale exponent of a block with largest magnitude amax (element max = 1.75 * 2**emax):
  * ``floor`` (OCP MX v1.0): e = floor(log2(amax)) - emax;
  * ``rceil`` (default):     e = ceil(log2(amax / max_normal)), computed exactly, so that every
    element fits without saturating;
  clamped to [-127, 127]. The scale byte is e + 127; an all-zero block gets byte 0.
- A block holding a NaN or an Inf gets scale byte 0xFF and every element NaN (code 0x7F).
- Elements are x * 2**-e rounded to nearest even, saturated to +-max_normal, sign kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperparallel.mx.format import BLOCK_SIZE, SCALE_BIAS, SCALE_NAN, element_format, num_blocks
from hyperparallel.mx.groups import grouped_scale_index, grouped_scale_rows


def _scale_exponents(amax: torch.Tensor, emax: int, scale_mode: str) -> torch.Tensor:
    """Unbiased scale exponents (int32) for blocks with the given float32 amax (finite, >= 0)."""
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = exponent.to(torch.int32) - 1 - emax  # floor(log2(amax)) - emax
    if scale_mode == "rceil":
        # max_normal is 1.75 * 2**emax: round up when amax / 2**floor(log2 amax) exceeds 1.75
        e = e + (mantissa > 0.875).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, -SCALE_BIAS), e)
    return e.clamp(-SCALE_BIAS, SCALE_BIAS)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32 for integer e in [-126, 127], built from its bits (exact)."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def _quantize_last(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dimension; returns (data, scale bytes as uint8)."""
    fmt = element_format(elem_dtype)
    x = x.float()
    n = x.shape[-1]
    nb = num_blocks(n)
    blocks = F.pad(x, (0, nb * BLOCK_SIZE - n)).reshape(*x.shape[:-1], nb, BLOCK_SIZE)
    bad = ~torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(bad, 0.0, blocks.abs().amax(dim=-1))  # NaN blocks are marked below
    e = _scale_exponents(amax, fmt.emax, scale_mode)
    scaled = blocks * _pow2(-e).unsqueeze(-1)  # exact: 2**-e is a normal float32
    elems = scaled.clamp(-fmt.max_normal, fmt.max_normal).to(elem_dtype)
    nan = torch.full_like(elems.view(torch.uint8), fmt.nan_byte).view(elem_dtype)
    elems = torch.where(bad.unsqueeze(-1), nan, elems)
    data = elems.reshape(*x.shape[:-1], nb * BLOCK_SIZE)[..., :n]
    scale = torch.where(bad, SCALE_NAN, e + SCALE_BIAS).to(torch.uint8)
    return data.contiguous(), scale


def quantize(x: torch.Tensor, axis: int, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = _quantize_last(x.movedim(axis, -1), elem_dtype, scale_mode)
    return data.movedim(-1, axis).contiguous(), scale.movedim(-1, axis).contiguous().view(torch.float8_e8m0fnu)


def quantize_dual(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str):
    row = quantize(x, 1, elem_dtype, scale_mode)
    col = quantize(x, 0, elem_dtype, scale_mode)
    return row[0], row[1], col[0], col[1]


def quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str):
    rows = x.shape[0]
    data = torch.empty(x.shape, dtype=elem_dtype)
    scale = torch.zeros(grouped_scale_rows(rows, len(offsets)), x.shape[1], dtype=torch.uint8)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            d, s = quantize(x[start:end], 0, elem_dtype, scale_mode)
            data[start:end] = d
            first = start // BLOCK_SIZE + g
            scale[first : first + s.shape[0]] = s.view(torch.uint8)
        start = end
    return data, scale.view(torch.float8_e8m0fnu)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to float64 powers of two (0xFF -> NaN)."""
    b = scale.view(torch.uint8).to(torch.float64)
    return torch.where(b == SCALE_NAN, float("nan"), torch.exp2(b - SCALE_BIAS))


def dequantize(data, scale, axis, group_offsets, dtype: torch.dtype) -> torch.Tensor:
    """Exact values in float64, then one rounding to `dtype`."""
    n = data.shape[axis]
    if group_offsets is not None:
        index = grouped_scale_index(group_offsets, n).to(scale.device)
    else:
        index = torch.arange(n, device=scale.device) // BLOCK_SIZE
    s = scale_values(scale).index_select(axis, index)
    return (data.to(torch.float64) * s).to(dtype)

"""MX element and scale formats: the constants every backend shares (OCP MX v1.0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperparallel.errors import ConfigError, ShapeError

BLOCK_SIZE = 32
SCALE_DTYPE = torch.float8_e8m0fnu
SCALE_BIAS = 127
SCALE_NAN = 0xFF
SCALE_MODES = ("rceil", "floor")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ElementFormat:
    dtype: torch.dtype
    max_normal: float  # largest finite value: 1.75 * 2**emax for both formats
    emax: int  # exponent of the largest binade
    nan_byte: int  # the code written for every element of a NaN/Inf block


ELEMENT_FORMATS = {
    torch.float8_e4m3fn: ElementFormat(torch.float8_e4m3fn, 448.0, 8, 0x7F),
    torch.float8_e5m2: ElementFormat(torch.float8_e5m2, 57344.0, 15, 0x7F),
}


def element_format(dtype: torch.dtype) -> ElementFormat:
    if dtype not in ELEMENT_FORMATS:
        raise ConfigError(
            f"elem_dtype {dtype} is not an MX element format; use torch.float8_e4m3fn "
            "(default) or torch.float8_e5m2"
        )
    return ELEMENT_FORMATS[dtype]


def check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ConfigError(f"scale_mode {scale_mode!r} is not one of {SCALE_MODES}")


def check_block_size(block_size: int) -> None:
    if block_size != BLOCK_SIZE:
        raise ConfigError(f"block_size {block_size} is not supported; MX blocks hold {BLOCK_SIZE} elements")


def check_input(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise ShapeError(f"{what} has dtype {x.dtype}; MX quantization takes float32, bfloat16 or float16")


def normalize_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if ndim == 0:
        raise ShapeError("cannot quantize a 0-d tensor: MX blocks run along a dimension")
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{what}={axis} is out of range for a {ndim}-d tensor")
    return axis % ndim


def num_blocks(n: int) -> int:
    return (n + BLOCK_SIZE - 1) // BLOCK_SIZE

"""Bad input gets a clear error naming the problem, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

from hyperparallel import mx
from hyperparallel.errors import BackendError, ConfigError, ShapeError


def test_non_float_input():
    with pytest.raises(ShapeError, match="dtype torch.int64"):
        mx.quantize(torch.arange(64))
    with pytest.raises(ShapeError, match="must be a torch.Tensor"):
        mx.quantize([1.0, 2.0])


def test_bad_axis_mode_format_block():
    x = torch.randn(4, 64)
    with pytest.raises(ShapeError, match="axis=2 is out of range for a 2-d tensor"):
        mx.quantize(x, 2)
    with pytest.raises(ConfigError, match="scale_mode 'ceil'"):
        mx.quantize(x, scale_mode="ceil")
    with pytest.raises(ConfigError, match="not an MX element format"):
        mx.quantize(x, elem_dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="block_size 16"):
        mx.quantize(x, block_size=16)
    with pytest.raises(ShapeError, match="0-d"):
        mx.quantize(torch.tensor(1.0))


def test_offsets_must_end_at_row_count():
    x = torch.randn(40, 8)
    with pytest.raises(ShapeError, match="must end at the row count 40"):
        mx.quantize_grouped(x, torch.tensor([10, 39]))
    with pytest.raises(ShapeError, match="non-decreasing"):
        mx.quantize_grouped(x, torch.tensor([20, 10, 40]))
    with pytest.raises(ShapeError, match="int32/int64"):
        mx.quantize_grouped(x, torch.tensor([20.0, 40.0]))


def test_dual_and_grouped_need_2d():
    with pytest.raises(ShapeError, match="quantize_dual takes a 2-D tensor"):
        mx.quantize_dual(torch.randn(2, 3, 32))
    with pytest.raises(ShapeError, match="quantize_grouped takes a 2-D tensor"):
        mx.quantize_grouped(torch.randn(32), torch.tensor([32]))


def test_unknown_or_unavailable_backend():
    with pytest.raises(BackendError, match="'cuda-magic' is unknown"):
        mx.quantize(torch.randn(4, 32), backend="cuda-magic")


def test_errors_are_builtin_subclasses():
    assert issubclass(ShapeError, ValueError) and issubclass(ConfigError, ValueError)

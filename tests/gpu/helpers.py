"""What the CUDA tests share: the skip without a GPU, moving inputs, comparing across devices."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.device("cuda")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bytes(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal shape, dtype and every byte (got may live on the GPU)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    assert torch.equal(u8(got.detach().cpu().contiguous()), u8(expected.detach().cpu().contiguous())), what


def assert_same_values(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal values, NaN where NaN (got may live on the GPU)."""
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    torch.testing.assert_close(got.detach().cpu(), expected.detach().cpu(), rtol=0, atol=0, equal_nan=True, msg=what)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU (0 for two empty or zero tensors)."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    norm = w.norm().item()
    diff = (g - w).norm().item()
    return diff / norm if norm else diff


def assert_near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str = "") -> None:
    """Same shape and dtype, finite, and within `rel` of `want` in norm: what another fp32
    accumulation order (and the bf16 roundings after it) can move."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert torch.isfinite(got.detach().float()).all(), f"{what}: non-finite values"
    error = relative_error(got, want)
    assert error <= rel, f"{what}: relative error {error:.3g} > {rel:.3g}"


def leaf_like(t: torch.Tensor, device) -> torch.Tensor:
    """A fresh leaf with t's values on `device`, requiring grad."""
    return t.detach().to(device).clone().requires_grad_()

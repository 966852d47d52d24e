"""Grouped matrix products for MoE experts in high precision: a [M,K] x b [E,K,N] -> [M,N], the rows
of each group multiplied by their own b[g], with no Python loop over groups.

torch._grouped_mm serves the shapes and dtypes it can (one kernel for all groups); a padded bmm
serves the rest. Both are differentiable in a and b.
"""

from __future__ import annotations

import torch

from hyperparallel.errors import ShapeError
from hyperparallel.mx.grouped_products import native_serves


def native_grouped_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm(a, b, ...)` runs on torch._grouped_mm (else on the padded-bmm fallback).

    The rule: what hyperparallel.mx's grouped products measured torch._grouped_mm to serve
    (`native_serves`: dtype and device, K and N times the element size multiples of 16 bytes),
    a and b of one dtype, and b row-major [E,K,N] or the transpose of a row-major [E,N,K] (how
    experts store their weights), so that a (made contiguous), b, the result and both gradients
    have 16-byte-aligned strides.
    """
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or not native_serves(a, b.shape[1], b.shape[2]):
        return False
    return b.is_contiguous() or b.transpose(-2, -1).is_contiguous()


# torch._grouped_mm as custom ops: torch.compile sees them as opaque calls with a known output
# shape (its own meta function for _grouped_mm refuses float32), and the backward below runs on
# grouped matmuls too. torch's own backward for _grouped_mm fails on the CPU when the incoming
# gradient has zero or unaligned strides (an expanded gradient, as `.sum()` makes), so gradients
# are made contiguous here; the weight gradient is produced directly in the weight's own memory
# layout so that accumulating it into `.grad` needs no copy.
@torch.library.custom_op("hyperparallel::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a.contiguous(), b, offs=offsets)


@_grouped_mm_op.register_fake
def _(a, b, offsets):
    return a.new_empty(a.shape[0], b.shape[2])


@torch.library.custom_op("hyperparallel::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor,
                            transposed: bool) -> torch.Tensor:
    """Per group a^T grad_out: [E, K, N], or its transpose [E, N, K] (contiguous) when `transposed`."""
    a, grad_out = a.contiguous(), grad_out.contiguous()
    if transposed:
        return torch._grouped_mm(grad_out.t(), a, offs=offsets)
    return torch._grouped_mm(a.t(), grad_out, offs=offsets)


@_grouped_mm_weight_grad.register_fake
def _(a, grad_out, offsets, transposed):
    k, n = a.shape[1], grad_out.shape[1]
    return a.new_empty(offsets.shape[0], *((n, k) if transposed else (k, n)))


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _grouped_mm_backward(ctx, grad_out):
    a, b, offsets = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _grouped_mm_op(grad_out, b.transpose(-2, -1), offsets)
    if ctx.needs_input_grad[1]:
        transposed = b.transpose(-2, -1).is_contiguous()  # b is an [E,N,K] weight seen as [E,K,N]
        grad_b = _grouped_mm_weight_grad(a, grad_out, offsets, transposed)
        if transposed:
            grad_b = grad_b.transpose(-2, -1)
    return grad_a, grad_b, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _padded_bmm_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference and fallback: scatter the groups into [E, max_rows, K], one bmm, gather back.

    Costs E * max_rows * K memory, so a badly balanced routing costs more than a balanced one;
    autograd works through the index ops and the bmm as they are.
    """
    num_groups, rows = b.shape[0], a.shape[0]
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    group = torch.repeat_interleave(torch.arange(num_groups, device=a.device), counts, output_size=rows)
    row_in_group = torch.arange(rows, device=a.device) - (offsets.long() - counts)[group]
    max_rows = int(counts.max()) if num_groups else 0  # one host sync; the native path has none
    padded = a.new_zeros(num_groups, max_rows, a.shape[1]).index_put((group, row_in_group), a)
    return torch.bmm(padded, b)[group, row_in_group]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [M,K] x b [E,K,N] -> [M,N]: rows offsets[g-1]:offsets[g] of a are multiplied by b[g].

    `offsets` holds cumulative group ends (1-D, int32, length E, last == M); empty groups are
    allowed. Runs torch._grouped_mm when `native_grouped_mm_supported(a, b)`, else a padded bmm;
    both are differentiable in a and b and neither loops over groups in Python.
    """
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ShapeError(f"grouped_mm needs a [M,K] and b [E,K,N]; got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != b.shape[0]:
        raise ShapeError(
            f"grouped_mm needs offsets of shape [{b.shape[0]}] (one end per group); got {tuple(offsets.shape)}"
        )
    if native_grouped_mm_supported(a, b):
        return _grouped_mm_op(a, b, offsets.to(torch.int32))
    return _padded_bmm_grouped_mm(a, b.to(a.dtype), offsets)

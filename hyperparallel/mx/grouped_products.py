"""Grouped products of plain tensors, every group in one call: a [M, K] x b [E, K, N] -> [M, N]
(rows of group g times b[g]) and the weight-gradient form a [K, M] x b [M, N] -> [E, K, N]
(grouped along M). No autograd: mx_grouped_mm runs them on dequantized operands, and MXFP8
experts' high-precision weight gradients run them directly.
"""

from __future__ import annotations

import torch

# [Note: one grouped product]
# Both forms (and so both forms of mx_grouped_mm) run every group in one call, with no Python loop over groups:
# torch._grouped_mm (no host sync) where it serves the operands, else a padded bmm (one host sync,
# for the largest group's size). On the CPU torch._grouped_mm is itself a loop of mm in C++, as fast
# as the loop it replaced; what it saves is the host sync per call on CUDA and the unrolled,
# data-dependent loop under torch.compile. The rules below were measured on torch 2.13's CPU
# kernels: dtypes float32 / bfloat16 / float16 with both operands alike (CUDA: bfloat16 only,
# compute capability 8.0+), every non-unit stride of the operands and of the result a multiple of
# 16 bytes (so K and N times the element size, neither zero); the weight-gradient form wants a
# [K, M] as the transpose of a row-major [M, K] and b [M, N] row-major (so M needs no alignment).
# Empty groups give zero rows / zero gradients. torch._grouped_mm refuses M == 0 in the 2-D x 3-D
# form, and its meta function refuses float32 (the dtype every product runs in under
# torch.compile), hence the custom op with its own fake below.
_NATIVE_ALIGN_BYTES = 16


def _native_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    if not hasattr(torch, "_grouped_mm"):
        return ()
    if device.type == "cpu":
        return (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return (torch.bfloat16,)
    return ()


def native_serves(a: torch.Tensor, k: int, n: int) -> bool:
    """Whether torch._grouped_mm takes operands of a's dtype and device with these K and N."""
    size = a.element_size()
    return (
        a.dtype in _native_dtypes(a.device)
        and k > 0
        and n > 0
        and (k * size) % _NATIVE_ALIGN_BYTES == 0
        and (n * size) % _NATIVE_ALIGN_BYTES == 0
    )


@torch.library.custom_op("hyperparallel::mx_grouped_mm_native", mutates_args=())
def _native_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


@_native_grouped_mm.register_fake
def _(a, b, offsets):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1])


def _group_slots(offsets: torch.Tensor, rows: int, device: torch.device):
    """Each row's group and its place in that group, and the largest group's size (a host sync)."""
    ends = offsets.to(device=device, dtype=torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(len(ends), device=device), counts, output_size=rows)
    slot = torch.arange(rows, device=device) - (ends - counts)[group]
    return group, slot, int(counts.max())


def grouped_rows_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [M, K] x b [E, K, N] -> [M, N] in the operands' common dtype."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = a.to(dtype), b.to(dtype)
    (M, K), (E, _, N) = a.shape, b.shape
    if M == 0:
        return a.new_zeros(0, N)
    if native_serves(a, K, N):
        if not (b.is_contiguous() or b.transpose(1, 2).is_contiguous()):
            b = b.contiguous()
        return _native_grouped_mm(a.contiguous(), b, offsets.to(device=a.device, dtype=torch.int32))
    # fallback (fp64, unaligned K / N): the groups as rows of an [E, max_rows, K] slab, one bmm
    group, slot, max_rows = _group_slots(offsets, M, a.device)
    slab = a.new_zeros(E, max_rows, K).index_put_((group, slot), a)
    return torch.bmm(slab, b)[group, slot]


def grouped_weight_grad_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [K, M] x b [M, N], grouped along M -> [E, K, N] in the operands' common dtype."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    a, b = a.to(dtype), b.to(dtype)
    (K, M), (_, N), E = a.shape, b.shape, offsets.shape[0]
    if native_serves(a, K, N):
        a_t = a.t() if a.t().is_contiguous() else a.t().contiguous()
        return _native_grouped_mm(a_t.t(), b.contiguous(), offsets.to(device=a.device, dtype=torch.int32))
    # fallback: both operands' groups as rows of [E, max_rows, *] slabs (zero rows elsewhere), one bmm
    group, slot, max_rows = _group_slots(offsets, M, a.device)
    a_slab = a.new_zeros(E, max_rows, K).index_put_((group, slot), a.t())
    b_slab = b.new_zeros(E, max_rows, N).index_put_((group, slot), b)
    return torch.bmm(a_slab.transpose(1, 2), b_slab)

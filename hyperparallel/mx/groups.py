"""Block layouts along a quantized dimension: plain batches and grouped (MoE) rows.

Grouped quantization blocks rows along dim 0 of a [M, K] tensor, restarting a block at every
group start. Groups have any size (zero included), so each group ends in a partial block of its
own. Scales use a static layout that does not depend on the group sizes, which keeps shapes known
ahead of time (torch.compile, preallocation): the scale tensor has ``M // 32 + E`` rows and the
j-th block of group g (rows start_g + 32 j ...) has its scale in row ``start_g // 32 + g + j``.
Rows of the scale tensor that no block uses hold byte 0.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from hyperparallel.errors import ShapeError
from hyperparallel.mx.format import BLOCK_SIZE, num_blocks


def check_offsets(offsets: torch.Tensor, rows: int) -> None:
    """Offsets are cumulative group ends: 1-D, integer, non-decreasing, last == rows.

    The values are checked by device-side assertions (`torch._assert_async`): on a GPU they never
    wait for the device, and a bad value fails the next synchronizing call as a device-side assert,
    which leaves the CUDA context unusable (the process must exit: a bug in the caller's offsets,
    not an error to recover from); on the CPU they are checked at once and raise ShapeError."""
    if not isinstance(offsets, torch.Tensor):
        raise ShapeError(f"offsets must be a 1-D integer tensor of group ends, got {type(offsets).__name__}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.numel() == 0:
        raise ShapeError(
            f"offsets must be a non-empty 1-D int32/int64 tensor of cumulative group ends, "
            f"got shape {tuple(offsets.shape)} and dtype {offsets.dtype}"
        )
    if torch.compiler.is_compiling() or not has_values(offsets):
        return  # the values are data: asserting on them would break the graph (checked when eager)
    _assert(offsets[-1] == rows, f"offsets must end at the row count {rows}")
    _assert((offsets[0] >= 0) & (offsets[1:] >= offsets[:-1]).all(), "offsets must be non-negative and non-decreasing")


def check_same_offsets(own: torch.Tensor | None, offsets: torch.Tensor, message: str) -> None:
    """A grouped MXTensor's own offsets equal `offsets` (asserted on the device, as check_offsets)."""
    if own is None or own.shape != offsets.shape:
        raise ShapeError(message)
    if not torch.compiler.is_compiling() and has_values(offsets):
        _assert((own.to(offsets.device, torch.int64) == offsets.long()).all(), message)


def has_values(t: torch.Tensor) -> bool:
    """Whether `t` holds values (not a meta tensor, nor a fake one of torch.compile or `hyperparallel plan`)."""
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _assert(condition: torch.Tensor, message: str) -> None:
    try:
        torch._assert_async(condition, message)
    except RuntimeError as exc:  # the CPU checks at once: the library's own error type
        raise ShapeError(message) from exc


def grouped_scale_rows(rows: int, num_groups: int) -> int:
    return rows // BLOCK_SIZE + num_groups


def grouped_blocks(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every block of a grouped layout as (first row, row count, scale row), int64 on the CPU."""
    ends = offsets.detach().to("cpu", torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    per_group = (sizes + BLOCK_SIZE - 1) // BLOCK_SIZE
    group = torch.repeat_interleave(torch.arange(len(ends)), per_group)
    first_block = torch.cumsum(per_group, 0) - per_group
    j = torch.arange(len(group)) - first_block[group]
    start = starts[group] + BLOCK_SIZE * j
    length = torch.clamp(ends[group] - start, max=BLOCK_SIZE)
    scale_row = starts[group] // BLOCK_SIZE + group + j
    return start, length, scale_row


def batched_blocks(batches: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of `batches` consecutive [n, *] slabs, each blocked on its own along n."""
    nb = num_blocks(n)
    batch = torch.arange(batches).repeat_interleave(nb)
    j = torch.arange(nb).repeat(batches)
    start = batch * n + BLOCK_SIZE * j
    length = torch.clamp(batch * n + n - start, max=BLOCK_SIZE)
    return start, length, batch * nb + j


def grouped_scale_index(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """For each of the `rows` data rows, the row of the grouped scale tensor that scales it."""
    ends = offsets.detach().to("cpu", torch.int64)
    i = torch.arange(rows)
    group = torch.searchsorted(ends, i, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    start = starts[group]
    return start // BLOCK_SIZE + group + (i - start) // BLOCK_SIZE

"""Token permutation: the (token, slot) pairs of a top-k routing ordered by expert, and the
layout of those rows in groups padded to a multiple of some rows.

Counts per expert may be anything, zero included. Nothing here syncs with the host except the
eager padded layout's length (free on the CPU).
"""

from __future__ import annotations

import torch

from hyperparallel.mx.groups import has_values


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the flattened (token, slot) pairs by expert.

    Returns `order` (positions into top_k_index.reshape(-1), stable, so within one expert tokens
    keep their order) and `offsets` (int32 cumulative group ends, one per expert).
    """
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add_ rather than bincount: no host sync, and out-of-range ids raise instead of growing bins
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def padded_slots(token_of_row, expert_of_row, offsets, num_tokens: int, align: int):
    """Lay the expert-sorted rows out in groups padded to multiples of `align`.

    Returns token_of_slot (the token each padded slot reads, `num_tokens` for a pad slot, which
    reads a zero row), row_slot (the slot of each sorted row) and the padded group ends. Eagerly
    the layout is as long as the padded groups need (one host sync, free on the CPU); under
    torch.compile it has the fixed length of the worst case (every group `align - 1` rows short),
    the last group taking the slack, so the graph has static shapes and no break. So it has on
    tensors without values (meta, or the fake tensors `hyperparallel plan` runs a model on).
    """
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    padded_counts = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded_counts, 0)
    starts, padded_starts = offsets.long() - counts, padded_ends - padded_counts
    row_slot = torch.arange(token_of_row.shape[0], device=token_of_row.device) - starts[expert_of_row] \
        + padded_starts[expert_of_row]
    if torch.compiler.is_compiling() or not has_values(offsets):
        rows, groups = token_of_row.shape[0], offsets.shape[0]
        total = (rows + groups * (align - 1) + align - 1) // align * align
        if groups:
            padded_ends = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), total)])
    else:
        total = int(padded_ends[-1]) if padded_ends.numel() else 0
    token_of_slot = torch.full((total,), num_tokens, dtype=token_of_row.dtype, device=token_of_row.device)
    token_of_slot[row_slot] = token_of_row
    return token_of_slot, row_slot, padded_ends.to(torch.int32)


# [Note: row gathers as custom ops] The token permutation's gathers (index_select) and sums into
# tokens (index_add) are custom ops, so that torch.compile calls ATen's kernels for them instead of
# generating its own. Inductor decomposes a float32 index_add (also index_select's backward) into
# an accumulating index_put, which its CPU code runs as an atomic add per element: 2.5 ms for
# [2048, 256] rows into 1024 tokens on 2 cores, where ATen's index_add takes 0.15 ms (a 4-layer
# default step ran 8 of each per micro-batch: ~8% of it). The two are each other's backward, and
# keep only the index for it (index_add's own backward keeps the rows too: [pairs, H] held across
# the step for nothing).
@torch.library.custom_op("hyperparallel::gather_rows", mutates_args=())
def _gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return source.index_select(0, index)


@_gather_rows.register_fake
def _(source, index):
    return source.new_empty(index.shape[0], *source.shape[1:])


@torch.library.custom_op("hyperparallel::sum_rows_into", mutates_args=())
def _sum_rows_into(rows: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    return rows.new_zeros(num_rows, *rows.shape[1:]).index_add_(0, index, rows)


@_sum_rows_into.register_fake
def _(rows, index, num_rows):
    return rows.new_empty(num_rows, *rows.shape[1:])


def _gather_setup(ctx, inputs, output):
    source, index = inputs
    ctx.save_for_backward(index)
    ctx.num_rows = source.shape[0]


def _gather_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _sum_rows_into(grad, index, ctx.num_rows), None


def _sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _sum_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return _gather_rows(grad, index), None, None


_gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)
_sum_rows_into.register_autograd(_sum_backward, setup_context=_sum_setup)


def gather_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source.index_select(0, index), differentiable (see [Note: row gathers as custom ops])."""
    return _gather_rows(source, index)


def add_rows_to_tokens(rows: torch.Tensor, token_of_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[pairs, H] rows summed into [num_tokens, H], row i into token token_of_row[i] (see
    [Note: row gathers as custom ops])."""
    return _sum_rows_into(rows, token_of_row, num_tokens)

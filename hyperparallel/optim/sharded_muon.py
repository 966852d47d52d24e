"""Newton–Schulz for matrices whose rows FSDP spreads over ranks: one owner per matrix.

Every rank plans the same owners (``plan_owners``: Newton–Schulz work balanced over the ranks).
Then, per set of ranks, two collectives serve every matrix of the step at once: one
``all_to_all_single`` sends each rank's rows of each direction to that matrix's owner, which
assembles the whole matrix (shards are rows ``offset .. offset + length``) and orthogonalizes it
once; a second one sends each shard holder its rows of the update. Momentum and applying the
update are elementwise and stay on the shards (``Muon.step``), so the optimizer state stays per
shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hyperparallel.fsdp import ShardPlacement

# What orthogonalize returns, so the dtype the updates travel in: a rank that owns no matrix
# still has to know it to size its receive buffer.
UPDATE_DTYPE = torch.bfloat16
DIRECTION_DTYPE = torch.bfloat16  # what orthogonalize computes in


@dataclass(frozen=True)
class ShardedMatrix:
    """One matrix to orthogonalize: this rank's rows of its direction and where the others are."""

    direction: Tensor  # [rows this rank holds, cols]
    placement: ShardPlacement
    orthogonalize: Callable[[Tensor], Tensor]  # the whole [rows, cols] direction -> its update

    @property
    def shape(self) -> tuple[int, int]:
        return sum(length for _, length in self.placement.ranges), self.direction.shape[1]


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Newton–Schulz work on a [rows, cols] matrix, up to a constant: it iterates on the wide
    orientation, so its products are (small x large) by (large x small) and (small x small) by
    (small x large)."""
    small, large = sorted((rows, cols))
    return small * small * large


def plan_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank that orthogonalizes each matrix, given each matrix's cost.

    Longest processing time first: the costliest matrix first (equal costs in the given order),
    each to the rank with the least work so far (ties: the lower rank). A pure function of its
    arguments, so every rank computes the same plan without talking.
    """
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def orthogonalize_sharded(matrices: Sequence[ShardedMatrix]) -> list[Tensor]:
    """This rank's rows of each matrix's update (UPDATE_DTYPE, shaped like its direction), in order.

    A collective: every rank of each process group involved calls it with the same matrices in
    the same order (what the same model and optimizer on every rank give). Matrices sharded over
    the same ranks share one plan and one pair of collectives, even across process group objects.
    """
    updates: list[Tensor] = [torch.empty(0)] * len(matrices)
    for indices in _by_ranks(matrices).values():
        for index, update in zip(indices, _exchange([matrices[i] for i in indices]), strict=True):
            updates[index] = update
    return updates


def _by_ranks(matrices: Sequence[ShardedMatrix]) -> dict[tuple, list[int]]:
    """Indices of the matrices sharded over each set of ranks (global ranks in group-rank order)."""
    groups: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        ranks = tuple(dist.get_process_group_ranks(matrix.placement.process_group or dist.group.WORLD))
        groups.setdefault((ranks, matrix.direction.device), []).append(index)
    return groups


def _exchange(matrices: Sequence[ShardedMatrix]) -> list[Tensor]:
    """orthogonalize_sharded for matrices sharded over one set of ranks."""
    first = matrices[0].placement
    group, world, rank = first.process_group, len(first.ranges), first.rank
    device = matrices[0].direction.device
    owners = plan_owners([newton_schulz_cost(*m.shape) for m in matrices], world)
    mine = [i for i, owner in enumerate(owners) if owner == rank]

    # Directions: every rank's rows of matrix i go to owners[i]. Received: by source rank, then
    # this rank's matrices in order.
    # Directions travel in bf16: orthogonalize casts its input to bf16 before anything else, so
    # casting before sending gives the same bits for half the bytes.
    dtype = DIRECTION_DTYPE
    outgoing: list[list[Tensor]] = [[] for _ in range(world)]
    for matrix, owner in zip(matrices, owners, strict=True):
        outgoing[owner].append(matrix.direction)
    incoming = [[matrices[i].placement.ranges[source][1] * matrices[i].shape[1] for i in mine] for source in range(world)]
    received = _all_to_all(outgoing, incoming, dtype, device, group)
    wholes = {i: torch.empty(matrices[i].shape, dtype=dtype, device=device) for i in mine}
    for source in range(world):
        for i, piece in zip(mine, received[source], strict=True):
            offset, length = matrices[i].placement.ranges[source]
            wholes[i][offset: offset + length] = piece.view(length, matrices[i].shape[1])

    # Updates: the owner sends each rank its rows. Received: by owner, then matrices in order.
    outgoing = [[] for _ in range(world)]
    for i in mine:
        update = matrices[i].orthogonalize(wholes[i])
        for target, (offset, length) in enumerate(matrices[i].placement.ranges):
            outgoing[target].append(update[offset: offset + length])
    incoming = [[m.direction.numel() for m, owner in zip(matrices, owners, strict=True) if owner == source]
                for source in range(world)]
    received = _all_to_all(outgoing, incoming, UPDATE_DTYPE, device, group)
    updates: list[Tensor] = [torch.empty(0)] * len(matrices)
    for source in range(world):
        owned = [i for i, owner in enumerate(owners) if owner == source]
        for i, piece in zip(owned, received[source], strict=True):
            updates[i] = piece.view_as(matrices[i].direction)
    return updates


def _all_to_all(outgoing: list[list[Tensor]], incoming: list[list[int]], dtype: torch.dtype,
                device: torch.device, group) -> list[list[Tensor]]:
    """Send ``outgoing[r]`` (tensors) to rank r and receive, from each rank r, flat pieces of
    ``incoming[r]`` (element counts): one all_to_all_single with uneven splits (gloo: alltoallv)."""
    send_counts = [sum(t.numel() for t in tensors) for tensors in outgoing]
    send = torch.empty(sum(send_counts), dtype=dtype, device=device)
    start = 0
    for tensors in outgoing:
        for tensor in tensors:
            send[start: start + tensor.numel()].view(tensor.shape).copy_(tensor)  # casts, and packs strided views
            start += tensor.numel()
    recv_counts = [sum(counts) for counts in incoming]
    recv = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    pieces, start = [], 0
    for counts in incoming:
        pieces.append([])
        for count in counts:
            pieces[-1].append(recv[start: start + count])
            start += count
    return pieces

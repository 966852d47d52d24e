"""Newton–Schulz for matrices whose rows FSDP spreads over ranks: one owner per matrix.

Every rank plans the same owners (``plan_owners``: Newton–Schulz work balanced over the ranks),
once for as long as the matrices keep their placements and shapes (``ExchangePlans``: an
optimizer keeps one). Then, per set of ranks, two collectives serve every matrix of the step at once: one
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

from hyperparallel import traffic
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


class ExchangePlans:
    """The plans of one optimizer's exchanges, kept across steps: who owns which matrix, what each
    rank sends and receives, and where each piece goes, are decided by the matrices' placements
    and shapes alone, which do not change from step to step. Made again when the key, per
    matrix (placement object, shape, device), changes: another set of parameters, or the same
    ones reshaped or moved. The placements are kept with the key, so their ids stay theirs."""

    def __init__(self):
        self._key: tuple | None = None
        self._placements: list[ShardPlacement] = []
        self._plans: list[_Exchange] = []

    def plans(self, matrices: Sequence[ShardedMatrix]) -> list[_Exchange]:
        key = tuple((id(m.placement), m.direction.shape, m.direction.device) for m in matrices)
        if key != self._key:
            self._plans = [_Exchange(matrices, indices) for indices in _by_ranks(matrices).values()]
            self._key, self._placements = key, [m.placement for m in matrices]
        return self._plans


def orthogonalize_sharded(matrices: Sequence[ShardedMatrix], plans: ExchangePlans | None = None) -> list[Tensor]:
    """This rank's rows of each matrix's update (UPDATE_DTYPE, shaped like its direction), in order.

    A collective: every rank of each process group involved calls it with the same matrices in
    the same order (what the same model and optimizer on every rank give). Matrices sharded over
    the same ranks share one plan and one pair of collectives, even across process group objects.
    `plans`: an optimizer's ExchangePlans, to plan once for many steps (else planned here).
    """
    updates: list[Tensor] = [torch.empty(0)] * len(matrices)
    for plan in (plans or ExchangePlans()).plans(matrices):
        for index, update in zip(plan.indices, plan.exchange(matrices), strict=True):
            updates[index] = update
    return updates


def _by_ranks(matrices: Sequence[ShardedMatrix]) -> dict[tuple, list[int]]:
    """Indices of the matrices sharded over each set of ranks (global ranks in group-rank order)."""
    groups: dict[tuple, list[int]] = {}
    for index, matrix in enumerate(matrices):
        ranks = tuple(dist.get_process_group_ranks(matrix.placement.process_group or dist.group.WORLD))
        groups.setdefault((ranks, matrix.direction.device), []).append(index)
    return groups


class _Exchange:
    """The exchange of the matrices sharded over one set of ranks (`indices` into the step's
    matrices), planned once: every count, split and order below depends on placements and shapes
    only, so a step's exchange is two collectives, a few whole-buffer operations and one foreach
    copy, with no planning."""

    def __init__(self, matrices: Sequence[ShardedMatrix], indices: list[int]):
        ours = [matrices[i] for i in indices]
        first = ours[0].placement
        self.indices, self.group, world, rank = indices, first.process_group, len(first.ranges), first.rank
        self.owners = plan_owners([newton_schulz_cost(*m.shape) for m in ours], world)
        self.mine = [k for k, owner in enumerate(self.owners) if owner == rank]
        ranges = [m.placement.ranges for m in ours]
        cols = [m.shape[1] for m in ours]

        # Directions: every rank's rows of matrix k go to owners[k], in matrix order. Received: by
        # source rank, then this rank's matrices in order; copied into each owned matrix whole
        # (rows in source order), piece j of the wholes from received piece permutation[j].
        self.send_order = sorted(range(len(ours)), key=lambda k: self.owners[k])  # (a stable sort)
        self.send_counts = [sum(m.direction.numel() for m, owner in zip(ours, self.owners, strict=True)
                                if owner == target) for target in range(world)]
        received = [(source, k) for source in range(world) for k in self.mine]
        self.recv_sizes = [ranges[k][source][1] * cols[k] for source, k in received]
        self.recv_counts = [sum(ranges[k][source][1] * cols[k] for k in self.mine) for source in range(world)]
        position = {piece: j for j, piece in enumerate(received)}
        wholes = [(source, k) for k in self.mine for source in range(world)]
        self.whole_sizes = [ranges[k][source][1] * cols[k] for source, k in wholes]
        self.permutation = [position[piece] for piece in wholes]
        self.whole_shapes = [ours[k].shape for k in self.mine]

        # Updates: each owner sends every rank its rows, by target rank, then owned matrices in
        # order. Received: by owner, then matrices in order (this rank's rows of each).
        self.update_splits = [[length * cols[k] for _, length in ranges[k]] for k in self.mine]
        self.update_send_counts = [sum(ranges[k][target][1] * cols[k] for k in self.mine) for target in range(world)]
        self.update_order = [k for source in range(world) for k, owner in enumerate(self.owners) if owner == source]
        self.update_recv_sizes = [ours[k].direction.numel() for k in self.update_order]
        self.update_recv_counts = [sum(ours[k].direction.numel() for k, owner in enumerate(self.owners)
                                       if owner == source) for source in range(world)]

    def exchange(self, matrices: Sequence[ShardedMatrix]) -> list[Tensor]:
        """orthogonalize_sharded for this plan's matrices: their updates, in the plan's order."""
        ours = [matrices[i] for i in self.indices]
        device = ours[0].direction.device
        # Directions travel in bf16: orthogonalize casts its input to bf16 before anything else, so
        # casting before sending gives the same bits for half the bytes.
        send = _packed([ours[k].direction for k in self.send_order], sum(self.send_counts), DIRECTION_DTYPE, device)
        recv = torch.empty(sum(self.recv_counts), dtype=DIRECTION_DTYPE, device=device)
        traffic.all_to_all("dp_shard", send, self.send_counts, self.group)
        dist.all_to_all_single(recv, send, self.recv_counts, self.send_counts, group=self.group)
        wholes_flat = torch.empty(sum(self.whole_sizes), dtype=DIRECTION_DTYPE, device=device)
        if self.mine:
            pieces = recv.split_with_sizes(self.recv_sizes)
            torch._foreach_copy_(list(wholes_flat.split_with_sizes(self.whole_sizes)),
                                 [pieces[j] for j in self.permutation])
        wholes = wholes_flat.split_with_sizes([rows * cols for rows, cols in self.whole_shapes])

        by_target: list[list[Tensor]] = [[] for _ in self.update_send_counts]
        for k, whole, shape, split in zip(self.mine, wholes, self.whole_shapes, self.update_splits, strict=True):
            update = ours[k].orthogonalize(whole.view(shape))
            for target, rows in enumerate(update.reshape(-1).split_with_sizes(split)):
                by_target[target].append(rows)
        send = _packed([rows for rows_of in by_target for rows in rows_of], sum(self.update_send_counts),
                       UPDATE_DTYPE, device)
        recv = torch.empty(sum(self.update_recv_counts), dtype=UPDATE_DTYPE, device=device)
        traffic.all_to_all("dp_shard", send, self.update_send_counts, self.group)
        dist.all_to_all_single(recv, send, self.update_recv_counts, self.update_send_counts, group=self.group)
        updates: list[Tensor] = [torch.empty(0)] * len(ours)
        for k, piece in zip(self.update_order, recv.split_with_sizes(self.update_recv_sizes), strict=True):
            updates[k] = piece.view_as(ours[k].direction)
        return updates


def _packed(tensors: list[Tensor], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The tensors' elements one after another in one flat buffer of `dtype` (one cat, which casts)."""
    out = torch.empty(numel, dtype=dtype, device=device)
    if tensors:
        torch.cat([t.reshape(-1) for t in tensors], out=out)
    return out

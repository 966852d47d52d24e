"""A group's flat communication buffers, the views its copies use, and the two collectives.

Both collectives move a [world, slot] buffer in which every rank has a slot of the same padded
length. The all-gather's is bytes (`GatherViews`): this rank's pieces (gather.py: each
parameter's values in its full copy's dtype, or a codec's encoding of its shard) go into its
slot and, once every rank's slot has arrived, every rank's parts into the full parameters (or
the codec's pieces). The reduce-scatter's is the reduce dtype's (`FlatLayout`, `ReduceViews`):
every gradient, zero-padded.

[Note: views made once per group] Every view those copies read or write is made once per group,
not per collective: the buffers are kept (`CommBuffer`: their bytes freed between uses, the
tensors and their views kept), and a parameter's elements on a run of ranks holding equal
shards (`gather.Run`) are one strided view, so the copies are one foreach call over a list built
once, a few entries per parameter whatever the number of ranks. What is made per call is what
must be: the gradients' reshapes (autograd gives new tensors) and the shards' `.grad` views of
a fresh reduce-scatter output (the optimizer keeps them until the next step), and a codec's
pieces (new tensors each gather, which its decoded copies keep: the views into them with them). The views are made
again only when what they depend on changes: the dtype or device a buffer is wanted in, or
another storage under a full parameter (param.py, [Note: views of a freed storage]).

Every buffer is on the full parameters' device, so the collectives run where the group's
backend can ([Note: device-correct collectives], train/distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyperparallel import traffic
from hyperparallel.fsdp.gather import Piece
from hyperparallel.fsdp.param import ShardedParam


class FlatLayout:
    """Where each parameter's elements sit in a flat [world, slot] communication buffer: rank r's
    slot holds, parameter after parameter, that parameter's elements on rank r followed by zeros
    up to its padded length. Shapes and ranks never change, so a group builds this once."""

    def __init__(self, params: list[ShardedParam], world: int, rank: int):
        self.params, self.world, self.rank = params, world, rank
        self.bases, base = [], 0  # where each parameter begins in a slot
        for p in params:
            self.bases.append(base)
            base += p.slot_numel
        self.slot = base

    def rank_views(self, buffer: torch.Tensor) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Views of a [world, slot] buffer: per parameter, its elements on every rank (one view
        shaped `run.shape` per run of ranks holding elements), and every padding piece."""
        data, padding = [], []
        for p, base in zip(self.params, self.bases, strict=True):
            data.append([])
            for run in p.runs:
                ranks = buffer[run.first: run.first + run.count]
                if run.numel:
                    data[-1].append(ranks[:, base: base + run.numel].view(run.shape))
                if run.numel < p.slot_numel:
                    padding.append(ranks[:, base + run.numel: base + p.slot_numel])
        return data, padding

    def local_places(self) -> list[tuple[torch.Size, tuple[int, ...], int]]:
        """(shape, stride, offset) of each parameter's shard in this rank's [slot] buffer."""
        return [(p.shard.shape, _contiguous_strides(p.shard.shape), base)
                for p, base in zip(self.params, self.bases, strict=True)]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class CommBuffer:
    """A communication buffer whose bytes exist only while a collective uses them: its storage is
    freed (resized to 0) after use and allocated again before the next, so views of it made once
    stay valid (param.py, [Note: views of a freed storage]). Made with its bytes, so that views
    are made of a storage that has them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(shape, dtype=dtype, device=device)
        self.flat = self.tensor.view(-1)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def allocate(self) -> None:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)


class GatherViews:
    """An all-gather's byte buffers and the views its copies use ([Note: views made once per
    group]): per piece (gather.py), this rank's part in `local`, flat in the piece's dtype, and
    every rank's parts in `gathered`, one view per run of ranks holding equal parts, in the
    pieces' order. Pieces start on 16-byte boundaries, so any dtype's view of them is aligned."""

    def __init__(self, pieces: list[Piece], world: int, rank: int, device: torch.device):
        self.pieces = pieces
        slot = sum(piece.slot_nbytes for piece in pieces)
        self.local = CommBuffer((slot,), torch.uint8, device)
        self.gathered = CommBuffer((world, slot), torch.uint8, device)
        self.local_data: list[torch.Tensor] = []
        self.local_padding: list[torch.Tensor] = []
        self.gathered_data: list[torch.Tensor] = []
        base = 0
        for piece in pieces:
            size, nbytes = piece.itemsize, piece.rank_numels[rank] * piece.itemsize
            self.local_data.append(self.local.tensor[base: base + nbytes].view(piece.dtype))
            if nbytes < piece.slot_nbytes:
                self.local_padding.append(self.local.tensor[base + nbytes: base + piece.slot_nbytes])
            for run in piece.runs:  # (the padding is never read)
                if run.numel:
                    ranks = self.gathered.tensor[run.first: run.first + run.count, base: base + run.numel * size]
                    self.gathered_data.append(ranks.view(piece.dtype).view(run.shape))
            base += piece.slot_nbytes

    @torch.no_grad()
    def copy_in(self, sources: list[torch.Tensor]) -> None:
        """This rank's part of every piece (flat; cast to the piece's dtype) into its slot; the
        gathered buffer's bytes allocated for the all-gather to fill."""
        self.local.allocate()
        self.gathered.allocate()
        torch._foreach_copy_(self.local_data, sources)
        if self.local_padding:  # never read, but never uninitialized bytes on the wire
            torch._foreach_zero_(self.local_padding)

    @torch.no_grad()
    def copy_out(self, destinations: list[torch.Tensor]) -> None:
        """Every rank's parts into the destinations' run views (a parameter's `full_runs`, or a
        codec's pieces); the buffers' bytes freed."""
        self.local.free()
        torch._foreach_copy_(destinations, self.gathered_data)
        self.gathered.free()

    def free(self) -> None:
        self.local.free()
        self.gathered.free()


class ReduceViews:
    """A reduce-scatter's [world, slot] input and the views its copies use ([Note: views made
    once per group]): per parameter, the runs' views its gradient goes into; the padding, zeroed
    for every reduce; where each shard's gradient lies in the output."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.key = (dtype, device)
        self.slot = layout.slot
        self.flat = CommBuffer((layout.world, layout.slot), dtype, device)
        self.data, self.padding = layout.rank_views(self.flat.tensor)
        # How each gradient is cut to match: a parameter held by one run of ranks (one whose rows
        # divide evenly) goes in as one reshaped view, `whole`; any other is split by the runs'
        # sizes, the pieces of runs of two or more ranks viewed as [ranks, elements], `split`.
        self.whole: list[tuple[int, ...] | None] = []
        self.split: list[tuple[list[int], list[tuple[int, ...] | None]] | None] = []
        for p in layout.params:
            held = [run for run in p.runs if run.numel]
            one = len(held) == 1
            self.whole.append(held[0].shape if one else None)
            self.split.append(None if one else ([run.count * run.numel for run in held],
                                                [run.shape if run.count > 1 else None for run in held]))
        self.out_places = layout.local_places()

    @torch.no_grad()
    def copy_in(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The gradients (None: zeros) into the input buffer, whose bytes are allocated here;
        returns it flat, for the reduce-scatter."""
        self.flat.allocate()
        into, pieces, zeros = [], [], list(self.padding)
        for grad, runs, whole, split in zip(grads, self.data, self.whole, self.split, strict=True):
            if grad is None:
                zeros += runs
                continue
            into += runs
            if whole is not None:
                pieces.append(grad.reshape(whole))
            else:
                sizes, shapes = split
                cut = grad.reshape(-1).split_with_sizes(sizes)
                pieces += [piece if shape is None else piece.view(shape) for piece, shape in zip(cut, shapes, strict=True)]
        if into:
            torch._foreach_copy_(into, pieces)
        if zeros:
            torch._foreach_zero_(zeros)
        return self.flat.flat

    def shard_grads(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Each shard's gradient, as a view of the reduce-scatter's output `out` (the input
        buffer's bytes are freed: the reduce is done)."""
        self.flat.free()
        return [out.as_strided(shape, stride, offset) for shape, stride, offset in self.out_places]


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group, dimension: str):
    traffic.reduce_scatter(dimension, flat, group)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(out, flat, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group, dimension: str):
    """Sum `tensor` over `group` in place (HSDP: a reduce-scatter's output over the replicas)."""
    traffic.all_reduce(dimension, tensor, group)
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_gather(gathered: torch.Tensor, local: torch.Tensor, group, dimension: str):
    traffic.all_gather(dimension, local, group)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(gathered, local, group=group, async_op=True)

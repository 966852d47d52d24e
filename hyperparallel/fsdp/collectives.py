"""A group's flat communication buffers, the views its copies use, and the two collectives.

All of a group's parameters share one flat layout in which every rank has a slot of the same
padded length (`FlatLayout`). The all-gather copies the local shards into this rank's slot and,
once every rank's slot has arrived, the slots' valid elements into the full parameters; the
reduce-scatter's input is every gradient, zero-padded, in the same [world, slot] layout.

[Note: views made once per group] Every view those copies read or write is made once per group,
not per collective: the buffers are kept (`CommBuffer`: their bytes freed between uses, the
tensors and their views kept), and a parameter's elements on a run of ranks holding equal
shards (`param.Run`) are one strided view, so the copies are one foreach call over a list built
once, a few entries per parameter whatever the number of ranks. What is made per call is what
must be: the gradients' reshapes (autograd gives new tensors) and the shards' `.grad` views of
a fresh reduce-scatter output (the optimizer keeps them until the next step). The views are made
again only when what they depend on changes: the dtype or device a buffer is wanted in, or
another storage under a full parameter (param.py, [Note: views of a freed storage]).

Every buffer is on the full parameters' device, so the collectives run where the group's
backend can ([Note: device-correct collectives], train/distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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

    def local_views(self, buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of this rank's [slot] buffer: each parameter's elements, shaped like its shard,
        and every padding piece."""
        data, padding = [], []
        for p, base in zip(self.params, self.bases, strict=True):
            numel = p.rank_numels[self.rank]
            data.append(buffer[base: base + numel].view(p.shard.shape))
            if numel < p.slot_numel:
                padding.append(buffer[base + numel: base + p.slot_numel])
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
    """An all-gather's buffers and the views its copies use ([Note: views made once per group]):
    the shards go into `local`'s views, shaped like the shards; `gathered`'s views go out into
    the full parameters' run views (`ShardedParam.full_runs`), in the same order."""

    def __init__(self, layout: FlatLayout, dtype: torch.dtype, device: torch.device):
        self.key = (dtype, device)
        self.local = CommBuffer((layout.slot,), dtype, device)
        self.gathered = CommBuffer((layout.world, layout.slot), dtype, device)
        self.local_data, self.local_padding = layout.local_views(self.local.tensor)
        data, _ = layout.rank_views(self.gathered.tensor)  # (the padding is never read)
        self.gathered_data = [view for views in data for view in views]

    @torch.no_grad()
    def copy_in(self, shards: list[torch.Tensor]) -> None:
        """This rank's shards into its slot (cast to the buffers' dtype); the gathered buffer's
        bytes allocated for the all-gather to fill."""
        self.local.allocate()
        self.gathered.allocate()
        torch._foreach_copy_(self.local_data, shards)
        if self.local_padding:  # never read, but never uninitialized bytes on the wire
            torch._foreach_zero_(self.local_padding)

    @torch.no_grad()
    def copy_out(self, full_runs: list[torch.Tensor]) -> None:
        """Every rank's elements into the full parameters' run views; the buffers' bytes freed."""
        self.local.free()
        torch._foreach_copy_(full_runs, self.gathered_data)
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


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(out, flat, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group):
    """Sum `tensor` over `group` in place (HSDP: a reduce-scatter's output over the replicas)."""
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_gather(gathered: torch.Tensor, local: torch.Tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(gathered, local, group=group, async_op=True)

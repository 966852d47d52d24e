"""FSDPGroup: the parameters of one sharded module, which travel together, and its lifecycle.

All of a group's parameters share one flat buffer in which every rank has a slot of the same
padded length (collectives.py): the local shards are copied into this rank's slot, one
all-gather fills every rank's, and views of it with the padding stripped are copied into the
full parameters. Gradients go the other way: zero-padded into one [world, slot] buffer, one
reduce-scatter (sum, then a divide by gradient_divide_factor: gloo's AVG is unreliable), and
each rank keeps its valid rows as its shards' `.grad`. Every copy is one foreach op over the
whole group, over views made once ([Note: views made once per group], collectives.py).

[Note: settled in backward's order] A group's reduce-scatter is settled (waited, its input, the
layer's whole gradients, freed, its output divided and landed in the shards' grads) when the
next group of the same root launches its own (its reduce-scatter has had a block's backward to
finish; `PrefetchSchedule.chain_reduce`), or at the end of backward for the last: no rank holds
more than a layer or two of whole gradients at once, whatever the model's depth.

[Note: HSDP gradients] With a replicate group (HSDP), the same shards live on one rank of each
replica. A group's gradients are reduce-scattered within its shard group, divided once by
gradient_divide_factor (every replica's ranks: the shard group's size x the replicas'), then
summed across the replicas by one all-reduce of the reduce-scatter's output, in place, launched
when the reduce-scatter is settled (above): so it overlaps the rest of backward. Launch points are
fixed by the order of backward, never by timing, so every replica issues the all-reduces in one
order. The wait before it is a stream wait on CUDA (no host sync); on the CPU it blocks until
the reduce-scatter, which a block's backward has usually outlasted, is done.
"""

from __future__ import annotations

import enum
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import versions
from hyperparallel.fsdp.collectives import (
    FlatLayout,
    GatherViews,
    ReduceViews,
    all_gather,
    all_reduce,
    reduce_scatter,
)
from hyperparallel.fsdp.gather import PURPOSES, Piece
from hyperparallel.fsdp.param import MixedPrecision, ShardedParam

if TYPE_CHECKING:
    from hyperparallel.fsdp.schedule import PrefetchSchedule

_GROUP = "_hp_fsdp_group"  # the attribute of a sharded module that holds its FSDPGroup
# the mesh dimensions a group's collectives run over, as the traffic counter names them
SHARD_DIMENSION, REPLICA_DIMENSION = "dp_shard", "dp_replicate"


def _run_views(flat: torch.Tensor, piece: Piece) -> list[torch.Tensor]:
    """Views of a whole piece, one per run of ranks holding elements, that its gathered parts go into."""
    return [flat[run.start: run.start + run.count * run.numel].view(run.shape) for run in piece.runs if run.numel]


class GroupState(enum.Enum):
    """Where a group's full parameters are, from one step's forward to the end of its backward.
    The moves between states are _TRANSITIONS, below; after __init__, FSDPGroup._become is the only writer."""

    # the module holds the shards; the full parameters have no storage
    SHARDED = "sharded"
    # gathered for forward; kept until backward is done unless freed after forward
    UNSHARDED = "unsharded"
    # freed after forward: the module keeps the full parameters (autograd saved them) with no
    # storage, and backward reaching the module's outputs gathers them again
    RESHARDED_AFTER_FORWARD = "resharded after forward"
    # gathered again for backward: a recompute's forward inside backward must not free it
    UNSHARDED_FOR_BACKWARD = "unsharded for backward"
    # gradients reduced (or kept, without sync) and shards back in the module, until the backward
    # pass ends: no second reduce, no prefetch for backward
    BACKWARD_DONE = "backward done"


_S = GroupState
# Every transition a group makes; staying in a state is not a transition (the caller returns early).
_TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    _S.SHARDED: frozenset({
        _S.UNSHARDED,  # forward begins
        _S.UNSHARDED_FOR_BACKWARD,  # backward of an earlier forward, after a no-grad forward resharded it
    }),
    _S.UNSHARDED: frozenset({
        _S.SHARDED,  # a no-grad forward ends
        _S.RESHARDED_AFTER_FORWARD,  # forward ends, reshard_after_forward (the root never frees)
        _S.UNSHARDED_FOR_BACKWARD,  # backward reaches an earlier forward's outputs while a later one has it gathered
        _S.BACKWARD_DONE,  # backward is done (reshard_after_forward=False, or the root)
    }),
    _S.RESHARDED_AFTER_FORWARD: frozenset({
        _S.UNSHARDED,  # another forward before backward (another micro-batch, or a recompute)
        _S.UNSHARDED_FOR_BACKWARD,  # backward reaches the module's outputs
    }),
    _S.UNSHARDED_FOR_BACKWARD: frozenset({
        _S.SHARDED,  # a no-grad forward ends (a group that is never done: every parameter frozen)
        _S.BACKWARD_DONE,  # every gradient is final, or the backward pass ends
    }),
    _S.BACKWARD_DONE: frozenset({
        _S.SHARDED,  # the backward pass ends
    }),
}
_UNSHARDED = frozenset({_S.UNSHARDED, _S.UNSHARDED_FOR_BACKWARD})
# Only in a pipeline stage (fsdp.run_as_pipeline_stage), whose schedule runs several forwards
# before their backwards: gradients that needed none of the parameters' values, arriving by a path
# that passed none of the module's outputs (the first stage's embedding, whose output went on
# through the stage's layers, not out of the model), in a group still freed after its forward or
# already resharded by another micro-batch's backward pass. Elsewhere they are a second backward
# over a graph whose gradients were reduced: an error, not a second reduce.
_PIPELINE_TRANSITIONS = frozenset({(_S.SHARDED, _S.BACKWARD_DONE), (_S.RESHARDED_AFTER_FORWARD, _S.BACKWARD_DONE)})


class FSDPGroup:
    def __init__(self, module: nn.Module, group, geometry: str, align: int, reshard_after_forward: bool,
                 mp_policy: MixedPrecision | None = None, gradient_divide_factor: float | None = None,
                 replicate_group=None, replays_forward: bool = False):
        self.module, self.group = module, group
        self.mp = mp_policy or MixedPrecision()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.replicate_group = replicate_group if self.replicas > 1 else None  # HSDP ([Note: HSDP gradients])
        self.gradient_divide_factor = gradient_divide_factor or self.world * self.replicas
        self.geometry, self.align = geometry, align
        self.reshard_after_forward = reshard_after_forward
        self.replays_forward = replays_forward  # recompute inside backward, without the module's hooks
        self.gradient_sync = True  # a user setting (set_requires_gradient_sync), not lifecycle state
        self.params: list[ShardedParam] = []
        self.state = GroupState.SHARDED
        self._gather = None  # (work, views, entries) of a launched all-gather: a prefetch in flight
        self._reduce = None  # (work, out) of a launched reduce-scatter
        self._all_reduce = None  # (work, out) of a launched all-reduce across the replicas (HSDP)
        self._reduce_layout: FlatLayout | None = None  # over the trainable parameters only
        # per set of things gathered together ([Note: what a gather carries]), made on first use
        self._gather_views: dict[tuple, GatherViews] = {}
        self._decoded: set[str] = set()  # the purposes whose codec pieces are here
        self._has_codecs = False
        self._reduce_views: ReduceViews | None = None
        # Per backward pass, not lifecycle: the end-of-backward callback must be queued once per
        # pass, on the first gradient, whichever state the group is in by then (a group can be
        # done with its gradients, or still gathered, when the callback runs).
        self._callback_queued = False
        self._grads_ready = 0
        self.schedule: PrefetchSchedule | None = None  # set by the root: forward order, for prefetching

    @property
    def is_unsharded(self) -> bool:
        return self.state in _UNSHARDED

    def _become(self, state: GroupState) -> None:
        pipelined = self.schedule is not None and self.schedule.pipelined
        if state not in _TRANSITIONS[self.state] and not (pipelined and (self.state, state) in _PIPELINE_TRANSITIONS):
            raise RuntimeError(
                f"FSDP group of {type(self.module).__name__}: cannot go from {self.state.value!r} to {state.value!r} "
                f"(was the module run again after its gradients were reduced in the same backward?)"
            )
        self.state = state

    # ---------------------------------------------------------------------------- sharding

    def shard(self, params: list[tuple[list[tuple[nn.Module, str]], nn.Parameter]],
              device: torch.device | None = None) -> None:
        """Replace each parameter by this rank's shard (meta parameters: a shard of `device` memory)."""
        for places, param in params:
            sharded = ShardedParam.of(places, param, self.group, self.rank, self.world, self.geometry, self.align,
                                      self.mp.param_dtype, device, self.replicate_group, self.replicas)
            self.params.append(sharded)
            sharded.put(sharded.shard)
            param._hp_replaced_by_shard = True  # an optimizer still holding it was built too early
            if sharded.full.requires_grad:
                sharded.full.register_post_accumulate_grad_hook(self._on_grad)
        # Which parameters get gradients is fixed here, as is the count _on_grad waits for.
        self._has_codecs = any(p.codec is not None for p in self.params)
        trainable = [p for p in self.params if p.full.requires_grad]
        self._reduce_layout = FlatLayout(trainable, self.world, self.rank) if trainable else None

    # -------------------------------------------------------------------------- all-gather

    # [Note: what a gather carries] A parameter without a codec is gathered as its values (in its
    # full copy's dtype), once per unshard: forward and backward use the same full Parameter. A
    # parameter with a codec (gather.py; MXFP8 weights) is gathered as the pieces a purpose needs:
    # "forward" when forward gathers (and "backward" too for a group that is not freed after
    # forward, the root), "backward" when backward gathers it again, and "forward" once more if a
    # recompute runs the module's forward inside backward: with the backward gather when the
    # group's own forward is replayed without its hooks (`replays_forward`: the trainer's
    # recompute of a decoder layer), or when its forward hook sees a forward in backward (a
    # recomputed module nested in it). Each purpose's pieces stay until the group frees its full
    # parameters.

    def _forward_purposes(self) -> tuple[str, ...]:
        root = self.schedule is not None and self.schedule.root is self
        kept = root or not self.reshard_after_forward  # (until backward: its pieces too)
        return PURPOSES if kept and torch.is_grad_enabled() else ("forward",)

    def backward_purposes(self) -> tuple[str, ...]:
        return PURPOSES if self.replays_forward else ("backward",)

    def _entries(self, purposes: tuple[str, ...], values: bool) -> tuple[tuple[int, str | None], ...]:
        """(parameter's index, purpose) of everything one gather carries: its values (None), if
        `values`, for a parameter without a codec; each purpose's pieces for one with a codec."""
        entries = []
        for i, p in enumerate(self.params):
            if p.codec is None:
                if values:
                    entries.append((i, None))
            else:
                entries += [(i, purpose) for purpose in purposes if purpose not in self._decoded]
        return tuple(entries)

    def start_unshard(self, purposes: tuple[str, ...] | None = None, values: bool = True) -> None:
        """Launch an all-gather without waiting for it (a prefetch); unshard() finishes it.
        `purposes`: what the codecs' parameters are gathered for (default: a forward's)."""
        if self._gather is not None or (values and self.is_unsharded):
            return
        purposes = purposes or self._forward_purposes()
        entries = self._entries(purposes, values)
        if not entries:
            return
        views = self._gather_views.get(entries)
        if views is None:
            pieces = [piece for i, purpose in entries for piece in self.params[i].pieces(purpose)]
            views = self._gather_views[entries] = GatherViews(pieces, self.world, self.rank,
                                                              self.params[0].shard.device)
        sources = []
        for i, purpose in entries:
            p = self.params[i]
            if purpose is None:
                sources.append(p.shard.view(-1))
                p.sent_version = (p.shard._version, versions.generation(p.shard))
            else:
                sources += p.codec.encode(purpose, p.shard.detach())
        views.copy_in(sources)
        self._gather = (all_gather(views.gathered.flat, views.local.tensor, self.group, SHARD_DIMENSION), views,
                        entries, purposes)

    def unshard(self, for_backward: bool = False) -> None:
        """Fill the full parameters and put them in the module (a no-op if they are there, but for
        a codec's pieces the purpose needs: [Note: what a gather carries])."""
        purposes = self.backward_purposes() if for_backward else self._forward_purposes()
        if self.is_unsharded:
            if for_backward and self.state is GroupState.UNSHARDED:
                self._become(GroupState.UNSHARDED_FOR_BACKWARD)
            if self._has_codecs and not self._decoded >= set(purposes):
                self.drop_prefetch()
                self.start_unshard(purposes, values=False)
                self._finish_gather()
            return
        if self._gather is not None and self._has_codecs and not set(self._gather[3]) >= set(purposes):
            self.drop_prefetch()  # prefetched for another purpose
        self.start_unshard(purposes)
        self._finish_gather()
        for p in self.params:
            p.put(p.full)
        self._become(GroupState.UNSHARDED_FOR_BACKWARD if for_backward else GroupState.UNSHARDED)

    def _finish_gather(self) -> None:
        """Wait for the launched all-gather and copy what it brought where it goes."""
        if self._gather is None:  # (nothing to gather: a group of codec parameters already decoded)
            return
        work, views, entries, _ = self._gather
        self._gather = None
        work.wait()
        destinations, decoded, same = [], [], []
        for i, purpose in entries:
            p = self.params[i]
            if purpose is not None:
                specs = p.pieces(purpose)
                pieces = [torch.empty(spec.numel, dtype=spec.dtype, device=p.shard.device) for spec in specs]
                destinations += [view for piece, spec in zip(pieces, specs, strict=True) for view in _run_views(piece, spec)]
                decoded.append((p, purpose, pieces))
                continue
            full = p.full
            storage = full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(p.full_nbytes)
            # Gathering the same values again (for backward, or the next micro-batch) must not look
            # like an in-place change to autograd: saved tensors of an earlier forward refer to this
            # storage and are meant to see them. New values (after an optimizer step or a
            # checkpoint load) bump its generation, so caches of copies derived from it (MXFP8
            # weight copies) start over.
            if p.sent_version == p.gathered_version:
                same.append(full)
            destinations += p.full_runs()
        keep_versions = torch.autograd._unsafe_preserve_version_counter(tuple(same)) if same else nullcontext()
        with keep_versions:
            views.copy_out(destinations)
        for i, purpose in entries:
            p = self.params[i]
            if purpose is None:
                if p.sent_version != p.gathered_version:
                    versions.bump(p.full)
                p.gathered_version = p.sent_version
        for p, purpose, pieces in decoded:
            p.codec.decoded(purpose, p.full.shape, pieces)
            self._decoded.add(purpose)

    def drop_prefetch(self) -> None:
        """Forget an all-gather that was prefetched but not used: the shards may change before the next use."""
        if self._gather is not None:
            work, views, _, _ = self._gather
            self._gather = None
            work.wait()
            views.free()

    def _free_full(self) -> None:
        for p in self.params:
            p.full.untyped_storage().resize_(0)
            if p.codec is not None:
                p.codec.release()
        self._decoded.clear()

    def free_after_forward(self) -> None:
        """Free the full parameters' storage but leave them in the module: autograd saved them,
        and backward gathers them again before it needs them."""
        self._become(GroupState.RESHARDED_AFTER_FORWARD)
        self._free_full()

    def reshard(self) -> None:
        """After a forward without gradients: free the full parameters and put the shards back."""
        self._become(GroupState.SHARDED)
        self._put_shards()

    def _put_shards(self) -> None:
        self._free_full()
        for p in self.params:
            p.put(p.shard)

    # ------------------------------------------------------------------------- reduce-scatter

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        self._grads_ready += 1
        if self._grads_ready == len(self._reduce_layout.params):
            # every gradient of this group is final: reduce now, overlapping the rest of backward
            self._finish_backward()

    def _finish_backward(self) -> None:
        if self.state is GroupState.BACKWARD_DONE:
            return
        self._become(GroupState.BACKWARD_DONE)
        if self.gradient_sync:
            self._start_reduce()
        else:
            self._keep_local_full_grads()
        self._put_shards()

    def _after_backward(self) -> None:
        """End of the whole backward pass: groups with a parameter that got no gradient reduce now,
        and every launched reduce-scatter lands in the shards' grads."""
        self._callback_queued = False
        self._finish_backward()
        self._finish_reduce()
        self._grads_ready = 0
        self._become(GroupState.SHARDED)

    def reduce_accumulated(self) -> None:
        """Reduce what no-sync backward passes accumulated (a no-op where nothing was)."""
        if any(p.accumulated is not None for p in self.params):
            self._start_reduce()
            self._finish_reduce()

    def _reduce_dtype(self) -> torch.dtype:
        return self.mp.reduce_dtype or self.mp.param_dtype or self.params[0].shard.dtype

    def _keep_local_full_grads(self) -> None:
        # no_sync: accumulate the full gradient locally, in the reduce dtype (a bf16 full
        # parameter's gradients would otherwise add up in bf16, as FSDP2 does not); it is
        # reduced with the next synced step
        dtype = self._reduce_dtype()
        for p in self.params:
            if p.full.grad is not None:
                grad = p.full.grad
                p.accumulated = grad.to(dtype) if p.accumulated is None else p.accumulated.add_(grad)
                p.full.grad = None

    def _start_reduce(self) -> None:
        layout = self._reduce_layout
        if layout is None:
            return
        ref = layout.params[0].full
        reduce_dtype = self._reduce_dtype()
        views = self._reduce_views
        if views is None or views.key != (reduce_dtype, ref.device):
            views = self._reduce_views = ReduceViews(layout, reduce_dtype, ref.device)
        grads = []
        for p in layout.params:
            grad = p.full.grad
            if p.accumulated is not None:
                grad = p.accumulated if grad is None else p.accumulated.add_(grad)
                p.accumulated = None
            grads.append(grad)
            p.full.grad = None
        flat = views.copy_in(grads)
        # (a fresh output every time: the shards' grads are views of it until the optimizer is done)
        out = torch.empty(layout.slot, dtype=reduce_dtype, device=ref.device)
        self._reduce = (reduce_scatter(out, flat, self.group, SHARD_DIMENSION), out)
        if self.schedule is not None:
            self.schedule.chain_reduce(self)

    def settle_reduce_scatter(self) -> None:
        """Once the reduce-scatter is done: its input freed (a whole layer's gradients: no rank
        keeps them past the next group's backward), its output divided and landed in the shards'
        grads, or with HSDP launched into the sum across the replicas ([Note: HSDP gradients]);
        a no-op without a reduce-scatter in flight."""
        if self._reduce is None:
            return
        work, out = self._reduce
        self._reduce = None
        work.wait()
        self._reduce_views.flat.free()
        out.div_(self.gradient_divide_factor)
        if self.replicate_group is not None:
            self._all_reduce = (all_reduce(out, self.replicate_group, REPLICA_DIMENSION), out)
        else:
            self._land_grads(out)

    def _finish_reduce(self) -> None:
        self.settle_reduce_scatter()  # (unless the next group's reduce-scatter settled it)
        if self._all_reduce is not None:
            work, out = self._all_reduce
            self._all_reduce = None
            work.wait()
            self._land_grads(out)

    def _land_grads(self, out: torch.Tensor) -> None:
        """The reduced gradients into the shards' `.grad` (views of `out`, or added to what is there)."""
        layout = self._reduce_layout
        dtype = layout.params[0].shard.dtype  # (the group's shards share one: fully_shard checks)
        if out.dtype != dtype:
            out = out.to(dtype)
        into, adds = [], []
        # views: `out` is the grads plus short-shard padding only
        for p, g in zip(layout.params, self._reduce_views.shard_grads(out), strict=True):
            if p.shard.grad is None:
                p.shard.grad = g
            else:
                into.append(p.shard.grad)
                adds.append(g)
        if into:
            torch._foreach_add_(into, adds)

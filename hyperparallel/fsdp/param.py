"""A sharded parameter: each rank keeps only its rows (dim 0) of it, as a Parameter of its own.

Between steps the module holds the shard, so `module.parameters()` yields shards and an
optimizer built after sharding updates only local rows. During forward and backward the module
holds the full Parameter in its place instead: the same object every step, its storage freed
(resized to 0) when not in use and refilled by the group's all-gather, so autograd and hooks
that refer to it keep working.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.fsdp.gather import GatherCodec, Piece, Run, codec_align, runs_of
from hyperparallel.fsdp.geometry import ShardInfo, padded_rows, shard_of, shard_ranges

# The shard tag: on a Parameter that holds a part of a larger tensor along dim 0, that part's place
# in the whole (its ShardInfo). Set by fully_shard on its shards, and by `parallel` on the parts it
# keeps (a TP rank's rows, an EP rank's experts) before FSDP shards within them; read by
# checkpoints to place each rank's rows. Other packages go through shard_info / set_shard_info.
SHARD_INFO_ATTRIBUTE = "_hp_shard_info"


def shard_info(param: nn.Parameter) -> ShardInfo:
    """Where `param`'s rows sit in the whole tensor; all of it for an untagged parameter."""
    info = getattr(param, SHARD_INFO_ATTRIBUTE, None)
    if info is None:
        return ShardInfo(param.shape, 0, param.shape[0] if param.dim() else 1)
    return info


def set_shard_info(param: nn.Parameter, info: ShardInfo) -> None:
    """Tag `param` as rows [info.offset, info.offset + info.length) of a tensor of info.global_shape."""
    setattr(param, SHARD_INFO_ATTRIBUTE, info)


# Two more tags a parameter may carry before fully_shard, set by the packages that know how the
# parameter is read (fsdp does not): that its full copy keeps its own dtype whatever the group's
# MixedPrecision says, and a codec that gathers it in another form (gather.py).
_KEEP_DTYPE_ATTRIBUTE = "_hp_keep_dtype"
_CODEC_ATTRIBUTE = "_hp_gather_codec"


def keep_param_dtype(param: nn.Parameter) -> None:
    """Gather `param` in its own dtype, not MixedPrecision's param_dtype: for a parameter the model
    reads in elementwise operations or on purpose in float32 (a norm's weight, a router's)."""
    setattr(param, _KEEP_DTYPE_ATTRIBUTE, True)


def keeps_dtype(param: nn.Parameter) -> bool:
    return getattr(param, _KEEP_DTYPE_ATTRIBUTE, False)


def set_gather_codec(param: nn.Parameter, codec: GatherCodec) -> None:
    """Gather `param` as what `codec` encodes from each rank's shard (gather.py) instead of its values."""
    setattr(param, _CODEC_ATTRIBUTE, codec)


def gather_codec(param: nn.Parameter) -> GatherCodec | None:
    return getattr(param, _CODEC_ATTRIBUTE, None)


# MixedPrecision lives here rather than in api.py: it decides the dtype of a sharded parameter's
# full copy (and of the gradient reduction), which the group reads; api.py only re-exports it.
@dataclass(frozen=True)
class MixedPrecision:
    """Shards (and the optimizer's master weights) keep their own dtype; forward and backward run
    on full parameters in `param_dtype`, and gradients are reduced in `reduce_dtype` (default:
    param_dtype) before landing in the shards' dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ShardPlacement:
    """Where every row of a sharded parameter lives: the process group it is sharded over and
    each group rank's (offset, length) along dim 0, rank 0 first. What an optimizer that needs
    whole matrices (Muon) uses to move shards between ranks."""

    process_group: dist.ProcessGroup | None  # None: the default (world) group
    ranges: tuple[tuple[int, int], ...]
    rank: int  # this process's rank in process_group
    # HSDP: the ranks of the other replicas holding this same shard (None: no replicas), and how
    # many ranks hold it in all (a norm over every rank counts it once: fsdp.clip_grad_norm_)
    replicate_group: dist.ProcessGroup | None = None
    replicas: int = 1


@dataclass
class ShardedParam:
    """One parameter of a group: this rank's shard, the full Parameter that forward and backward
    use in its place, and where each rank's rows go in the group's flat buffers."""

    places: list[tuple[nn.Module, str]]  # where the module holds it (more than one when tied)
    info: ShardInfo
    shard: nn.Parameter
    full: nn.Parameter
    row_numel: int
    slot_rows: int  # rows of every rank's slot in the group's flat buffers: the longest shard
    placement: ShardPlacement
    rank_numels: list[int]  # elements of every rank's shard, rank 0 first: they tile the flattened parameter
    full_nbytes: int  # the full parameter's storage when allocated
    # gathers the parameter as what it encodes (gather.py); None: as its values, in full's dtype
    codec: GatherCodec | None = None
    accumulated: torch.Tensor | None = None  # full gradient kept locally while sync is off
    # the shard's (_version, generation) when its rows last went into an all-gather, and when the
    # full parameter was last filled: equal means the gather brings the same values again
    sent_version: tuple | None = None
    gathered_version: tuple | None = ()
    # views of `full`'s elements, one per run of ranks, for the all-gather's copy-out (see full_runs)
    _full_runs: list[torch.Tensor] = field(default_factory=list, repr=False)
    _full_storage: int | None = field(default=None, repr=False)

    @classmethod
    def of(cls, places: list[tuple[nn.Module, str]], param: nn.Parameter, group, rank: int, world: int,
           geometry: str, align: int, param_dtype: torch.dtype | None,
           device: torch.device | None = None, replicate_group=None, replicas: int = 1) -> ShardedParam:
        """Split `param` into this rank's shard and an empty full Parameter in the compute dtype.

        A parameter on the meta device (a model built without memory) gets a shard of
        uninitialized memory on `device` instead of a copy of its rows: nothing of the whole
        parameter is ever allocated here; the caller fills the shards (init or a checkpoint)."""
        shape = param.shape
        full_2d = param.detach().reshape(shape[0] if param.dim() else 1, -1)  # a 0-d parameter is one row
        # a codec only for a parameter held in one place; its shards fall on the rows it encodes
        # apart (MX blocks along rows: whole 32-row blocks on each rank), unless that pads too much
        codec = gather_codec(param) if len(places) == 1 else None
        aligned = codec_align(codec, shape, world, geometry, align)
        codec, align = (codec, aligned) if aligned is not None else (None, align)
        info = shard_of(shape, rank, world, geometry, align)
        if param.is_meta:
            local = torch.empty(info.length, full_2d.shape[1], dtype=param.dtype, device=device)
        else:
            local = full_2d[info.offset: info.offset + info.length].clone()
        shard = nn.Parameter(local.view(info.length, *shape[1:]) if param.dim() else local.view(-1),
                             requires_grad=param.requires_grad)
        # A parameter that is already a part of a larger one along dim 0 (an expert-parallel
        # rank's experts) records its shard's place in that larger one, for checkpoints.
        outer = getattr(param, SHARD_INFO_ATTRIBUTE, None)
        set_shard_info(shard, info if outer is None else ShardInfo(outer.global_shape, outer.offset + info.offset,
                                                                   info.length))
        placement = ShardPlacement(group, tuple(shard_ranges(info.rows, world, geometry, align)), rank,
                                   replicate_group, replicas)
        shard._hp_shard_placement = placement
        # the full parameter starts without storage (never allocated whole here; the group's
        # all-gather gives it its bytes, [Note: views of a freed storage])
        full_dtype = param.dtype if keeps_dtype(param) else (param_dtype or param.dtype)
        empty = torch.empty(0, dtype=full_dtype, device=local.device)
        full = nn.Parameter(empty.set_(empty.untyped_storage(), 0, shape), requires_grad=param.requires_grad)
        full.untyped_storage().resize_(0)  # (set_ gave the storage the shape's bytes)
        row_numel = full_2d.shape[1]
        return cls(places, info, shard, full, row_numel, padded_rows(info.rows, world, geometry, align), placement,
                   [length * row_numel for _, length in placement.ranges], full.numel() * full.element_size(),
                   codec=codec)

    def pieces(self, purpose: str | None) -> list[Piece]:
        """What this parameter sends in an all-gather: its values (purpose None), or its codec's
        pieces for `purpose`, every rank's element count from its rows."""
        if purpose is None:
            return [Piece(self.full.dtype, tuple(self.rank_numels))]
        rows = [length for _, length in self.placement.ranges]
        return [Piece(dtype, tuple(numel_of_rows(r) for r in rows))
                for dtype, numel_of_rows in self.codec.pieces(purpose, self.full.shape)]

    def put(self, param: nn.Parameter) -> None:
        for owner, name in self.places:
            owner._parameters[name] = param

    @property
    def slot_numel(self) -> int:
        return self.slot_rows * self.row_numel

    @functools.cached_property
    def runs(self) -> list[Run]:
        """The ranks' shards as runs of consecutive ranks holding the same number of elements."""
        return runs_of(self.rank_numels)

    def full_runs(self) -> list[torch.Tensor]:
        """The full parameter's elements as views that the all-gather copies into: per run of ranks
        holding elements, a view of the flattened parameter shaped `run.shape`.

        [Note: views of a freed storage] `full` keeps one storage object whose bytes are freed
        (resize to 0) and allocated again (resize to its size) around every use; views share
        that storage object, not its bytes, so views made once stay valid across resizes. They
        are made the first time the storage has its size (a view of a 0-byte storage is not
        something to rely on), of `full.detach()` so that they share its version counter (the
        gather's writes count as writes to `full`, and _unsafe_preserve_version_counter undoes
        them) without carrying autograd history, and made again should anything have put
        another storage under `full`. The group's own communication buffers are kept the same
        way (collectives.py, CommBuffer)."""
        storage = self.full.untyped_storage()
        # (the cached views hold the storage they were made of, so its address is not reused)
        if storage._cdata != self._full_storage:
            flat = self.full.detach().view(-1)
            self._full_runs = [flat[run.start: run.start + run.count * run.numel].view(run.shape)
                               for run in self.runs if run.numel]
            self._full_storage = storage._cdata
        return self._full_runs

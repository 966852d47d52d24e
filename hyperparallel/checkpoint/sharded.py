"""Where each rank's rows of a model sharded by fully_shard sit in its global tensors, told to
torch.distributed.checkpoint through its planners.

The state dicts DCP saves and fills hold plain local tensors: for a sharded parameter, and each
optimizer state of its shape (AdamW moments, Muon momentum), this rank's rows. `shard_chunks`
records, per flattened state-dict key, the global shape and the offset of those rows: exactly
what `shard_info` says, and no padding. Our planners hand DCP that placement: saving writes each
rank's rows once, as one chunk of the global tensor; loading reads, for the rows this rank holds
now, whatever saved chunks overlap them. So a checkpoint saved with one world size and geometry
loads into any other, or into one unsharded process, and loading writes into the live shards in
place.

[Note: no ShardedTensor] Wrapping each local tensor as a ShardedTensor says the same thing to
DCP's default planners, but builds a few dozen Python objects per tensor on every save and load
(and warns, deprecated, on each size() DCP asks). The planners' lookup methods are DCP's own
extension points (`lookup_object`, `lookup_tensor`); the files on disk are the same either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hyperparallel.fsdp import column_shards, shard_info, shard_placement


@dataclass(frozen=True)
class Chunk:
    """This rank's block of a global tensor: its global shape, and the block's offset and size
    in every dimension (FSDP and expert parallelism split dim 0; row-parallel TP dim 1)."""

    global_shape: torch.Size
    offsets: torch.Size
    sizes: torch.Size

    @property
    def empty(self) -> bool:
        return any(size == 0 for size in self.sizes)


def chunk_of(param: nn.Parameter, columns: tuple[int, int] | None = None) -> Chunk | None:
    """The chunk of a parameter sharded over several ranks, or split among them (an expert-parallel
    rank's experts, a TP rank's heads); None for one that is whole here. `columns`: (global
    columns, first column) of a row-parallel TP weight, whose dim 1 is split."""
    info = shard_info(param)
    global_shape = list(info.global_shape) or [1]  # a 0-d parameter is sharded as one row
    offsets, sizes = [info.offset] + [0] * (len(global_shape) - 1), [info.length, *global_shape[1:]]
    if columns is not None:
        global_shape[1], offsets[1] = columns
    placement = shard_placement(param)
    split = info.length < global_shape[0] or columns is not None
    if not split and (placement is None or len(placement.ranges) == 1 or not any(r for _, r in placement.ranges)):
        return None  # (no rows anywhere: every rank saves the same empty tensor, whole)
    return Chunk(torch.Size(global_shape), torch.Size(offsets), torch.Size(sizes))


def shard_chunks(model: nn.Module, model_sd: dict, optim_state: dict | None) -> dict[str, Chunk]:
    """The chunk of every sharded entry, by the flattened key DCP gives it (`model.NAME`,
    `optim.NAME.STATE`): the parameters themselves and the optimizer states shaped like them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    columns = column_shards(model)

    def chunk_named(name: str) -> Chunk | None:
        param = params.get(name)
        return chunk_of(param, columns.get(name)) if param is not None else None

    chunks: dict[str, Chunk] = {}
    for name in model_sd:
        chunk = chunk_named(name)
        if chunk is not None:
            chunks[f"model.{name}"] = chunk
    for name, entries in (optim_state or {}).items():
        chunk = chunk_named(name)
        if chunk is None:
            continue
        for key, value in entries.items():
            if isinstance(value, Tensor) and value.dim() and value.shape == params[name].shape:
                chunks[f"optim.{name}.{key}"] = chunk
    return chunks


class ShardedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with each sharded entry written as its chunk of the global
    tensor (and nothing for a rank that holds none of its rows)."""

    def __init__(self, chunks: dict[str, Chunk]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            chunk = self.chunks.get(item.index.fqn)
            if chunk is None or item.tensor_data is None:
                items.append(item)
            elif not chunk.empty:
                items.append(dataclasses.replace(
                    item, index=MetadataIndex(item.index.fqn, chunk.offsets), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(chunk.offsets, chunk.sizes),
                                                properties=item.tensor_data.properties, size=chunk.global_shape)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class ShardedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading for each sharded entry the saved chunks that overlap
    the rows this rank holds now. Every key must be in the checkpoint (checked before, with
    shapes, by `io.load`)."""

    def __init__(self, chunks: dict[str, Chunk]):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests = []
        for fqn, tensor in self.state_dict.items():
            if fqn not in saved:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            chunk = self.chunks.get(fqn)
            if chunk is None:
                local = ChunkStorageMetadata(torch.Size([0] * tensor.dim()), tensor.size())
            elif not chunk.empty:
                local = ChunkStorageMetadata(chunk.offsets, chunk.sizes)
            else:
                continue  # no rows of it here
            requests += create_read_items_for_chunk_list(fqn, saved[fqn], [local])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        return self.state_dict[index.fqn]  # read items' offsets are within this rank's rows

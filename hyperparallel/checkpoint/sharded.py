"""State dicts of models sharded by fully_shard, in a form torch.distributed.checkpoint understands.

Each sharded parameter, and each optimizer state of its shape (AdamW moments, Muon momentum), is
wrapped as a ShardedTensor that records the global shape and, for every rank, the first row and
row count it holds: exactly what `shard_info` says, and no padding. DCP then writes each rank's
rows once and, on load, reads whatever rows the current layout asks for, so a checkpoint saved
with one world size and geometry loads into any other, or into one unsharded process. Loading
writes into the live shards in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from hyperparallel.fsdp import shard_info, shard_placement


def as_sharded(local: Tensor, param: nn.Parameter) -> Tensor:
    """`local` (this rank's rows of a tensor laid out like `param`) as a ShardedTensor; a tensor of
    an unsharded parameter is returned as it is."""
    placement = shard_placement(param)
    if placement is None or len(placement.ranges) == 1:
        return local
    info = shard_info(param)
    global_shape = list(info.global_shape) or [1]  # a 0-d parameter is sharded as one row
    rest = global_shape[1:]
    group = placement.process_group
    device = local.device.type if local.device.type == "cpu" else f"{local.device.type}:{local.device.index}"
    shards = [
        ShardMetadata(shard_offsets=[offset] + [0] * len(rest), shard_sizes=[length] + rest,
                      placement=f"rank:{dist.get_global_rank(group, r) if group is not None else r}/{device}")
        for r, (offset, length) in enumerate(placement.ranges) if length > 0
    ]
    if not shards:  # a parameter with no rows at all
        return local
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size(global_shape),
                                     tensor_properties=properties)
    mine = [s for r, s in zip((r for r, (_, n) in enumerate(placement.ranges) if n > 0), shards, strict=True)
            if r == placement.rank]
    local_shards = [Shard(local.reshape(mine[0].shard_sizes), mine[0])] if mine else []
    wrapped = ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=group)
    wrapped._hp_local = local  # what `unwrap` gives back, in its own shape, even with no rows here
    return wrapped


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def wrap_state(model: nn.Module, model_sd: dict, optim_sd: dict | None = None) -> tuple[dict, dict | None]:
    """Model and optimizer state dicts (as torch.distributed.checkpoint.state_dict.get_state_dict
    gives them, keyed by parameter names) with every sharded tensor wrapped by `as_sharded`."""
    params = _params_by_name(model)
    model_sd = {k: as_sharded(v, params[k]) if k in params else v for k, v in model_sd.items()}
    if optim_sd is not None:
        state = {}
        for name, entries in optim_sd.get("state", {}).items():
            param = params.get(name)
            state[name] = {k: as_sharded(v, param) if param is not None and isinstance(v, Tensor) and v.dim()
                           and v.shape == param.shape else v for k, v in entries.items()}
        optim_sd = dict(optim_sd, state=state)
    return model_sd, optim_sd


def unwrap(value):
    """The local tensors of a (nested) state dict: a ShardedTensor becomes this rank's rows."""
    if isinstance(value, ShardedTensor):
        return value._hp_local
    if isinstance(value, dict):
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


# DCP's default planners "flatten" nested ShardedTensors, and on the way drop any ShardedTensor
# with no rows on this rank, together with what it leaves empty (a rank whose shards of a
# small parameter are empty would then ask for other keys than the others). Ours are never nested.
def save_planner() -> DefaultSavePlanner:
    return DefaultSavePlanner(flatten_sharded_tensors=False)


def load_planner() -> DefaultLoadPlanner:
    return DefaultLoadPlanner(flatten_sharded_tensors=False)

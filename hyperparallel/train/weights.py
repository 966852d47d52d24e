"""A model built on the meta device gets its memory and its values rank by rank.

The trainer builds the model without memory, applies every plan (tensor parallelism, expert
placement, MXFP8 recipes, FSDP, which gives each rank's shards uninitialized memory), and only
then fills what this rank holds: from the seeded init (`models.init.init_by_name`: one module's
tensors whole at a time, each rank keeping its block), or from a Hugging Face directory
(`checkpoint.hf_files`: each rank reads only its blocks of the files). A rank never holds a
whole parameter it does not own beyond the one module being initialized.

Where each of this rank's tensors sits in the whole one is what checkpoints already record
(`checkpoint.sharded.chunk_of`: FSDP's and expert parallelism's rows, a row-parallel TP weight's
columns), so a model filled here and a checkpoint saved from it agree by construction.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.checkpoint.sharded import Chunk, chunk_of
from hyperparallel.fsdp import column_shards
from hyperparallel.models import init_by_name

Target = tuple[torch.Tensor, Chunk | None]  # this rank's tensor, and its block of the whole (None: all of it)


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer still on the meta device uninitialized memory on `device`
    (a parameter shared by several modules stays one)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # (our marks on a parameter, such as TP's shard info)
                made[id(param)] = new
            module._parameters[name] = made[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def local_targets(model: nn.Module) -> dict[str, Target]:
    """Every parameter and buffer of `model` by its state-dict name (tied names each), with its
    block of the whole tensor when this rank holds a part of it."""
    columns = column_shards(model)
    targets: dict[str, Target] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        targets[name] = (param.detach(), chunk_of(param, columns.get(name)))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        targets[name] = (buffer, None)  # buffers are whole on every rank
    return targets


def block_of(whole: torch.Tensor, chunk: Chunk | None) -> torch.Tensor:
    """The part of `whole` that `chunk` describes (all of it for None)."""
    if chunk is None:
        return whole
    whole = whole.reshape(chunk.global_shape)  # (a 0-d parameter is sharded as one row)
    return whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))]


def _write_into(targets: dict[str, Target], written: set[str]):
    filled: set[tuple[int, int]] = set()  # the memory already written: a tied tensor keeps its first values

    def write(name: str, whole: torch.Tensor) -> None:
        target = targets.get(name)
        if target is None:
            return  # (not in the trained model: a module a plan removed)
        dst, chunk = target
        written.add(name)
        if chunk is not None and chunk.empty:
            return
        # A parameter tied under two names (an embedding and its output head) gets the values of
        # the module that comes first in init order, as init_weights' tie_weights() keeps them.
        where = (dst.data_ptr(), dst.numel())
        if where in filled:
            return
        filled.add(where)
        dst.copy_(block_of(whole, chunk).reshape(dst.shape))
    return write


def _check_all_written(targets: dict[str, Target], written: set[str], names) -> None:
    missing = sorted(set(names) - written)
    if missing:  # a module whose init the shadow model does not run: a bug here, not a user's mistake
        raise RuntimeError(f"no initial values for {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))


def fill_from_init(model: nn.Module, shadow: nn.Module, seed: int, device: torch.device, *,
                   only: set[str] | None = None) -> None:
    """Initialize this rank's tensors of `model` as `models.init_weights(seed)` initializes the
    whole model (`shadow`: the same model on the meta device, whole shapes, before any plan);
    `only`: just these names."""
    targets = local_targets(model)
    wanted = set(targets) if only is None else only
    # (a module this rank holds nothing of, an EP rank's other experts say, is not drawn at all;
    # every module it holds any block of is drawn whole: O(model) draws per rank under FSDP)
    wanted = {n for n in wanted if targets[n][1] is None or not targets[n][1].empty}
    written: set[str] = set()
    if wanted:
        init_by_name(shadow, seed, _write_into(targets, written), wanted=wanted.__contains__, device=device)
    _check_all_written(targets, written, wanted)


def fill_from_hf(model: nn.Module, shadow: nn.Module, plan, seed: int, device: torch.device) -> None:
    """This rank's blocks of every parameter and persistent buffer read from a Hugging Face
    directory (`plan`: `checkpoint.hf_files.plan_hf_read` of it against `shadow`); the
    non-persistent buffers (rotary frequencies), which no checkpoint holds, from the init."""
    targets = local_targets(model)
    persistent = set(model.state_dict(keep_vars=True))
    plan.read({name: target for name, target in targets.items() if name in persistent})
    fill_from_init(model, shadow, seed, device, only=set(targets) - persistent)

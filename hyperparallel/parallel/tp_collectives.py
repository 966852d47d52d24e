"""The collectives of tensor and sequence parallelism, as autograd functions over a TP group.

Activations are [batch, sequence, hidden]; sequence parallelism splits dim 1 into tp equal parts,
rank r holding part r. Each function's backward is its forward's transpose:

| function | forward | backward |
|---|---|---|
| enter_tp (sp off) | identity | all-reduce |
| enter_tp (sp on) | all-gather the sequence | reduce-scatter the sequence |
| exit_tp (sp off) | all-reduce | identity |
| exit_tp (sp on) | reduce-scatter the sequence | all-gather the sequence |
| split_sequence | this rank's part | all-gather the sequence |
| reduce_tp | all-reduce | identity |

`enter_tp` sits before a column-parallel projection (every rank needs the whole input; each
contributes a part of its gradient), `exit_tp` after a row-parallel one (each rank holds a
partial sum). The identity backward of exit_tp and reduce_tp is right because what follows
them is the same on every TP rank, so is its gradient.

[Note: torch.distributed.nn.functional] Its all_reduce's backward is an all-reduce too (the
gradient of a sum computed by every rank, summed again): right when each rank's loss differs,
tp times too large here, where every TP rank computes the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from hyperparallel import traffic

SEQUENCE_DIM = 1


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed the tensor collectives (the old names warn); torch.compile's functional
    # collectives trace the old names, which is what a compiled layer calls
    traffic.all_gather("tp", x, group)
    single = getattr(dist, "all_gather_single", None)
    (dist.all_gather_into_tensor if single is None or torch.compiler.is_compiling() else single)(out, x, group=group)


def _reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    traffic.reduce_scatter("tp", x, group)
    single = getattr(dist, "reduce_scatter_single", None)
    (dist.reduce_scatter_tensor if single is None or torch.compiler.is_compiling() else single)(out, x, group=group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous().clone()
    traffic.all_reduce("tp", x, group)
    dist.all_reduce(x, group=group)
    return x


def _gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[world, *x.shape]: every rank's x. (The output is allocated [world * x.shape[0], ...], the
    shape torch.compile's functional collectives expect of all_gather_into_tensor.)"""
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(out, x, group)
    return out.view(world, *x.shape)


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # [world, batch, part, ...] -> [batch, world * part, ...]
    return _gather_dim0(x, group).movedim(0, SEQUENCE_DIM).flatten(SEQUENCE_DIM, SEQUENCE_DIM + 1)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    length = x.shape[SEQUENCE_DIM]
    parts = x.unflatten(SEQUENCE_DIM, (world, length // world)).movedim(SEQUENCE_DIM, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, parts.flatten(0, 1), group)  # (flat on dim 0, as for the gather)
    return out


def _my_part(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=SEQUENCE_DIM)[rank].contiguous()


class _Enter(Function):
    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup, sp):
        ctx.group, ctx.sp = group, sp
        return _all_gather_sequence(x, group) if sp else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return _reduce_scatter_sequence(grad, ctx.group), None, None
        return _all_reduce(grad, ctx.group), None, None


class _Exit(Function):
    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup, sp):
        ctx.group, ctx.sp = group, sp
        return _reduce_scatter_sequence(x, group) if sp else _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_all_gather_sequence(grad, ctx.group) if ctx.sp else grad), None, None


class _Split(Function):
    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup):
        ctx.group = group
        return _my_part(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.group), None


class _Reduce(Function):
    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def enter_tp(x: torch.Tensor, group: dist.ProcessGroup, sp: bool) -> torch.Tensor:
    return _Enter.apply(x, group, sp)


def exit_tp(x: torch.Tensor, group: dist.ProcessGroup, sp: bool) -> torch.Tensor:
    return _Exit.apply(x, group, sp)


def split_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Split.apply(x, group)


def reduce_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Reduce.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x side by side along the last dim (no autograd: logits for generation)."""
    return _gather_dim0(x, group).movedim(0, -2).flatten(-2)

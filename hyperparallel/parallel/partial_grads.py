"""Tensor parallelism's partial gradients summed over the TP group: one all-reduce per dtype and device.

A replicated weight that works on one rank's part of a computation gets a partial gradient
(tensor_parallel.py). Summed over the whole group: q_norm, the MLA a-projections and, with
sequence parallelism, every replicated weight. Summed over the ranks sharing one key/value head
(a replicated key/value weight, `(slot, slots)`): each rank puts its gradient in its slot's row
of a [slots, elements] block and zeros in the others, so the sum over the group is, per slot,
the sum over the ranks sharing it. Both kinds share one flat buffer per dtype and device, so one
all-reduce serves them all.

Which parameters these are, the buffer and every view into it are found once per model
(`PartialGradSum.of`); each call checks that the modules still hold the same Parameter objects
at the same places (a sharded model holds its shards there between steps), and only then reads
their gradients: one dict lookup per parameter, no walk over the model. The buffer's bytes exist
only during the all-reduce (its storage freed and refilled, the views kept: fsdp's [Note: views
of a freed storage]), on the parameters' device ([Note: device-correct collectives],
train/distributed.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import traffic


class _Bucket:
    """The partial gradients of one dtype and device: the buffer and its views, made once."""

    def __init__(self, params: list[nn.Parameter], slots: list[tuple[int, int] | None], dtype: torch.dtype,
                 device: torch.device):
        sizes = [p.numel() * (1 if slot is None else slot[1]) for p, slot in zip(params, slots, strict=True)]
        self.buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.views: list[torch.Tensor] = []  # where each gradient goes, shaped like it
        self.zeros: list[torch.Tensor] = []  # the other slots' rows of the key/value blocks
        for p, slot, piece in zip(params, slots, self.buffer.split_with_sizes(sizes), strict=True):
            if slot is None:
                self.views.append(piece.view(p.shape))
                continue
            index, count = slot
            block = piece.view(count, p.numel())
            self.views.append(block[index].view(p.shape))
            self.zeros += [rows for rows in (block[:index], block[index + 1:]) if rows.numel()]
        self.buffer.untyped_storage().resize_(0)

    def sum(self, grads: list[torch.Tensor | None], group: dist.ProcessGroup) -> None:
        self.buffer.untyped_storage().resize_(self.nbytes)
        present = [i for i, g in enumerate(grads) if g is not None]
        if len(present) == len(grads):
            into, sources, zeros = self.views, grads, self.zeros
        else:  # a parameter without a gradient on this rank adds zeros, and keeps no gradient
            into, sources = [self.views[i] for i in present], [grads[i] for i in present]
            zeros = self.zeros + [v for i, v in enumerate(self.views) if grads[i] is None]
        if into:
            torch._foreach_copy_(into, sources)
        if zeros:
            torch._foreach_zero_(zeros)
        traffic.all_reduce("tp", self.buffer, group)
        dist.all_reduce(self.buffer, group=group)
        if into:
            torch._foreach_copy_(sources, into)
        self.buffer.untyped_storage().resize_(0)


class PartialGradSum:
    """The model's partial gradients (by the places that hold them) and their buckets."""

    def __init__(self, places: list[tuple[nn.Module, str, nn.Parameter]], slots: list[tuple[int, int] | None],
                 group):
        self.group = group
        kinds: dict[tuple, list[int]] = {}
        for i, (_, _, p) in enumerate(places):
            kinds.setdefault((p.dtype, p.device), []).append(i)
        self.places = [[places[i] for i in indices] for indices in kinds.values()]
        self.buckets = [_Bucket([places[i][2] for i in indices], [slots[i] for i in indices], dtype, device)
                        for (dtype, device), indices in kinds.items()]

    @classmethod
    def of(cls, model: nn.Module, partial: dict[str, tuple[int, int] | None], group: dist.ProcessGroup) -> PartialGradSum:
        """`partial`: per parameter name, None (summed over the group) or (slot, slots)."""
        places, slots, seen = [], [], set()
        for prefix, module in model.named_modules():
            for name, p in module._parameters.items():
                full = f"{prefix}.{name}" if prefix else name
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))  # (each Parameter once, under its first name, as named_parameters gives it)
                if full in partial:
                    places.append((module, name, p))
                    slots.append(partial[full])
        return cls(places, slots, group)

    @torch.no_grad()
    def __call__(self) -> bool:
        """Sum the gradients over the group; False (and nothing done) if a module holds another
        Parameter at one of the places than when this was made: make it again."""
        grads = []
        for places in self.places:
            grads.append([])
            for module, name, p in places:
                if module._parameters.get(name) is not p:
                    return False
                grads[-1].append(p.grad)
        for bucket, bucket_grads in zip(self.buckets, grads, strict=True):
            bucket.sum(bucket_grads, self.group)
        return True

"""Bytes this rank sends through collectives, counted where each collective is issued.

Every call site of a step's collectives in the package (fsdp's gathers and reductions, the TP,
CP and EP exchanges, Muon's) calls the function of its kind below with the tensors it really
hands to torch.distributed and the mesh dimension it runs over; while a `counting()` block is
open they are added up, by dimension and by kind, and otherwise the call returns at once. Not
counted: the trainer's bookkeeping (the loss agreement, the gradient norm's all-reduce, the MoE
loads: a few bytes per step), DDP's gradient all-reduce (torch's C++ reducer issues it: no call
site here; the planner predicts it), and collectives inside a torch.compile'd region (a compiled
layer's TP exchanges), which a trace must not record as Python side effects. What
is counted is what the call moves, not a formula of the model: the same conventions as the
planner's (`hyperparallel plan`, planning/communication.py), ring algorithms' bytes a rank sends:

- all-gather: (W-1) x this rank's input (every other rank's part passes through it once);
- reduce-scatter: (W-1)/W x the input (all but this rank's own part);
- all-reduce: 2 (W-1)/W x the tensor (a reduce-scatter, then an all-gather);
- all-to-all: the rows sent to the other ranks (the real split sizes, this rank's own part
  excluded);
- a ring's pass (context parallelism's ring attention): the block sent to the next rank, as a
  step of the all-gather of every rank's block that the ring's W-1 passes make;
- a send (a pipeline stage's activations to the next stage, or their gradient back): the
  tensors handed over, counted where our stage hands them to torch.distributed.pipelining's
  schedule, which sends them.

A rank counts its own sends; with uneven shards or routing the ranks differ, and the trainer
reports the largest rank's figure next to the mean. A call site may also name its collective
(expert parallelism's "dispatch", "combine", ...): `Traffic.named` then adds its bytes up under
that name too, where one dimension and kind carry collectives of different purposes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


@dataclass
class Traffic:
    """Bytes sent and calls made, per (mesh dimension, kind of collective)."""

    sent: dict[tuple[str, str], int] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    named: dict[tuple[str, str], int] = field(default_factory=dict)  # (dimension, name): bytes of named calls

    def add(self, dimension: str, kind: str, nbytes: int, name: str | None = None) -> None:
        key = (dimension, kind)
        self.sent[key] = self.sent.get(key, 0) + int(nbytes)
        self.calls[key] = self.calls.get(key, 0) + 1
        if name is not None:
            self.named[dimension, name] = self.named.get((dimension, name), 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def by_dimension(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (dimension, _), nbytes in self.sent.items():
            out[dimension] = out.get(dimension, 0) + nbytes
        return dict(sorted(out.items()))

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, kind), nbytes in self.sent.items():
            out[kind] = out.get(kind, 0) + nbytes
        return dict(sorted(out.items()))

    def to_json(self) -> dict:
        return {"total": self.total, "by_dimension": self.by_dimension(), "by_kind": self.by_kind(),
                "by_dimension_and_kind": {f"{d}/{k}": n for (d, k), n in sorted(self.sent.items())},
                "by_name": {f"{d}/{name}": n for (d, name), n in sorted(self.named.items())}}


_open: list[Traffic] = []  # the counting() blocks open now, innermost last


@contextmanager
def counting() -> Iterator[Traffic]:
    """Count every collective this process issues inside the block."""
    traffic = Traffic()
    _open.append(traffic)
    try:
        yield traffic
    finally:
        _open.remove(traffic)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _counting() -> bool:
    # (a traced region records nothing: a trace must not hold Python side effects)
    # (is_compiling first: Dynamo then never guards on `_open`, which would recompile a layer
    # when counting stops)
    return not torch.compiler.is_compiling() and bool(_open)


def _add(dimension: str, kind: str, nbytes: int, name: str | None = None) -> None:
    for traffic in _open:
        traffic.add(dimension, kind, nbytes, name)


# Each takes the process group the collective runs over (None: the world), whose size is read
# only while counting.

def all_gather(dimension: str, local: torch.Tensor, group) -> None:
    if _counting() and (world := dist.get_world_size(group)) > 1:
        _add(dimension, "all_gather", (world - 1) * _nbytes(local))


def reduce_scatter(dimension: str, flat: torch.Tensor, group) -> None:
    if _counting() and (world := dist.get_world_size(group)) > 1:
        _add(dimension, "reduce_scatter", (world - 1) * _nbytes(flat) // world)


def all_reduce(dimension: str, tensor: torch.Tensor, group) -> None:
    if _counting() and (world := dist.get_world_size(group)) > 1:
        _add(dimension, "all_reduce", 2 * (world - 1) * _nbytes(tensor) // world)


def all_to_all(dimension: str, rows: torch.Tensor, send_splits: Sequence[int] | None, group,
               name: str | None = None) -> None:
    """`rows` split along dim 0 by `send_splits` (None: evenly) to the ranks of `group`."""
    if not _counting() or (world := dist.get_world_size(group)) <= 1:
        return
    total = _nbytes(rows)
    if send_splits is None:
        own = total // world
    else:
        per_row = total // max(sum(send_splits), 1)
        own = send_splits[dist.get_rank(group)] * per_row
    _add(dimension, "all_to_all", total - own, name)


def send(dimension: str, tensors: Sequence[torch.Tensor], name: str) -> None:
    """`tensors` handed to another rank, point to point (a pipeline's stage to the next or back)."""
    if _counting():
        _add(dimension, "send", sum(_nbytes(t) for t in tensors), name)


def ring_pass(dimension: str, block: torch.Tensor) -> None:
    """One pass of a ring's block to the next rank: a step of the all-gather the ring makes."""
    if _counting():
        _add(dimension, "all_gather", _nbytes(block))

"""Checkpoints written in the background: `async_save` returns once the state is copied to CPU
memory; the files are written by a thread while training goes on, and the checkpoint appears
under its name, whole, when every rank's part is on disk.

    pending = checkpoint.async_save("ckpt/step_00000100", model, optimizer, extra={"step": 100})
    ...                      # train on: the copy is what gets written, not the live tensors
    pending.wait()           # before the next save, and before exiting

Through `torch.distributed.checkpoint.async_save`: its stager copies every tensor to CPU (the
only time training waits), and its thread runs the same planning and writing as `save`, into
`NAME.tmp`. DCP's last step gathers every rank's write results on rank 0 and writes `.metadata`
there, so when rank 0's write is done every rank's is: rank 0 then writes the manifest and
renames `NAME.tmp` to `NAME` (in the writer thread, so a checkpoint is published as soon as it
is complete, even while the main thread is busy). A process killed at any point leaves either no
`NAME` or a complete one.

[Note: a process group of its own] The writer thread's collectives (DCP's planning and its
final gather) run while the main thread runs training's. Two threads issuing collectives on one
process group can interleave them differently on different ranks, so background saves use a
gloo group of their own, made once, on first use, by every rank (they all save together).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from hyperparallel.checkpoint.io import (
    _first_failure,
    _manifest,
    _prepare,
    _publish,
    _rank,
    _tensors,
    every_ranks_groups,
    hush_single_process_notice,
    no_gc_pauses,
)
from hyperparallel.checkpoint.sharded import ShardedSavePlanner
from hyperparallel.errors import CheckpointError
from hyperparallel.process_groups import made_once


def _background_group() -> dist.ProcessGroup | None:
    if not dist.is_initialized():
        return None
    return made_once("background save", lambda: dist.new_group(backend="gloo"))


class PendingSave:
    """A checkpoint being written in the background."""

    def __init__(self, path: Path, tmp: Path, future: Future, manifest: dict | None):
        self.path = path
        self._tmp = tmp
        self._manifest = manifest  # rank 0 publishes; other ranks hold None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        future.add_done_callback(self._on_written)

    def _on_written(self, future: Future) -> None:
        try:
            future.result()
            if self._manifest is not None:
                _publish(self._tmp, self.path, self._manifest)
        except BaseException as error:  # kept for wait(), on the caller's thread
            self._error = error
        finally:
            self._finished.set()

    def done(self) -> bool:
        """Whether writing has finished (and, on rank 0, the checkpoint is published), or failed."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """Block until the checkpoint is complete; CheckpointError if writing it failed."""
        self._finished.wait()
        if self._error is not None:
            raise CheckpointError(f"checkpoint {self.path} could not be written: {_first_failure(self._error)}") \
                from self._error
        return self.path


def async_save(directory: str | os.PathLike, model: nn.Module, optimizer=None, *, extra: dict | None = None,
               per_rank: dict[str, torch.Tensor] | None = None, process_group=None) -> PendingSave:
    """`save`, returning as soon as the state is copied to CPU memory; every rank calls it.

    The checkpoint appears at `directory` when it is complete (see the module docstring); call
    `wait()` on the result before the next save and before the process ends. `process_group`:
    a gloo group for the writer thread's collectives, used by nothing else (default: one made on
    first use, with torch's default timeout).
    """
    final, tmp = _prepare(directory)
    hush_single_process_notice()
    with no_gc_pauses():
        tensors, groups, chunks = _tensors(model, optimizer, per_rank)
        future = dcp.async_save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)),
                                planner=ShardedSavePlanner(chunks),
                                process_group=process_group or _background_group())
    groups = every_ranks_groups(groups)  # (collective: before the manifest, on every rank)
    manifest = _manifest(groups, extra) if _rank() == 0 else None
    return PendingSave(final, tmp, future, manifest)

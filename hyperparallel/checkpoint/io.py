"""Save and load a model and its optimizer, sharded or not, through torch.distributed.checkpoint.

A checkpoint is a directory:
- DCP's files: every tensor once, unpadded. Sharded parameters and their optimizer states are
  recorded with their global shape and each rank's rows (`sharded.shard_chunks`), so any layout
  reads any other: W ranks with one geometry, W' ranks with another, or one unsharded process.
- `checkpoint.json`: everything that is not a tensor (optimizer hyperparameters, the caller's
  `extra` state, the world size), written last. A directory without it is not a checkpoint.

`save` writes into `NAME.tmp` and renames it to `NAME` when complete: a process killed while
saving leaves the previous checkpoint as it was. `async_save` does the same in the background
(`pending.py`). `load` unpickles nothing but DCP's own index
(`storage.SafeFileSystemReader`), and checks every tensor's global shape before reading, so a
checkpoint of another model fails with the key and both shapes.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hyperparallel.checkpoint.sharded import Chunk, ShardedLoadPlanner, ShardedSavePlanner, shard_chunks
from hyperparallel.checkpoint.storage import SafeFileSystemReader
from hyperparallel.errors import CheckpointError

MANIFEST = "checkpoint.json"
FORMAT = 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Python's cyclic garbage collector off while DCP plans, reads and writes.

    [Note: GC pauses] DCP makes hundreds of small objects per checkpoint (plans, read and write
    items, metadata); in a process that holds a model and transformers (~400k tracked objects)
    they trigger full collections, each ~100-200 ms on these CPUs, which landed on random ranks
    and doubled the median load time (docs/checkpoint.md). Nothing DCP makes lives in a cycle for
    long: the collector runs again, as usual, afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def hush_single_process_notice() -> None:
    """DCP warns on every save and load without a process group ("assuming the intent is to save
    in a single process"): one process is what we mean. A filter for that one message (set again
    at each call: it is idempotent, and test runners reset filters), not a catch_warnings around
    the call: a background save warns in its writer thread, after the call has returned."""
    if not dist.is_initialized():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _tensors(model: nn.Module, optimizer, per_rank: dict[str, torch.Tensor] | None
             ) -> tuple[dict, list | None, dict[str, Chunk]]:
    """The tensors DCP saves or fills (this rank's, aliasing the live ones), the optimizer's
    param_groups (not tensors: JSON), and where the sharded ones sit in their global tensors."""
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors: dict = {"model": model_sd}
    groups = None
    if optim_sd is not None:
        for name, entries in optim_sd["state"].items():
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"optimizer state {name}.{key} is a {type(value).__name__}, not a tensor; "
                                          f"only tensor state is saved")
        tensors["optim"] = optim_sd["state"]
        groups = optim_sd["param_groups"]
    if per_rank:
        tensors["rank"] = {str(_rank()): per_rank}
    return tensors, groups, shard_chunks(model, model_sd, tensors.get("optim"))


def _prepare(directory: str | os.PathLike) -> tuple[Path, Path]:
    """The final name and its `.tmp`, emptied of what a killed save left (rank 0; then every rank)."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a process killed while saving
            shutil.rmtree(tmp)
    _barrier()
    return final, tmp


def _publish(tmp: Path, final: Path, manifest: dict) -> None:
    """Rank 0, once every rank's data is in `tmp`: the manifest last, then one rename."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same name saved again (a resumed run): moved aside, then replaced whole
        if old.exists():  # left by a process killed here before
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


def every_ranks_groups(groups: list | None) -> list | None:
    """The optimizer's param_groups with every rank's parameter names: ranks holding different
    parameters (pipeline stages) each list their own, and a load in another layout finds each
    parameter's group by its name. Groups match by their "name" (the trainer's optimizers name
    each), else by position; their settings are the same on every rank. (Collective: the ranks
    first compare a digest of their names, and gather the names only where they differ.)"""
    if groups is None or _world() == 1:
        return groups
    digest = zlib.crc32("\n".join(f"{i}:{name}" for i, g in enumerate(groups) for name in g["params"]).encode())
    digests: list = [None] * _world()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return groups
    everyone: list = [None] * _world()
    dist.all_gather_object(everyone, groups)
    merged: dict = {}
    listed: dict = {}  # (per group, the names in it: a set, for the ranks of a large model)
    for rank_groups in everyone:
        for i, group in enumerate(rank_groups):
            key = group.get("name", i)
            if key not in merged:
                merged[key], listed[key] = {**group, "params": []}, set()
            for name in group["params"]:
                if name not in listed[key]:
                    listed[key].add(name)
                    merged[key]["params"].append(name)
    return list(merged.values())


def _manifest(groups: list | None, extra: dict | None) -> dict:
    return {"format": FORMAT, "world_size": _world(), "param_groups": groups, "extra": extra or {}}


def save(directory: str | os.PathLike, model: nn.Module, optimizer=None, *, extra: dict | None = None,
         per_rank: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model` (and `optimizer`) to `directory`; every rank calls it. `extra` is JSON the
    caller gets back from `load`; `per_rank` tensors (RNG states, say) are kept per rank."""
    final, tmp = _prepare(directory)
    hush_single_process_notice()
    with no_gc_pauses():
        tensors, groups, chunks = _tensors(model, optimizer, per_rank)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=ShardedSavePlanner(chunks))
    groups = every_ranks_groups(groups)
    _barrier()
    if _rank() == 0:
        _publish(tmp, final, _manifest(groups, extra))
    _barrier()
    return final


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no {MANIFEST} in it)") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {directory}: cannot read {MANIFEST} ({error})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {directory}: format {manifest.get('format')!r}, this version reads {FORMAT}")
    return manifest


def _leaves(tree: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, name + ".")
        else:
            yield name, value


def _check_fits(directory: Path, metadata, tensors: dict, chunks: dict[str, Chunk]) -> None:
    """Every tensor the model asks for is in the checkpoint, with the same global shape."""
    saved = metadata.state_dict_metadata
    for key, value in _leaves(tensors):
        if key.startswith("rank."):
            continue
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint {directory} has no {key}: it was saved from another model or optimizer")
        want = chunks[key].global_shape if key in chunks else value.shape
        if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(want):
            got = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else type(entry).__name__
            raise CheckpointError(f"checkpoint {directory}: {key} has shape {got} in the checkpoint but "
                                  f"{tuple(want)} in this model")


def _as_saved(groups: list[dict], current: list[dict]) -> list[dict]:
    """JSON turned tuples (betas, say) into lists: give them back the type the optimizer uses."""
    fixed = []
    for loaded, now in zip(groups, current, strict=False):
        fixed.append({k: tuple(v) if isinstance(now.get(k), tuple) and isinstance(v, list) else v
                      for k, v in loaded.items()})
    return fixed + groups[len(fixed):]


def load(directory: str | os.PathLike, model: nn.Module, optimizer=None, *,
         per_rank: dict[str, torch.Tensor] | None = None) -> dict:
    """Read `directory` into `model` (and `optimizer`), whatever layout saved it; returns the
    manifest (`extra`, `world_size`, ...). `per_rank` tensors are filled in place when the
    checkpoint has this rank's (the same world size saved it), else left as they are."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if optimizer is not None and manifest.get("param_groups") is None:
        raise CheckpointError(f"checkpoint {directory} holds no optimizer state")
    reader = SafeFileSystemReader(str(directory))
    metadata = reader.read_metadata()  # kept by the reader: dcp.load asks for it again
    same_layout = manifest.get("world_size") == _world()
    hush_single_process_notice()
    with no_gc_pauses():
        tensors, groups, chunks = _tensors(model, optimizer, per_rank if same_layout else None)
        _check_fits(directory, metadata, tensors, chunks)
        try:
            dcp.load(tensors, storage_reader=reader, planner=ShardedLoadPlanner(chunks))
        except (Exception, CheckpointException) as error:  # a truncated or missing data file
            raise CheckpointError(f"checkpoint {directory} cannot be read: {_first_failure(error)}") from None
        model_sd = tensors["model"]
        optim_state = tensors.get("optim")
        saved_groups = _as_saved(manifest["param_groups"], groups) if optimizer is not None else None
        same_groups = optimizer is None or _own_names(saved_groups, groups) == [g["params"] for g in groups]
        if same_groups and _loaded_in_place(model, model_sd, optimizer, optim_state):
            if optimizer is not None:
                _set_hyperparameters(optimizer, saved_groups)
        elif optimizer is None:
            set_model_state_dict(model, model_sd)
        else:
            set_state_dict(model, optimizer, model_state_dict=model_sd,
                           optim_state_dict={"state": optim_state, "param_groups": saved_groups})
    return manifest


def _own_names(saved_groups: list[dict], groups: list[dict]) -> list[list[str]]:
    """The saved groups' parameter names this rank's optimizer holds (the saved lists have every
    rank's: pipeline stages each hold their own)."""
    mine = {name for g in groups for name in g["params"]}
    return [[name for name in g["params"] if name in mine] for g in saved_groups]


def _loaded_in_place(model: nn.Module, model_sd: dict, optimizer, optim_state: dict | None) -> bool:
    """Whether DCP's in-place load already wrote into the live tensors: every model entry shares
    its parameter's or buffer's memory, and every optimizer state tensor is the optimizer's own.
    (What `get_state_dict` gives for plain and `hyperparallel.fsdp` modules; the general path,
    `set_state_dict`, would then only copy each tensor onto itself.)"""
    live = model.state_dict()
    for key, value in model_sd.items():
        now = live.get(key)
        if now is None or now.data_ptr() != value.data_ptr() or now.shape != value.shape:
            return False
    if optimizer is None:
        return True
    names = {id(p): name for name, p in model.named_parameters()}
    own = {names.get(id(p)): state for p, state in optimizer.state.items()}
    for name, entries in (optim_state or {}).items():
        state = own.get(name)
        if state is None or any(state.get(key) is not value for key, value in entries.items()):
            return False
    return True


def _set_hyperparameters(optimizer, groups: list[dict]) -> None:
    """The saved param_groups' settings (lr, betas, ...) into the live groups, as load_state_dict does
    (the groups hold the same parameters: `load` checked)."""
    for saved, group in zip(groups, optimizer.param_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _first_failure(error: BaseException) -> str:
    """One line for what went wrong: DCP wraps each rank's exception in a CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def checkpoint_in(path: str | os.PathLike) -> Path:
    """The checkpoint a command given `path` reads: `path` itself when it is one (or when it holds
    none: the reader then names what is wrong), else the newest complete checkpoint of the run
    directory (or of its checkpoints/) that `path` is, so `runs/latest` names a run's last save."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    newest = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
    return newest[-1] if newest else path


def complete_checkpoints(root: str | os.PathLike, pattern: str = "step_*") -> list[Path]:
    """Complete checkpoints under `root` (those with a manifest), oldest name first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(pattern)
                  if not p.name.endswith((".tmp", ".old")) and (p / MANIFEST).is_file())

"""Save and load a model and its optimizer, sharded or not, through torch.distributed.checkpoint.

A checkpoint is a directory:
- DCP's files: every tensor once, unpadded. Sharded parameters and their optimizer states are
  recorded with their global shape and each rank's rows (`sharded.as_sharded`), so any layout
  reads any other: W ranks with one geometry, W' ranks with another, or one unsharded process.
- `checkpoint.json`: everything that is not a tensor (optimizer hyperparameters, the caller's
  `extra` state, the world size), written last. A directory without it is not a checkpoint.

`save` writes into `NAME.tmp` and renames it to `NAME` when complete: a process killed while
saving leaves the previous checkpoint as it was. `load` unpickles nothing but DCP's own index
(`storage.SafeFileSystemReader`), and checks every tensor's global shape before reading, so a
checkpoint of another model fails with the key and both shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hyperparallel.checkpoint.sharded import load_planner, save_planner, unwrap, wrap_state
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


# ShardedTensor warns that it is deprecated on every size() or device DCP asks of it (hundreds
# per checkpoint); it is the one way to tell DCP about uneven shards (DTensor cannot), so that
# one warning is silenced for good, here. (Not with warnings.catch_warnings around each save and
# load: inside one, every such warning searches the filters anew, which doubled a load's time.)
warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns when it runs without a process group; one process is what we mean."""
    if dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _tensors(model: nn.Module, optimizer, per_rank: dict[str, torch.Tensor] | None) -> tuple[dict, list | None]:
    """The tensors DCP saves or fills, and the optimizer's param_groups (not tensors: JSON)."""
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    model_sd, optim_sd = wrap_state(model, model_sd, optim_sd)
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
    return tensors, groups


def save(directory: str | os.PathLike, model: nn.Module, optimizer=None, *, extra: dict | None = None,
         per_rank: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `model` (and `optimizer`) to `directory`; every rank calls it. `extra` is JSON the
    caller gets back from `load`; `per_rank` tensors (RNG states, say) are kept per rank."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a process killed while saving
            shutil.rmtree(tmp)
    _barrier()
    tensors, groups = _tensors(model, optimizer, per_rank)
    with quiet_dcp():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), planner=save_planner())
    _barrier()
    if _rank() == 0:
        manifest = {"format": FORMAT, "world_size": _world(), "param_groups": groups, "extra": extra or {}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same name saved again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
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


def _check_fits(directory: Path, metadata, tensors: dict) -> None:
    """Every tensor the model asks for is in the checkpoint, with the same global shape."""
    saved = metadata.state_dict_metadata
    for key, value in _leaves(tensors):
        if key.startswith("rank."):
            continue
        entry = saved.get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint {directory} has no {key}: it was saved from another model or optimizer")
        # (a ShardedTensor's size() goes through its deprecated __torch_function__: slow)
        want = value.metadata().size if isinstance(value, ShardedTensor) else value.shape
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
    metadata = reader.read_metadata()
    same_layout = manifest.get("world_size") == _world()
    tensors, groups = _tensors(model, optimizer, per_rank if same_layout else None)
    _check_fits(directory, metadata, tensors)
    try:
        with quiet_dcp():
            dcp.load(tensors, storage_reader=reader, planner=load_planner())
    except (Exception, CheckpointException) as error:  # a truncated or missing data file
        raise CheckpointError(f"checkpoint {directory} cannot be read: {_first_failure(error)}") from None
    optim_sd = None
    if optimizer is not None:
        optim_sd = {"state": unwrap(tensors["optim"]), "param_groups": _as_saved(manifest["param_groups"], groups)}
    if optimizer is None:
        set_model_state_dict(model, unwrap(tensors["model"]))
    else:
        set_state_dict(model, optimizer, model_state_dict=unwrap(tensors["model"]), optim_state_dict=optim_sd)
    return manifest


def _first_failure(error: BaseException) -> str:
    """One line for what went wrong: DCP wraps each rank's exception in a CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
        return f"rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def complete_checkpoints(root: str | os.PathLike, pattern: str = "step_*") -> list[Path]:
    """Complete checkpoints under `root` (those with a manifest), oldest name first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(pattern) if not p.name.endswith(".tmp") and (p / MANIFEST).is_file())

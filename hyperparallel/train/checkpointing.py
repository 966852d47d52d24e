"""Training checkpoints: model, optimizer, scheduler, data position and RNG.

Tensors go through torch.distributed.checkpoint (its file format, planners and metadata), the
rest (step, scheduler state, the config fingerprint) into a small `train_state.json`. A checkpoint
is written into `step_NNNNNNNN.tmp` and renamed to `step_NNNNNNNN` once complete; the JSON file is
written last, so a directory without it is never taken for a checkpoint. Loading reads only
tensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hyperparallel.checkpoint import load_planner, save_planner, unwrap, wrap_state
from hyperparallel.errors import CheckpointError

STATE_FILE = "train_state.json"
_NAME = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def _quiet_dcp():
    """DCP warns when it saves or loads without a process group (one process is what we mean) and
    when it meets a ShardedTensor (the one way to tell it about uneven shards, see checkpoint.sharded)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _tensor_state(model, optimizer) -> dict:
    # sharded parameters and their optimizer states go in as ShardedTensors: global shape and
    # each rank's rows, so DCP writes every row once and reads back any layout
    model_sd, optim_sd = wrap_state(model, *get_state_dict(model, optimizer))
    rng = {f"rank{_rank()}": torch.get_rng_state()}
    return {"model": model_sd, "optim": optim_sd, "rng": rng}


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def save(root: Path, step: int, model, optimizer, train_state: dict, keep_last: int) -> Path:
    """Write checkpoint `step` under root (every rank calls this) and prune old ones."""
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a run killed while saving
            shutil.rmtree(tmp)
    _barrier()
    with _quiet_dcp():
        dcp.save(_tensor_state(model, optimizer), checkpoint_id=str(tmp), planner=save_planner())
    _barrier()
    if _rank() == 0:
        state = dict(train_state, step=step)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        if final.exists():  # the same step saved again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    _barrier()
    return final


def resolve(resume: str, root: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` names: none, latest (None if there is none yet) or a path."""
    if resume == "none":
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete checkpoint (no {STATE_FILE} in it)")
    return path


def load(path: Path, model, optimizer, fingerprint: str) -> dict:
    """Restore model, optimizer and this rank's RNG from `path`; returns its train state."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE} ({error})") from None
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different model, data or optimizer config "
            f"(fingerprint {state.get('fingerprint')} vs {fingerprint}); resume it with the config it was made with"
        )
    tensors = _tensor_state(model, optimizer)
    try:
        with _quiet_dcp():
            dcp.load(tensors, checkpoint_id=str(path), planner=load_planner())
    except Exception as error:  # DCP reports missing keys and shape mismatches in its own words
        raise CheckpointError(f"checkpoint {path} does not fit this model: {error}") from None
    set_state_dict(model, optimizer, model_state_dict=unwrap(tensors["model"]), optim_state_dict=unwrap(tensors["optim"]))
    torch.set_rng_state(tensors["rng"][f"rank{_rank()}"])
    return state

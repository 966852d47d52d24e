"""Training checkpoints: model, optimizer, scheduler, data position and RNG, in `step_NNNNNNNN`
directories under the checkpoint root, through `hyperparallel.checkpoint` (which writes each one
atomically and loads it into any sharding layout). Here: naming, `keep_last`, `resume`, the
config fingerprint check, and each rank's RNG state."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hyperparallel import checkpoint
from hyperparallel.errors import CheckpointError

_NAME = re.compile(r"^step_(\d{8})$")


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under root, oldest first."""
    return [p for p in checkpoint.complete_checkpoints(root) if _NAME.match(p.name)]


def save(root: Path, step: int, model, optimizer, train_state: dict, keep_last: int) -> Path:
    """Write checkpoint `step` under root (every rank calls this) and prune old ones."""
    final = checkpoint.save(root / f"step_{step:08d}", model, optimizer, extra=dict(train_state, step=step),
                            per_rank={"rng": torch.get_rng_state()})
    if not dist.is_initialized() or dist.get_rank() == 0:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    if dist.is_initialized():
        dist.barrier()
    return final


def resolve(resume: str, root: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` names: none, latest (None if there is none yet) or a path."""
    if resume == "none":
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if not (path / checkpoint.MANIFEST).is_file():
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete checkpoint (no {checkpoint.MANIFEST} in it)")
    return path


def load(path: Path, model, optimizer, fingerprint: str) -> dict:
    """Restore model, optimizer and (same number of ranks) this rank's RNG; returns the train state,
    with `rng_restored` saying whether the RNG state came back."""
    state = checkpoint.read_manifest(path)["extra"]
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different model, data or optimizer config "
            f"(fingerprint {state.get('fingerprint')} vs {fingerprint}); resume it with the config it was made with"
        )
    rng = {"rng": torch.get_rng_state()}
    manifest = checkpoint.load(path, model, optimizer, per_rank=rng)
    world = dist.get_world_size() if dist.is_initialized() else 1
    state["rng_restored"] = manifest["world_size"] == world
    if state["rng_restored"]:
        torch.set_rng_state(rng["rng"])
    return state

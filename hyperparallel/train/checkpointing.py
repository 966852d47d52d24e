"""Training checkpoints: model, optimizer, scheduler, data position and RNG, in `step_NNNNNNNN`
directories under the checkpoint root, through `hyperparallel.checkpoint` (which writes each one
atomically, now or in the background, and loads it into any sharding layout). Here: naming,
`keep_last`, what `resume` (and an elastic restart) picks, the config fingerprint check, and
each rank's RNG state."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hyperparallel import checkpoint
from hyperparallel.errors import CheckpointError

_NAME = re.compile(r"^step_(\d{8})$")


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under root, oldest first."""
    return [p for p in checkpoint.complete_checkpoints(root) if _NAME.match(p.name)]


def not_a_model_directory(path: Path) -> str | None:
    """For a model.path that is a training checkpoint or a run directory (no Hugging Face model
    directory), what to do instead: export it to fine-tune from, or resume it; None otherwise."""
    found = checkpoint.checkpoint_in(path)  # (what export and generate would read from it)
    if not (found / checkpoint.MANIFEST).is_file():
        return None
    if found == path:
        return (f"model.path {path} is a training checkpoint, not a Hugging Face model directory: "
                f"`hyperparallel export {path} OUT_DIR` writes one to fine-tune from (model.path: OUT_DIR), and "
                f"checkpoint.resume: {path} continues the training that saved it")
    return (f"model.path {path} is a training run directory, not a Hugging Face model directory: "
            f"`hyperparallel export {found} OUT_DIR` writes its newest checkpoint as one to fine-tune from "
            f"(model.path: OUT_DIR), and checkpoint.resume: {found} continues that run")


def resolve(resume: str, root: Path, *, restarted: bool = False) -> Path | None:
    """The checkpoint to start from: what `checkpoint.resume` names (none, latest, or a path), or,
    after an elastic restart, the newest complete one under root (this run's own progress)."""
    newest = complete_checkpoints(root)[-1:] if restarted or resume == "latest" else []
    if newest:
        return newest[0]
    if resume in ("none", "latest"):
        return None
    path = Path(resume).expanduser()
    if not (path / checkpoint.MANIFEST).is_file():
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete checkpoint (no {checkpoint.MANIFEST} in it)")
    return path


def check_matches(path: Path, cfg) -> dict:
    """The train state saved in checkpoint `path`, after checking that `cfg` may continue it: the
    same fingerprint (what decides the numbers; the keys that differ are named)."""
    state = checkpoint.read_manifest(path)["extra"]
    if state.get("fingerprint") != cfg.fingerprint():
        saved = state.get("config")
        changed = ("; it differs in " + "; ".join(differences(saved, cfg.fingerprinted())) if saved else
                   " (it predates checkpoints that record their config, so the keys cannot be named)")
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different model, data or optimizer config{changed}; "
            f"resume it with the config it was made with"
        )
    return state


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """`key: old -> new` for each key of two configs' `fingerprinted()` that differs (`model.config:
    ...` names the inline config's keys that differ): what a refused resume names, and a run
    `resume: latest` passes over."""
    lines = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, "(absent)"), after.get(key, "(absent)")
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            inner = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
            lines.append(f"{key}: " + ", ".join(f"{k} {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}"
                                                for k in inner))
        else:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def load(path: Path, model, optimizer, cfg) -> dict:
    """Restore model, optimizer and (same number of ranks) this rank's RNG; returns the train state,
    with `rng_restored` saying whether the RNG state came back."""
    state = check_matches(path, cfg)
    rng = {"rng": torch.get_rng_state()}
    manifest = checkpoint.load(path, model, optimizer, per_rank=rng)
    world = dist.get_world_size() if dist.is_initialized() else 1
    state["rng_restored"] = manifest["world_size"] == world
    if state["rng_restored"]:
        torch.set_rng_state(rng["rng"])
    return state


class Checkpointer:
    """Saves every `every` steps and at the end, keeps the newest `keep_last`; with `background`,
    writes while training goes on (one save in flight at a time)."""

    def __init__(self, root: Path, *, every: int, keep_last: int, background: bool, is_main: bool,
                 background_group=None):
        self.root, self.every, self.keep_last = root, every, keep_last
        self.background, self.is_main = background, is_main
        self.background_group = background_group  # the writer thread's own gloo group
        self._pending: checkpoint.PendingSave | None = None

    def due(self, step: int, last: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == last

    def save(self, step: int, model, optimizer, train_state: dict) -> Path | None:
        """Write checkpoint `step` (every rank calls this). Returns its path when it is complete
        now; a background save's path comes from `poll` or `finish` once written."""
        done = self.finish()  # the previous background save first: its copy must not be overwritten
        extra, per_rank = dict(train_state, step=step), {"rng": torch.get_rng_state()}
        path = self.root / f"step_{step:08d}"
        if self.background:
            self._pending = checkpoint.async_save(path, model, optimizer, extra=extra, per_rank=per_rank,
                                                  process_group=self.background_group)
            return done
        checkpoint.save(path, model, optimizer, extra=extra, per_rank=per_rank)
        self._prune()
        return path

    def poll(self) -> Path | None:
        """The background save's path if it has just completed on this rank (then rank 0 prunes
        older ones)."""
        if self._pending is not None and self._pending.done():
            return self.finish()
        return None

    def finish(self) -> Path | None:
        """Wait for a background save in flight; its path, or None when there was none."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        path = pending.wait()
        self._prune()
        return path

    def _prune(self) -> None:
        # rank 0 alone, and no collective: `poll` runs on each rank at its own moment
        if self.is_main:
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                shutil.rmtree(old)

"""The run directory: `logging.run_dir` with `{time}` filled in, once per run.

`hyperparallel train --nproc N` resolves it before any rank starts and hands every rank (and
every elastic restart) the result, so they all write to and resume from the same directory.
Ranks started by torchrun itself resolve it on rank 0 (`train.loop`).

With a template whose last part is `{time}` (runs/{time}), `latest` beside the runs is a link to
the newest one started (as wandb's latest-run), so `hyperparallel export runs/latest hf-model`
needs no time typed.

`checkpoint.resume: latest` with a `{time}` template continues a run instead of starting one:
the newest directory the template names whose config.yaml has this config's fingerprint and
that holds a complete checkpoint.
"""

from __future__ import annotations

import glob
import os
import re
import time
from pathlib import Path

from hyperparallel.errors import ConfigError, HyperparallelError

TIME_FORMAT = "%Y%m%d-%H%M%S"
_TIME_PATTERN = r"\d{8}-\d{6}"


def expand(template: str, when: float | None = None) -> Path:
    """The template with `{time}` as the local time `when` (default: now)."""
    stamp = time.strftime(TIME_FORMAT, time.localtime(time.time() if when is None else when))
    return Path(template.format(time=stamp))


def resolve(cfg) -> Path:
    """The run directory of `cfg`: the template filled in, or with `resume: latest` and a
    `{time}` template, the run to continue (ConfigError naming where it looked if none)."""
    template = cfg.logging.run_dir
    if "{time}" not in template:
        return Path(template)
    if cfg.checkpoint.resume != "latest":
        return expand(template)
    if cfg.checkpoint.dir is not None:  # every run's checkpoints in one place: they say whose they are
        return run_of_newest_checkpoint(Path(cfg.checkpoint.dir), cfg)
    return newest_matching_run(template, cfg)


LATEST = "latest"


def point_latest(template: str, run_dir: Path) -> None:
    """For a template ending in `{time}`: RUN_DIR/../latest made a relative link to `run_dir`,
    replaced atomically; a `latest` that is no link is left alone, and where the file system has
    no links there is none (nothing else depends on it)."""
    link, tmp = run_dir.parent / LATEST, run_dir.parent / f".{LATEST}.{os.getpid()}"
    if Path(template).name != "{time}" or (link.exists() and not link.is_symlink()):
        return  # (a `latest` of the user's own is theirs)
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)


def run_of_newest_checkpoint(root: Path, cfg) -> Path:
    """The run directory recorded in the newest complete checkpoint under `root` of this config."""
    from hyperparallel.train.checkpointing import check_matches, complete_checkpoints

    for path in reversed(complete_checkpoints(root)):
        try:
            state = check_matches(path, cfg)
        except HyperparallelError:
            continue
        if state.get("run_dir"):
            return Path(state["run_dir"])
    raise ConfigError(f"checkpoint.resume: latest: no complete checkpoint in checkpoint.dir {root} was written by a "
                      f"run of this config; set checkpoint.resume: none to start one")


def runs_of(template: str) -> list[Path]:
    """The directories a `{time}` template has named, oldest first."""
    pattern = re.compile(re.escape(template).replace(re.escape("{time}"), f"({_TIME_PATTERN})"))
    found = []
    for match in glob.glob(template.replace("{time}", "*")):
        named = pattern.fullmatch(match)
        if named and Path(match).is_dir():
            found.append((named.groups(), Path(match)))
    return [path for _, path in sorted(found)]


def newest_matching_run(template: str, cfg) -> Path:
    from hyperparallel.train.checkpointing import complete_checkpoints, differences
    from hyperparallel.train.config import load_config

    wanted = cfg.fingerprinted()
    runs = runs_of(template)
    reasons = []
    for run in reversed(runs):
        try:
            theirs = load_config(run / "config.yaml").fingerprinted()
        except HyperparallelError:
            reasons.append(f"{run}: no valid config.yaml")
            continue
        if theirs != wanted:
            reasons.append(f"{run}: another config ({'; '.join(differences(theirs, wanted))})")
            continue
        if not complete_checkpoints(checkpoint_root(run, cfg.checkpoint.dir)):
            reasons.append(f"{run}: no complete checkpoint")
            continue
        return run
    where = template.replace("{time}", "*")
    if not runs:
        raise ConfigError(f"checkpoint.resume: latest: there is no run to continue in {where}; set checkpoint.resume: "
                          f"none to start one, or logging.run_dir to the run to continue")
    shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
    raise ConfigError(f"checkpoint.resume: latest: none of the {len(runs)} run(s) in {where} can be continued with "
                      f"this config: {shown}")


def check_not_another_run(run_dir: Path, resume: str) -> None:
    """A run directory that holds another run is never written into, unless resuming it."""
    if (run_dir / "metrics.jsonl").exists() and resume == "none":
        raise ConfigError(
            f"logging.run_dir {run_dir} already holds a run; choose another run_dir, or set checkpoint.resume: latest "
            f"to continue it"
        )


def checkpoint_root(run_dir: Path, configured: str | None) -> Path:
    return Path(configured) if configured else run_dir / "checkpoints"

"""The run directory: `logging.run_dir` with `{time}` filled in, once per run.

`hyperparallel train --nproc N` resolves it before any rank starts and hands every rank (and
every elastic restart) the result, so they all write to and resume from the same directory.
Ranks started by torchrun itself resolve it from rank 0's clock.
"""

from __future__ import annotations

import time
from pathlib import Path

from hyperparallel.errors import ConfigError

TIME_FORMAT = "%Y%m%d-%H%M%S"


def expand(template: str, when: float | None = None) -> Path:
    """The template with `{time}` as the local time `when` (default: now)."""
    stamp = time.strftime(TIME_FORMAT, time.localtime(time.time() if when is None else when))
    return Path(template.format(time=stamp))


def check_not_another_run(run_dir: Path, resume: str) -> None:
    """A run directory that holds another run is never written into, unless resuming it."""
    if (run_dir / "metrics.jsonl").exists() and resume == "none":
        raise ConfigError(
            f"logging.run_dir {run_dir} already holds a run; choose another run_dir, or set checkpoint.resume: latest "
            f"to continue it"
        )


def checkpoint_root(run_dir: Path, configured: str | None) -> Path:
    return Path(configured) if configured else run_dir / "checkpoints"

"""Weights & Biases (logging.wandb): the run's records, as metrics.jsonl and TensorBoard have them,
logged to a W&B run from rank 0, with the resolved config.

The run directory is the W&B run: its id is kept in RUN_DIR/wandb_run_id, so a run resumed in its
directory (checkpoint.resume, an elastic restart) continues the same W&B run, and W&B's own files
go to RUN_DIR/wandb/. The `wandb` package is optional (`pip install wandb`, or the [wandb] extra):
`problems()` names it before any work when a config asks for W&B without it.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path

ID_FILE = "wandb_run_id"


def problems(settings) -> list[str]:
    """A config asking for W&B where the package is not installed: its one-line problem."""
    if not settings.enabled() or importlib.util.find_spec("wandb") is not None:
        return []
    return ["logging.wandb.project is set but the wandb package is not installed: pip install wandb "
            "(or the package's [wandb] extra), or remove logging.wandb.project"]


def _run_id(run_dir: Path) -> tuple[str, bool]:
    """This run directory's W&B run id, and whether it continues one: the id kept there, or a
    new one kept there now."""
    path = run_dir / ID_FILE
    if path.is_file():
        return path.read_text().strip(), True
    run_id = secrets.token_hex(4)  # (W&B's ids: a few lowercase letters and digits)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id, False


class WandbRun:
    """One W&B run for a run directory: `log` a record's scalars at its step, `finish` at the end."""

    def __init__(self, settings, run_dir: Path, config: dict):
        import wandb

        run_id, continued = _run_id(run_dir)
        try:
            self.run = wandb.init(
                project=settings.project, entity=settings.entity, name=settings.name or run_dir.name,
                tags=list(settings.tags), mode=settings.mode, dir=str(run_dir), config=config,
                id=run_id, resume="allow" if continued else None,
                # the console stays the trainer's (its progress bar is no log); the records are logged
                settings=wandb.Settings(console="off"))
        except wandb.errors.Error as error:  # (online without a login, an unknown entity, ...)
            from hyperparallel.errors import ConfigError

            raise ConfigError(f"logging.wandb: W&B did not start the run ({str(error).splitlines()[0]}); "
                              "`wandb login`, or logging.wandb.mode=offline") from None

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        self.run.finish()

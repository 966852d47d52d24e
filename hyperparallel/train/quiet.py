"""What the libraries say during a run goes to the run directory, not to the console.

transformers, huggingface_hub, torch (Dynamo, Inductor, distributed), triton and the libraries
they load log warnings, warn through Python's `warnings` and draw tqdm progress bars ("Loading
weights", "Writing model shards") that a user of `hyperparallel train` cannot act on. While a
run trains (`LibraryOutput`, which `train.loop.train` enters on every rank):

- their log records go to `RUN_DIR/libraries.log` (made when the first arrives; one line each,
  naming the rank), and only those at ERROR or above reach stderr too: an error is never
  silenced;
- warnings go there too, but for the hyperparallel package's own, which print as usual;
- transformers' and huggingface_hub's progress bars are off.

Records from before the run directory is known (importing, joining the ranks, the preflight) are
held and written when it is; a run that fails before that has nothing else to say. Everything is
put back on exit, so a process that trains in-process (tests, a notebook) keeps its settings.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import hyperparallel

LOG_FILE = "libraries.log"
_OUR_FILES = str(Path(hyperparallel.__file__).parent) + os.sep  # (our warnings are shown as usual)
_HELD = 10_000  # lines held at most before the run directory is known


class _RunLog(logging.Handler):
    """The run's libraries.log: one line per record or warning, held until its path is known."""

    def __init__(self, rank: int):
        super().__init__()
        self.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
        self.path: Path | None = None
        self.held: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record))
        except Exception:  # noqa: BLE001  (logging's own rule: a handler never raises)
            self.handleError(record)

    def write(self, text: str) -> None:
        if self.path is None:
            if len(self.held) < _HELD:
                self.held.append(text)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # (each rank appends whole lines)
            f.write(text + "\n")

    def keep_in(self, path: Path) -> None:
        self.acquire()
        try:
            self.path, held = path, self.held
            self.held = []
            for text in held:
                self.write(text)
        finally:
            self.release()


def _console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers that write to a stream, not a file: StreamHandlers, and torch's (from 2.15 a
    plain Handler whose `stream` is whatever sys.stderr is when it writes)."""
    return [h for h in logger.handlers if hasattr(h, "stream") and not isinstance(h, logging.FileHandler)]


class LibraryOutput:
    """The context of a run in which the libraries' output goes to its log (the module's docstring)."""

    def __init__(self, rank: int = 0):
        self.log = _RunLog(rank)
        self.errors = logging.StreamHandler(sys.stderr)  # (what still reaches the console: errors)
        self.errors.setLevel(logging.ERROR)
        self.errors.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
        self._taken: dict[str, tuple[list[logging.Handler], bool]] = {}
        self._restore_bars = None
        self._warnings = warnings.catch_warnings()
        self._show = None  # (the showwarning a run found, for our own warnings)

    def __enter__(self) -> LibraryOutput:
        root = logging.getLogger()
        root.addHandler(self.log)
        root.addHandler(self.errors)
        self._restore_bars = progress_bars_off()
        self.sweep()
        self._warnings.__enter__()
        self._show = warnings.showwarning
        warnings.showwarning = self._warning
        return self

    def __exit__(self, *exc) -> None:
        self._warnings.__exit__(*exc)
        for name, (handlers, propagate) in self._taken.items():
            logger = logging.getLogger(name)
            logger.handlers[:0] = handlers
            logger.propagate = propagate
        self._taken.clear()
        self._restore_bars()
        root = logging.getLogger()
        root.removeHandler(self.log)
        root.removeHandler(self.errors)

    def sweep(self) -> None:
        """Every library logger that prints to the console itself (torch's and transformers' do,
        not through the root logger) made to pass its records up to the root's handlers, ours.
        Loggers made later without a console handler of their own pass them up already."""
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if not isinstance(logger, logging.Logger) or name in self._taken or name.startswith("hyperparallel"):
                continue
            console = _console_handlers(logger)
            if console:
                self._taken[name] = (console, logger.propagate)
                for handler in console:
                    logger.removeHandler(handler)
                logger.propagate = True

    def keep_in(self, path: Path) -> None:
        """The run's directory is known: what was held, and everything after, goes to `path`."""
        self.sweep()  # (libraries imported since: the model's, the data's)
        self.log.keep_in(path)

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if str(filename).startswith(_OUR_FILES):
            self._show(message, category, filename, lineno, file, line)
            return
        self.log.handle(logging.LogRecord("py.warnings", logging.WARNING, str(filename), lineno, "%s:%s: %s: %s",
                                          (filename, lineno, category.__name__, message), None))


def quiet_optional_imports() -> None:
    """For every command, before anything is imported: transformers imports torchao when it is
    installed (the `bench` extra). torchao then logs a warning for each of its CUDA and
    other-Python libraries that cannot load here, and registers enums that torch's pytree warns
    about: lines on every run that concern nothing a command does."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def progress_bars_off():
    """transformers' tqdm bars (and huggingface_hub's, which it switches with its own) off; returns
    what turns them back to how they were."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    transformers_on, hub_off = hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()

    def restore() -> None:
        if transformers_on:
            hf_logging.enable_progress_bar()
        if hub_off:
            hub.disable_progress_bars()
        else:
            hub.enable_progress_bars()

    return restore

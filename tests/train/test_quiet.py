"""During a run the libraries' warnings, log records and progress bars go to RUN_DIR/libraries.log,
not to the console; their errors, and our own warnings, still reach stderr; everything is put back
after. (tests/train/test_examples.py checks a real run's stderr of every shipped config.)"""

from __future__ import annotations

import logging
import warnings

import torch  # noqa: F401  (its loggers, with their own stderr handlers, exist before a run as in one)
from transformers.utils import logging as hf_logging

from hyperparallel.train.quiet import LOG_FILE, LibraryOutput


def noise(warn: bool = True) -> None:
    """What libraries print during a run: a torch logger's warning (torch gives it a stderr handler
    of its own), transformers' warning, a Python warning from a library's file, a tqdm bar."""
    logging.getLogger("torch._inductor").warning("inductor: not enough SMs for max_autotune")
    logging.getLogger("transformers.modeling_utils").warning("some weights were not initialized")
    if warn:  # (outside a run pytest would collect it)
        warnings.warn_explicit("TypedStorage is deprecated", UserWarning, "/site-packages/torch/storage.py", 7)
    for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
        pass


def test_library_noise_goes_to_the_run_log_and_errors_still_reach_stderr(tmp_path, capfd):
    noise(warn=False)
    assert "Loading weights" in capfd.readouterr().err  # (without the run's context: all on stderr)
    with LibraryOutput(rank=1) as libraries:
        noise()  # before the run directory is known: held
        libraries.keep_in(tmp_path / "run" / LOG_FILE)
        logging.getLogger("triton").warning("triton: the driver is older than the toolkit")  # (no handler of its own)
        logging.getLogger("torch.distributed").error("a collective failed")
    err = capfd.readouterr().err
    assert err == "torch.distributed: ERROR: a collective failed\n"
    log = (tmp_path / "run" / LOG_FILE).read_text().splitlines()
    assert [line.split(" rank 1 ", 1)[1] for line in log] == [
        "WARNING torch._inductor: inductor: not enough SMs for max_autotune",
        "WARNING transformers.modeling_utils: some weights were not initialized",
        "WARNING py.warnings: /site-packages/torch/storage.py:7: UserWarning: TypedStorage is deprecated",
        "WARNING triton: triton: the driver is older than the toolkit",
        "ERROR torch.distributed: a collective failed",
    ]
    noise(warn=False)  # after the run: as before it
    assert "Loading weights" in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()


def test_our_own_warnings_are_shown_as_before(tmp_path, monkeypatch):
    import hyperparallel.train.quiet as quiet

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: shown.append(str(message)))
    with LibraryOutput() as libraries, warnings.catch_warnings():
        warnings.simplefilter("always")
        libraries.keep_in(tmp_path / LOG_FILE)
        warnings.warn_explicit("ours", UserWarning, quiet.__file__, 1)
    assert shown == ["ours"] and not (tmp_path / LOG_FILE).exists()

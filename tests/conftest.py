"""Session checks shared by every test module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    # The native library is built by `make setup`; testing an old build against new sources
    # would report on code that is not the code under test.
    spec = importlib.util.find_spec("hyperparallel._mx_native")
    if spec is None or spec.origin is None:
        raise pytest.UsageError("hyperparallel._mx_native is not built: run `make setup` (or `make test`)")
    built = Path(spec.origin).stat().st_mtime
    stale = [p.name for p in (ROOT / "csrc").glob("*.[ch]") if p.stat().st_mtime > built]
    if stale:
        raise pytest.UsageError(f"hyperparallel._mx_native is older than csrc/{stale[0]}: run `make setup` to rebuild it")

"""Session checks shared by every test module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Each native library and the C sources it is built from (setup.py).
NATIVE = {"hyperparallel._mx_native": "mx_*.[ch]", "hyperparallel._dvm_native": "dvm_*.[ch]",
          "hyperparallel._mega_gate_native": "mega_gate*.[ch]", "hyperparallel._mega_mhc_native": "mega_mhc*.[ch]"}


def pytest_sessionstart(session):
    # The native libraries are built by `make setup`; testing an old build against new sources
    # would report on code that is not the code under test.
    for module, sources in NATIVE.items():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise pytest.UsageError(f"{module} is not built: run `make setup` (or `make test`)")
        built = Path(spec.origin).stat().st_mtime
        stale = [p.name for p in (ROOT / "csrc").glob(sources) if p.stat().st_mtime > built]
        if stale:
            raise pytest.UsageError(f"{module} is older than csrc/{stale[0]}: run `make setup` to rebuild it")


# The multi-rank MoE cases of three test files run in one spawn per world size
# (tests/dist/test_expert_parallel.py's worker): starting gloo ranks costs more than the cases.
@pytest.fixture(scope="session")
def ep_spawn_2(tmp_path_factory) -> list[dict]:
    from tests.dist.test_expert_parallel import spawn

    return spawn(2, tmp_path_factory.mktemp("moe2"))


@pytest.fixture(scope="session")
def ep_spawn_4(tmp_path_factory) -> list[dict]:
    from tests.dist.test_expert_parallel import spawn

    return spawn(4, tmp_path_factory.mktemp("moe4"))


# The 4-rank cases of tests/dist/test_parallel_layouts.py and test_context_parallel.py: one spawn.
@pytest.fixture(scope="session")
def parallel_spawn_4(tmp_path_factory) -> dict:
    from tests.dist.test_parallel_layouts import spawn

    return spawn(tmp_path_factory.mktemp("parallel4"))

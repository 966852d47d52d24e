"""Session checks shared by every test module."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Each native library and the C sources it is built from (setup.py), csrc/hp_isa.h in all of them.
NATIVE = {"hyperparallel._mx_native": ("mx_*.[ch]", "hp_*.h"), "hyperparallel._dvm_native": ("dvm_*.[ch]", "hp_*.h"),
          "hyperparallel._mega_gate_native": ("mega_gate*.[ch]", "dvm_math.h", "hp_*.h"),
          "hyperparallel._mega_mhc_native": ("mega_mhc*.[ch]", "hp_*.h")}


def pytest_sessionstart(session):
    # Caches kept per machine (the CPU's measured MFU peak, hyperparallel.train.peak_flops) go to a
    # directory of this session's, for its processes too: a test never reads or writes the user's.
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hyperparallel-test-cache-")
    # The native libraries are built by `make setup`; testing an old build against new sources
    # would report on code that is not the code under test.
    for module, sources in NATIVE.items():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise pytest.UsageError(f"{module} is not built: run `make setup` (or `make test`)")
        built = Path(spec.origin).stat().st_mtime
        stale = [p.name for glob in sources for p in (ROOT / "csrc").glob(glob) if p.stat().st_mtime > built]
        if stale:
            raise pytest.UsageError(f"{module} is older than csrc/{stale[0]}: run `make setup` to rebuild it")


@pytest.fixture
def cli(tmp_path, monkeypatch, capfd):
    """`hyperparallel ARGS` in this process, as a user runs it from tmp_path (with a cache of its
    own): the CompletedProcess a subprocess would give, for the CLI's behaviour where a new
    process is not the point (tests/train/test_cli_train.py keeps one from `python -m
    hyperparallel`). Starting ranks is refused: `--nproc` runs get processes of their own."""
    import subprocess

    from hyperparallel.cli import main
    from hyperparallel.train import launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("an in-process `hyperparallel train --nproc` would start ranks: run it in a subprocess")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "launch", no_ranks)

    def call(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # (argparse's own errors and --help exit; a process would give the code)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return call


# Every multi-rank part of the session runs in one spawn per world size (tests/dist/spawn.py):
# starting gloo ranks costs more than the cases. Each fixture: part name -> each rank's results.
def _spawned(world: int, request) -> dict[str, list]:
    from tests.dist.spawn import parts_for, spawn

    modules = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    parts = parts_for(world, modules)
    for earlier in sorted({w for part in parts for w in part.after if w != world}):
        request.getfixturevalue(f"spawn_{earlier}")  # its files are inputs of this one
    return spawn(world, parts, request.getfixturevalue("spawn_dir"))


@pytest.fixture(scope="session")
def spawn_dir(tmp_path_factory) -> Path:
    """Where the shared spawns' parts write (tests/dist/spawn.py's part_dir)."""
    return tmp_path_factory.mktemp("spawned")


@pytest.fixture(scope="session")
def spawn_2(request) -> dict[str, list]:
    return _spawned(2, request)


@pytest.fixture(scope="session")
def spawn_3(request) -> dict[str, list]:
    return _spawned(3, request)


@pytest.fixture(scope="session")
def spawn_4(request) -> dict[str, list]:
    return _spawned(4, request)


# The multi-rank MoE cases of four test files (tests/dist/test_expert_parallel.py's `on_ranks`).
@pytest.fixture(scope="session")
def ep_spawn_2(spawn_2) -> list[dict]:
    return spawn_2["moe"]


@pytest.fixture(scope="session")
def ep_spawn_4(spawn_4) -> list[dict]:
    return spawn_4["moe"]


# The 4-rank cases of tests/dist/test_parallel_layouts.py and test_context_parallel.py.
@pytest.fixture(scope="session")
def parallel_spawn_4(spawn_4, spawn_dir) -> dict:
    per_rank = spawn_4["parallel"]
    trainer = spawn_4.get("parallel_trainer", [None])[0]
    return {**per_rank[0], "trainer": trainer, "per_rank": per_rank, "dir": spawn_dir / "parallel"}

"""kernels.native: the one loader of the native libraries and its version check, and that every
ctypes load and every reading of TRITON_INTERPRET goes through kernels."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from hyperparallel.kernels import native
from hyperparallel.kernels.mega_gate import native as mega_gate_native

PACKAGE = Path(__file__).resolve().parents[2] / "hyperparallel"
SIGNATURES = {"hp_mega_gate_backward": (None, ctypes.c_int)}


@pytest.fixture(autouse=True)
def _own_reasons(monkeypatch):
    monkeypatch.setattr(native, "_REASONS", {})  # the real libraries' state stays as it was


def test_a_library_that_is_not_built_is_none_with_the_reason():
    assert native.load("hyperparallel._no_such_native", SIGNATURES) is None
    assert native.unavailable_reason("hyperparallel._no_such_native") == (
        "the native library hyperparallel._no_such_native is not built (no C compiler where it was installed; in "
        "a checkout: run `make setup`)")


@pytest.mark.skipif(mega_gate_native.LIB is None, reason="native library not built")
def test_a_stale_build_is_never_used(monkeypatch):
    module = mega_gate_native.MODULE
    assert native.load(module, {**SIGNATURES, "hp_mega_gate_from_the_future": ([], None)}) is None
    assert "stale build (it has no hp_mega_gate_from_the_future)" in native.unavailable_reason(module)
    function, version = native.VERSIONS[module]
    monkeypatch.setitem(native.VERSIONS, module, (function, version + 1))
    assert native.load(module, SIGNATURES) is None
    assert f"{function}() is {version}, this code needs {version + 1}" in native.unavailable_reason(module)


@pytest.mark.skipif(mega_gate_native.LIB is None, reason="native library not built")
def test_a_load_that_succeeds_keeps_an_earlier_refusal():
    module = mega_gate_native.MODULE
    assert native.unavailable_reason(module) is None
    lib = native.load(module, SIGNATURES)
    assert lib is not None and native.unavailable_reason(module) is None
    assert lib.hp_mega_gate_backward.restype is ctypes.c_int
    assert native.load(module, {"hp_mega_gate_from_the_future": ([], None)}) is None
    assert native.load(module, SIGNATURES) is not None
    assert "hp_mega_gate_from_the_future" in native.unavailable_reason(module)  # its caller holds None


def test_a_library_that_cannot_be_loaded_is_none_with_the_reason(tmp_path, monkeypatch):
    broken = tmp_path / "_broken_native.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert native.load("_broken_native", SIGNATURES) is None
    assert native.unavailable_reason("_broken_native").startswith("the native library _broken_native cannot be loaded (")


def test_every_library_has_the_version_this_code_needs():
    """(No skip when one is not built: conftest.py refuses such a session before this runs.)"""
    for module, (function, version) in native.VERSIONS.items():
        lib = native.load(module, {function: ([], ctypes.c_int)})
        assert lib is not None, native.unavailable_reason(module)
        assert getattr(lib, function)() == version


def _files_with(text: str) -> list[str]:
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if text in p.read_text())


def test_one_loader_and_one_triton_support():
    assert _files_with("CDLL(") == ["kernels/native.py"]
    assert _files_with("TRITON_INTERPRET") == ["kernels/triton_support.py"]


def test_not_built_names_the_libraries_an_install_lacks(monkeypatch):
    assert native.not_built() == []  # (make setup built them all)
    monkeypatch.setitem(native.VERSIONS, "hyperparallel._no_such_native", ("hp_none_version", 1))
    assert native.not_built() == ["hyperparallel._no_such_native"]


def test_mx_on_the_cpu_runs_the_reference_where_its_library_was_not_built(monkeypatch):
    """Not built (a source install without a compiler): the reference. A checkout's stale or broken
    build is not that: the cpu backend stays the choice, and says why it cannot run."""
    import torch

    from hyperparallel.mx import backends, reference
    from hyperparallel.mx.backends import cpu

    assert backends.get_backend(None, torch.device("cpu")) is cpu  # (this install built it)
    assert backends.cpu_default(["hyperparallel._mx_native"]) == "reference" and backends.cpu_default([]) == "cpu"
    monkeypatch.setattr(backends, "_CPU_DEFAULT", backends.cpu_default(["hyperparallel._mx_native"]))
    assert backends.get_backend(None, torch.device("cpu")) is reference

"""Triton's interpreter for the kernel tests, which run the Triton kernels on CPU tensors.

TRITON_INTERPRET=1 is set before triton is first imported (importing torch can import it), as
the interpreter needs, and put back as it was right after the test module's imports (`imports`);
it is set again only while a test that asks for it runs (the `triton_interpreter` fixture), so
that the other test modules of the session see the environment they were started with:

    from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

    with imports():
        import torch
        from hyperparallel.mx.backends import triton as tb

    pytestmark = pytest.mark.usefixtures("triton_interpreter")
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

_VARIABLE = "TRITON_INTERPRET"


@contextlib.contextmanager
def imports() -> Iterator[None]:
    """TRITON_INTERPRET=1 inside (a test module's imports), the environment as it was after."""
    previous = os.environ.get(_VARIABLE)
    os.environ[_VARIABLE] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_VARIABLE]
        else:
            os.environ[_VARIABLE] = previous


@pytest.fixture
def triton_interpreter(monkeypatch) -> None:
    """The Triton kernels run by the interpreter (on CPU tensors) in this test."""
    monkeypatch.setenv(_VARIABLE, "1")


__all__ = ["imports", "triton_interpreter"]

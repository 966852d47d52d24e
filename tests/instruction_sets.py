"""The native kernels at every instruction-set level the processor has (hyperparallel.kernels.use_isa):

    from tests import instruction_sets

    isa = instruction_sets.isa     # the fixture, in the test module

    def test_something(isa): ...   # once per level: generic, avx2, avx512

A level the processor lacks is skipped; the best level is put back after each test.
"""

from __future__ import annotations

import pytest

from hyperparallel.kernels import LEVELS, use_isa


@pytest.fixture(params=LEVELS)
def isa(request):
    """Each instruction set the processor has (the portable one always)."""
    name = use_isa(request.param)
    try:
        if name != request.param:
            pytest.skip(f"the processor has no {request.param}: its best kernels are the {name} ones")
        yield name
    finally:
        use_isa("avx512")


__all__ = ["isa"]

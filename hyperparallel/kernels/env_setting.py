"""An environment variable set for the length of a block, as a user would set it, and put back
after (the comparisons of benchmarks and tests: `fusion.vf.lowering_with`, `mx.gemm_path.forcing`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def env_set(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: unset) inside the block, as it was after it."""
    previous = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous

"""Process groups made once per default process group.

A process that builds again (a test's cases, a notebook's runs, one trainer run after another)
would otherwise make its groups again, and every group lives until the process ends or the
default group is destroyed: gloo keeps a connection loop and two worker threads per group, and
each idle loop wakes often enough to cost about 0.1% of a core (measured: 20 idle groups, 0.09 s
of CPU in 3 s). Hundreds of them (the test spawn building a mesh per case: 1,800 threads a rank,
load average 1,170 on 2 cores) kept the 4-rank spawn, 2 minutes without them, from finishing
in 80 (CI's run, 2026-12-07). So whatever makes groups keeps them here, under a key naming what they are, and a later build
over the same default group takes the same ones. A new default group (the old one destroyed, or
another joined) starts afresh: its groups are made again, collectively, in the same order on
every rank, as new_group requires.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

# the default group the entries were made under, and key -> what was made
_made: dict[Hashable, object] = {}
_world: list[object] = [None]


def made_once(key: Hashable, make: Callable[[], T]) -> T:
    """What `make()` returned for `key` under the current default process group, made on the
    first call. `make` may be collective (new_group): every rank must ask for the same keys in the
    same order, as they would have called `make`."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if _world[0] is not world:
        _made.clear()
        _world[0] = world
    if key not in _made:
        _made[key] = make()
    return _made[key]  # type: ignore[return-value]

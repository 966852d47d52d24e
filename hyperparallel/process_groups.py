"""Process groups made once per default process group.

A process that builds the same layout again (a test's cases, a notebook's runs, one run after
another over the same ranks) would otherwise make its groups again, and every group lives until
the process ends or the default group is destroyed: gloo keeps a connection loop and two worker
threads per group, and each idle loop wakes often enough to cost about 0.15% of a core (20 idle
groups: 0.09 s of CPU in 3 s). Hundreds of them (the test spawn building a mesh per case: 1,800
threads a rank, load average 1,170 on 2 cores) left the 4-rank spawn, 2 minutes without them,
unfinished after 80 (CI's run, 2026-12-07). So the mesh (parallel/mesh.py), the pipeline's
tied-embedding pairs and `checkpoint.async_save`'s group keep theirs here, under a key naming
what they are, and a later build over the same default group takes the same ones. A new default
group starts afresh: its groups are made again, collectively, in the same order on every rank, as
new_group requires. Whoever destroys the default group calls `forget` first, so the groups made
under it go with it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")

_made: dict[Hashable, object] = {}  # key -> what was made
_world: object = None  # the default group they were made under


def made_once(key: Hashable, make: Callable[[], T]) -> T:
    """What `make()` returned for `key` under the current default process group, made on the
    first call. `make` may be collective (new_group): every rank must ask for the same keys in the
    same order, as they would have called `make`."""
    global _world
    world = dist.group.WORLD if dist.is_initialized() else None
    if _world is not world:
        forget()
        _world = world
    if key not in _made:
        _made[key] = make()
    return _made[key]  # type: ignore[return-value]


def forget() -> None:
    """Drop every group kept (before the default group is destroyed: nothing then holds them)."""
    global _world
    _made.clear()
    _world = None

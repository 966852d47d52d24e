"""The CPU allocator's own account of a piece of work, as the profiler records it: the tests that
compare a plan's or a build's bytes with what really happened read their peaks here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile


@contextmanager
def allocator_peak() -> Iterator[list[int]]:
    """The most tensor bytes alive at once, beyond those alive before, while the block runs (the
    CPU allocator's events, in time order): yields a list that holds that figure afterwards."""
    peak: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = most = 0
    for _, n in events:
        live += n
        most = max(most, live)
    peak.append(most)

"""The CPU device model's collectives (train/planning/cpu_gloo.py): gloo calls measured among as
many processes as a run has ranks, for each group size a layout over them can have."""

from __future__ import annotations

import pytest

from hyperparallel.train.planning import cpu_gloo


def test_the_group_sizes_are_every_divisor_from_two():
    assert cpu_gloo.group_sizes(1) == [2] and cpu_gloo.group_sizes(4) == [2, 4]
    assert cpu_gloo.group_sizes(6) == [2, 3, 6] and cpu_gloo.group_sizes(7) == [7]


def test_gloo_calls_are_measured_among_processes():
    """Two processes all-reducing over gloo after chunks of compute: each size's cost, from real
    calls, none below a smaller size's; the slope 0 where each process has a core."""
    import os

    table = cpu_gloo.measure(2)
    assert [c.ranks for c in table] == [2]
    (calls,) = table
    assert [b for b, _ in calls.points] == [float(n) for n in cpu_gloo.SIZES]  # (2 ranks: a rank sends n)
    seconds = [s for _, s in calls.points]
    assert 0 < seconds[0] < 1 and seconds == sorted(seconds)  # (a call takes under a second)
    assert 0 < calls.chunk_s < 1
    if len(os.sched_getaffinity(0)) >= 2:
        assert calls.slope == 0.0


def test_a_group_call_interpolates_its_sizes_and_adds_compute_beyond_its_chunk():
    calls = cpu_gloo.GroupCalls(2, ((4, 1e-3), (1004, 2e-3), (2004, 4e-3)), chunk_s=1e-3, slope=0.5)
    assert calls.seconds(4) == 1e-3 and calls.seconds(0) == 1e-3
    assert calls.seconds(504) == pytest.approx(1.5e-3) and calls.seconds(1504) == pytest.approx(3e-3)
    # beyond the largest: the rate from the smallest to the largest (3 ms over 2000 bytes)
    assert calls.seconds(4004) == pytest.approx(4e-3 + 2000 * 3e-3 / 2000)
    # compute before the call: below one chunk's, one chunk's cost; beyond it, the slope
    assert calls.seconds(4, compute_s=0.5e-3) == 1e-3
    assert calls.seconds(4, compute_s=5e-3) == pytest.approx(1e-3 + 0.5 * 4e-3)
    rate, latency = calls.link()
    assert rate == pytest.approx(2000 / 3e-3) and latency == pytest.approx(0.5e-3)

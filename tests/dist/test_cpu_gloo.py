"""The CPU device model's collectives (train/planning/cpu_gloo.py): gloo calls measured among as
many processes as a run has ranks, for each group size a layout over them can have."""

from __future__ import annotations

from hyperparallel.train.planning import cpu_gloo


def test_the_group_sizes_are_every_divisor_from_two():
    assert cpu_gloo.group_sizes(1) == [2] and cpu_gloo.group_sizes(4) == [2, 4]
    assert cpu_gloo.group_sizes(6) == [2, 3, 6] and cpu_gloo.group_sizes(7) == [7]


def test_gloo_calls_are_measured_among_processes():
    """Two processes all-reducing over gloo: a call's fixed time and its rate, from real calls."""
    table = cpu_gloo.measure(2, nbytes=2**18)
    assert [g for g, *_ in table] == [2]
    (_, fixed, rate, _), = table
    assert 0 < fixed < 1 and rate > 1e6  # (a call takes under a second; the link moves over a MB/s)

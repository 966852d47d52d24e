"""The CPU device model's collectives (train/planning/cpu_gloo.py): gloo calls measured among as
many processes as a run has ranks, for each group size a layout over them can have."""

from __future__ import annotations

import pytest

from hyperparallel.train.planning import cpu_gloo


def test_the_group_sizes_are_every_divisor_from_two():
    assert cpu_gloo.group_sizes(1) == [2] and cpu_gloo.group_sizes(4) == [2, 4]
    assert cpu_gloo.group_sizes(6) == [2, 3, 6] and cpu_gloo.group_sizes(7) == [7]


def test_gloo_calls_are_measured_among_processes(monkeypatch):
    """Two processes all-reducing over gloo after chunks of compute: every size's cost, from real
    calls, and the chunk's wall time (about 1 ms of one core)."""
    rows = []
    group_calls = cpu_gloo._group_calls
    monkeypatch.setattr(cpu_gloo, "_group_calls", lambda g, repeats, **kw: rows.append(repeats) or group_calls(g, repeats, **kw))
    table = cpu_gloo.measure(2)
    assert [c.ranks for c in table] == [2]
    (calls,) = table
    assert [b for b, _ in calls.points] == [float(n) for n in cpu_gloo.SIZES]  # (2 ranks: a rank sends n)
    assert all(s < 1 for _, s in calls.points)  # (a call takes under a second)
    assert calls.points[-1][1] > calls.points[0][1]  # (4 MiB takes longer than 4 bytes: measured 4.6 against 0.7 ms)
    assert 1e-4 < calls.chunk_s < 0.1
    if cpu_gloo.usable_cores() >= 2:  # (each process a core of its own: no slope, its rows not measured)
        assert calls.slope == 0.0 and not any(name.startswith("long") for name in rows[0][0])


def _rows(chunk: float, costs: dict[int, float], long: float = 0.0, after_long: float = 0.0) -> dict[str, float]:
    """One repeat's rows: the chunks alone, each size's chunk-and-call rows, the long chunks alone and with the small call."""
    return {"chunk": chunk, **{str(n): chunk + c for n, c in costs.items()}, "long": long, "long+4": long + after_long}


def test_a_group_call_is_the_median_repeat_of_the_slowest_rows_differences():
    """_group_calls: each cost a difference of two rows of one repeat, the median over repeats; a
    larger call no cheaper than a smaller; a group of 4's bytes are what a rank sends (1.5 n); the
    slope only where the ranks outnumber the cores, from the long chunk's call."""
    sizes = cpu_gloo.SIZES
    base = {n: 1e-3 * (i + 1) for i, n in enumerate(sizes)}
    dip = {**base, sizes[2]: 0.5e-3}  # (the third size measured below the second: noise)
    repeats = [
        _rows(1e-3, dip, long=3e-3, after_long=2e-3),
        _rows(5e-3, base, long=15e-3, after_long=1e-3),  # (a slow phase: every row longer, the differences alike)
        _rows(1e-3, {n: c * 3 for n, c in dip.items()}, long=3e-3, after_long=3e-3),
    ]
    calls = cpu_gloo._group_calls(4, repeats, outnumbered=True)
    assert [b for b, _ in calls.points] == [1.5 * n for n in sizes]
    expected = [1e-3, 2e-3, 2e-3, 4e-3, 5e-3, 6e-3]  # (the third's median 1.5 ms, raised to the second's 2)
    assert [s for _, s in calls.points] == pytest.approx(expected)
    assert calls.chunk_s == pytest.approx(1e-3)
    # per repeat: (after the long chunk - after one chunk) / (long - chunk) = 0.5, 0, 0 -> median 0
    assert calls.slope == pytest.approx(0.0, abs=1e-12)
    repeats[1] = _rows(1e-3, base, long=3e-3, after_long=3e-3)  # (slopes 0.5, 1.0, 0 -> median 0.5)
    assert cpu_gloo._group_calls(4, repeats, outnumbered=True).slope == pytest.approx(0.5)
    assert cpu_gloo._group_calls(4, repeats, outnumbered=False).slope == 0.0
    # a repeat whose long chunks came out no longer than its short ones is left out of the slope
    repeats[2] = _rows(1e-3, base, long=1e-3, after_long=9e-3)  # (slopes 0.5, 1.0 -> 0.75)
    assert cpu_gloo._group_calls(4, repeats, outnumbered=True).slope == pytest.approx(0.75)
    # every repeat's long chunks no longer than its short ones: no slope measured, 0
    flat = [_rows(1e-3, base, long=1e-3, after_long=5e-3)] * 3
    assert cpu_gloo._group_calls(4, flat, outnumbered=True).slope == 0.0
    # not outnumbered: the long rows are not measured
    short = [{k: v for k, v in rows.items() if not k.startswith("long")} for rows in repeats]
    assert cpu_gloo._group_calls(4, short, outnumbered=False).slope == 0.0


def test_a_call_measured_no_longer_than_the_chunks_still_costs_something():
    rows = _rows(1e-3, dict.fromkeys(cpu_gloo.SIZES, 0.0))
    calls = cpu_gloo._group_calls(2, [rows] * 3, outnumbered=False)
    assert all(s == cpu_gloo.MIN_CALL_S for _, s in calls.points)
    rate, _ = calls.link()  # (the largest call's cost per byte: finite)
    assert rate == pytest.approx(2**22 / cpu_gloo.MIN_CALL_S)


def test_a_group_call_interpolates_its_sizes_and_adds_compute_beyond_its_chunk():
    calls = cpu_gloo.GroupCalls(2, ((4, 1e-3), (1004, 2e-3), (2004, 4e-3)), chunk_s=1e-3, slope=0.5)
    assert calls.seconds(4) == 1e-3 and calls.seconds(0) == 1e-3
    assert calls.seconds(504) == pytest.approx(1.5e-3) and calls.seconds(1504) == pytest.approx(3e-3)
    # beyond the largest: the largest two sizes' rate (2 ms over 1000 bytes)
    assert calls.seconds(4004) == pytest.approx(4e-3 + 2000 * 2e-3 / 1000)
    # compute before the call: below one chunk's, one chunk's cost; beyond it, the slope
    assert calls.seconds(4, compute_s=0.5e-3) == 1e-3
    assert calls.seconds(4, compute_s=5e-3) == pytest.approx(1e-3 + 0.5 * 4e-3)
    rate, latency = calls.link()
    assert rate == pytest.approx(1000 / 2e-3) and latency == pytest.approx(0.5e-3)
    # the largest two at one cost: a byte beyond them at the second smallest's to the largest's rate
    level = cpu_gloo.GroupCalls(2, ((4, 0.5e-3), (1004, 1e-3), (2004, 2e-3), (3004, 2e-3)), chunk_s=1e-3, slope=0.0)
    assert level.seconds(4004) == pytest.approx(2e-3 + 1000 * 1e-3 / 2000)
    # those at one cost (the smallest's latency aside): the largest call's cost per byte
    flat = cpu_gloo.GroupCalls(2, ((4, 1e-3), (1004, 2e-3), (2004, 2e-3)), chunk_s=1e-3, slope=0.0)
    assert flat.seconds(4008) == pytest.approx(2e-3 + 2004 * 2e-3 / 2004)


def test_group_calls_need_two_sizes_in_increasing_bytes_and_seconds():
    with pytest.raises(ValueError, match="increasing bytes"):
        cpu_gloo.GroupCalls(2, ((4, 1e-3),), chunk_s=1e-3, slope=0.0)
    with pytest.raises(ValueError, match="increasing bytes"):
        cpu_gloo.GroupCalls(2, ((1004, 2e-3), (4, 1e-3)), chunk_s=1e-3, slope=0.0)
    with pytest.raises(ValueError, match="non-decreasing"):
        cpu_gloo.GroupCalls(2, ((4, 2e-3), (1004, 1e-3)), chunk_s=1e-3, slope=0.0)
    with pytest.raises(ValueError, match="not all 0"):
        cpu_gloo.GroupCalls(2, ((4, 0.0), (1004, 0.0)), chunk_s=1e-3, slope=0.0)
    with pytest.raises(ValueError, match="none below 0"):
        cpu_gloo.GroupCalls(2, ((4, -1e-3), (1004, 1e-3)), chunk_s=1e-3, slope=0.0)

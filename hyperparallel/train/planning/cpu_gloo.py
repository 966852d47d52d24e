"""Gloo among the ranks of a run on this machine, measured as the run will use it (the CPU's device
model, `device_model.measure_cpu`): `ranks` processes sharing the cores as `hyperparallel train
--nproc ranks` starts them, and for each group size a layout can have (every divisor of `ranks`
from 2 up), the ranks split into groups of that size all-reducing at once, as a mesh dimension's
groups do in a step.

A call is measured in a step's rhythm: a chunk of compute (about 1 ms of one core, a layer's
worth of small products and element-wise work), then the call, in a row of them, against the same
chunks without calls; what the call adds to the row's wall time is its cost. That cost is gloo's own
threads' work on the shared cores, their wake-ups, and each rank waiting for peers the scheduler
has not yet run to the same point, none of which one process's threads show. Calls back to back,
with nothing between them, are not what a step makes and not a steady figure: on 2 cores, rows of
256 KiB all-reduces between 2 processes took 0.38-2.6 ms a call from one row to the next, the same
calls after a chunk 1.7-2.4 ms; a tensor-parallel step of the dense example config at tp=2 waited
1.7 ms on average in each of its 256 KiB all-reduces.

A call costs more the more its peers computed before it where the ranks outnumber the cores (a rank
reaching the call waits for peers the scheduler has not yet run to it: among 4 processes on 2
cores, a small all-reduce in groups of 2 added 0.75 ms to a row of chunks of 0.6 ms of one core
each, 1.3 ms to chunks of 3.6 and 5.0 to chunks of 11). So the small call is measured again after
a chunk three times as long: what it adds there beyond what it added after one chunk, per second
of the difference between the two chunks' wall times, is the `slope`, which the plan applies to
compute beyond one chunk's before a call. The cost is not proportional to the compute (above):
calls much further apart than three chunks are planned with the slope measured between one and
three.

Every row is run `REPEATS` times, the repeats interleaved; a cost is the difference of two rows of
one repeat (the machine's slow phases touch both alike), and the median over the repeats is taken.
Sizes: 4 bytes to 4 MiB (`SIZES`); a call beyond the largest adds its further bytes at the rate
between the largest two, at least the rate from 16 KiB to the largest (`GroupCalls.seconds_per_byte`).
The long chunk's rows are measured only where the ranks outnumber the cores (elsewhere the slope
is 0).

    python -m hyperparallel.train.planning.cpu_gloo RANK RANKS PORT OUTNUMBERED   # one rank (measure() starts them)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

SIZES = (4, 2**14, 2**16, 2**18, 2**20, 2**22)  # bytes of the all-reduces measured
# calls in each row (a row lasts 0.02-0.5 s here), and how many times each row is run
CALLS, REPEATS = 30, 3
MIN_CALL_S = 1e-6  # what a call costs at least (a row of them may come out no longer than the chunks alone)
LONG = 3  # the longer chunk, in chunks: the slope's second point
TIMEOUT = timedelta(seconds=120)  # a rank that fails to start must not leave the others waiting for ever


@dataclass(frozen=True)
class GroupCalls:
    """What a collective call over `ranks` ranks costs among the run's ranks on this machine, in a
    step's rhythm (the module's note): by the bytes one rank sends, `points` ((bytes, seconds) by
    size, non-decreasing), after `chunk_s` of compute (wall time, every rank computing at once),
    and `slope` seconds more per second of compute beyond that."""

    ranks: int
    points: tuple[tuple[float, float], ...]
    chunk_s: float
    slope: float

    def __post_init__(self):
        sizes, seconds = [b for b, _ in self.points], [s for _, s in self.points]
        if len(sizes) < 2 or sizes != sorted(set(sizes)) or seconds != sorted(seconds) or seconds[0] < 0 \
                or seconds[-1] <= 0:
            raise ValueError(f"GroupCalls: points need two sizes or more, in increasing bytes, their seconds "
                             f"non-decreasing, none below 0 and not all 0: {self.points}")

    def seconds(self, sent: float, compute_s: float = 0.0) -> float:
        """One call sending `sent` bytes per rank after `compute_s` of compute: between the sizes
        measured, linear in the bytes; beyond the largest, its cost plus the bytes beyond it at
        `seconds_per_byte`; below one chunk's compute, one chunk's cost."""
        points = self.points
        if sent >= points[-1][0]:
            cost = points[-1][1] + (sent - points[-1][0]) * self.seconds_per_byte()
        else:
            cost = points[0][1]
            for (b0, s0), (b1, s1) in zip(points, points[1:], strict=False):
                if b0 <= sent < b1:
                    cost = s0 + (s1 - s0) * (sent - b0) / (b1 - b0)
                    break
        return cost + self.slope * max(compute_s - self.chunk_s, 0.0)

    def seconds_per_byte(self) -> float:
        """What a byte beyond the largest size adds: the largest two sizes' difference per byte, at
        least the second smallest's to the largest's (where the largest two come out alike, noise;
        the smallest, a few bytes, holds the call's latency, not its rate); where those sizes cost
        the same, the largest call's cost per byte."""
        (b0, s0), (b1, s1) = self.points[-2:]
        (first, s_first) = self.points[1] if len(self.points) > 2 else self.points[0]
        rate = max((s1 - s0) / (b1 - b0), (s1 - s_first) / (b1 - first))
        return rate if rate > 0 else s1 / b1

    def link(self) -> tuple[float, float]:
        """(bytes per second, latency per ring step) of a ring over this group read off the calls:
        the CPU's link figures, which a plan uses where its calls are not (a device model given
        one link figure by hand keeps the measured other)."""
        return 1 / self.seconds_per_byte(), self.points[0][1] / (2 * (self.ranks - 1))


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def group_sizes(ranks: int) -> list[int]:
    """The group sizes a layout over `ranks` ranks can have: the divisors from 2 up (2 alone for one rank)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0] or [2]


def sent_per_rank(group: int, nbytes: int) -> float:
    """What one rank of a ring all-reduce of `nbytes` over `group` ranks sends."""
    return 2 * (group - 1) * nbytes / group


def measure(ranks: int) -> tuple[GroupCalls, ...]:
    """The calls of each group size of `group_sizes(ranks)`, from `max(ranks, 2)` processes started
    here (each row the slowest rank's; `_group_calls`). The slope is 0 where the ranks do not
    outnumber the cores: each has a core of its own and no peer waits for the scheduler."""
    from torch.distributed import TCPStore

    world = max(ranks, 2)
    cores = usable_cores()
    # (the store is this process's, on a port the system chose: no other run can take it meanwhile)
    store = TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"rank{r}.err"), "w+") for r in range(world)]  # noqa: SIM115 (closed below)
        children = [subprocess.Popen([sys.executable, "-m", __name__, str(r), str(world), str(store.port),
                                      str(int(world > cores))],
                                     stdout=subprocess.PIPE, stderr=logs[r], text=True, env=env)
                    for r in range(world)]
        try:
            outputs = _wait_for(children, logs, world, timeout_s=_deadline_s(world, cores))
        finally:
            for child in children:
                child.kill()
                child.wait()
            for log in logs:
                log.close()
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    table = []
    for g in group_sizes(world):
        # (each row of each repeat: its slowest rank's)
        repeats = [{name: max(r[str(g)][rep][name] for r in per_rank) for name in per_rank[0][str(g)][rep]}
                   for rep in range(REPEATS)]
        table.append(_group_calls(g, repeats, outnumbered=world > cores))
    return tuple(table)


def _group_calls(g: int, repeats: list[dict[str, float]], outnumbered: bool) -> GroupCalls:
    """A group size's calls from its rows' wall times, one dict of rows per repeat: each cost the
    difference of two rows of one repeat (the machine's phase alike in both), then the median over
    the repeats; a larger call not cheaper than a smaller (the noise between sizes evened out), and
    none free. `outnumbered`: the ranks outnumber the cores (else the slope is 0)."""

    def median(cost) -> float:
        return statistics.median(cost(rows) for rows in repeats)

    def after_chunk(rows: dict[str, float], n: int) -> float:
        return rows[str(n)] - rows["chunk"]

    def slope(rows: dict[str, float]) -> float:
        """What the small call adds after the long chunk beyond what it adds after one, per
        second of the difference between the two."""
        after_long = rows[f"long+{SIZES[0]}"] - rows["long"]
        return (after_long - after_chunk(rows, SIZES[0])) / (rows["long"] - rows["chunk"])

    # (a repeat whose long chunks came out no longer than its short ones says nothing of the slope)
    sloped = [rows for rows in repeats if rows.get("long", 0.0) > rows["chunk"]]

    points, last = [], MIN_CALL_S
    for n in SIZES:
        last = max(last, median(lambda rows, n=n: after_chunk(rows, n)))
        points.append((sent_per_rank(g, n), last))
    measured = outnumbered and sloped
    return GroupCalls(g, tuple(points), chunk_s=median(lambda rows: rows["chunk"]),
                      slope=max(statistics.median(slope(rows) for rows in sloped), 0.0) if measured else 0.0)


def _deadline_s(world: int, cores: int) -> float:
    """How long measuring may take before it is given up: 5 minutes, longer as more processes share
    the cores and more group sizes are measured."""
    return 300 * max(1.0, len(group_sizes(world)) * world / (4 * cores))


def _wait_for(children: list[subprocess.Popen], logs: list, world: int, timeout_s: float = 300) -> list[str]:
    """Every child's standard output, once all have ended well; the first to fail (or the wait
    running out) raises at once, naming its own error, not a peer's timeout after it."""
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, str] = {}
    while len(outputs) < len(children):
        for r, child in enumerate(children):
            if r in outputs or child.poll() is None:
                continue
            if child.returncode:
                logs[r].seek(0)
                raise RuntimeError(f"measuring gloo among {world} processes: rank {r} failed: "
                                   f"{logs[r].read().strip()[-500:]}")
            outputs[r] = child.stdout.read()
        if time.monotonic() > deadline:
            raise RuntimeError(f"measuring gloo among {world} processes: not done in {timeout_s:.0f} s")
        time.sleep(0.05)
    return [outputs[r] for r in range(len(children))]


def _rank(rank: int, world: int, port: int, outnumbered: int) -> dict[str, list[dict[str, float]]]:
    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, None, False, TIMEOUT)  # (the measuring process holds it)
    everyone = ProcessGroupGloo(PrefixStore("all", store), rank, world, TIMEOUT)
    tensors = {n: torch.zeros(n // 4) for n in SIZES}
    x, w = torch.randn(256, 96), torch.randn(96, 96) / 10

    # (about 1 ms of one core a time: a layer's worth of small products and element-wise work)
    def chunk(times: int = 1):
        y = x
        for _ in range(10 * times):
            y = torch.nn.functional.silu(y @ w) + x

    def row(body) -> float:
        """The mean wall time of `body` in a row of CALLS, every rank at once."""
        everyone.barrier().wait()
        start = time.perf_counter()
        for _ in range(CALLS):
            body()
        return (time.perf_counter() - start) / CALLS

    out = {}
    for g in group_sizes(world):
        group = ProcessGroupGloo(PrefixStore(f"{g}/{rank // g}", store), rank % g, g, TIMEOUT)
        group.allreduce([tensors[SIZES[-1]]]).wait()  # (warm: the pair's connections)

        def call(n, group=group):
            group.allreduce([tensors[n]]).wait()

        reps = []
        for _ in range(REPEATS):
            rows = {"chunk": row(chunk)}
            rows |= {str(n): row(lambda n=n: (chunk(), call(n))) for n in SIZES}
            if outnumbered:  # (the slope's rows: 0 where each rank has a core of its own)
                rows["long"] = row(lambda: chunk(LONG))
                rows[f"long+{SIZES[0]}"] = row(lambda: (chunk(LONG), call(SIZES[0])))
            reps.append(rows)
        out[str(g)] = reps
    everyone.barrier().wait()
    return out


if __name__ == "__main__":
    print(json.dumps(_rank(*(int(a) for a in sys.argv[1:5]))))

"""Gloo among the ranks of a run on this machine, measured as the run will use it (the CPU's device
model, `device_model.measure_cpu`): `ranks` processes sharing the cores as `hyperparallel train
--nproc ranks` starts them, and for each group size a layout can have (every divisor of `ranks`
from 2 up), the ranks split into groups of that size all-reducing at once, as a mesh dimension's
groups do in a step. What a call costs there is the mean wall time of many calls in a row: gloo's
own threads' work on the shared cores, their wake-ups, and each rank waiting for its peers to be
scheduled, none of which one process's threads show (their calls cost a rank less CPU and finish
sooner: measured 0.31 against 0.41 ms of CPU for a small all-reduce among 4 ranks on 2 cores).

A step computes between its calls, and the more it computes the more a call costs where the
ranks outnumber the cores: a rank reaching a call waits for peers the scheduler has not yet run
to the same point (among 4 processes on 2 cores, a small all-reduce in groups of 2 added 0.75 ms
of wall time to a row of chunks of 0.6 ms of one core each, 1.3 ms to chunks of 3.6 and 5.0 to
chunks of 11; in groups of 4, 2.0 ms to chunks of 1.3 and 3.9 to chunks of 3.6). So each group
size is measured a second time with a chunk of compute before every call, against the same
chunks without calls: what a call adds beyond its fixed time, per second of the chunk's wall
time with every rank computing at once (the plan's compute, where the ranks outnumber the
cores), is its `slope`. One chunk, of about 1 ms of a core: the cost is not proportional to the
compute (above), so calls much further apart than that are planned with the slope measured there.

    python -m hyperparallel.train.planning.cpu_gloo RANK RANKS PORT NBYTES   # one rank (measure() starts them)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

# calls in each row: a row of small calls lasts 0.1-0.3 s here, of large ones and of chunks about as
# long, enough that the scheduler's slices and gloo's wake-ups average out
SMALL_CALLS, LARGE_CALLS, CHUNKS = 200, 10, 100
TIMEOUT = timedelta(seconds=120)  # a rank that fails to start must not leave the others waiting for ever


def group_sizes(ranks: int) -> list[int]:
    """The group sizes a layout over `ranks` ranks can have: the divisors from 2 up (2 alone for one rank)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0] or [2]


def sent_per_rank(group: int, nbytes: int) -> float:
    """What one rank of a ring all-reduce of `nbytes` over `group` ranks sends."""
    return 2 * (group - 1) * nbytes / group


def measure(ranks: int, nbytes: int = 2**20) -> tuple[tuple[int, float, float, float], ...]:
    """(group size, seconds a call takes besides its bytes, bytes sent per second, seconds a call
    adds per second of compute before it) for each group size of `group_sizes(ranks)`, from
    `max(ranks, 2)` processes started here; the slowest rank's mean call, of 4 bytes and of
    `nbytes`, and after a chunk of compute (wall time, every rank computing at once: the plan's
    compute where the ranks outnumber the cores). Where they do not, each rank has a core of its
    own and no peer waits for the scheduler: the slope is 0."""
    from torch.distributed import TCPStore

    world = max(ranks, 2)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # (the store is this process's, on a port the system chose: no other run can take it meanwhile)
    store = TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(os.path.join(tmp, f"rank{r}.err"), "w+") for r in range(world)]  # noqa: SIM115 (closed below)
        children = [subprocess.Popen([sys.executable, "-m", __name__, str(r), str(world), str(store.port), str(nbytes)],
                                     stdout=subprocess.PIPE, stderr=logs[r], text=True, env=env)
                    for r in range(world)]
        try:
            outputs = _wait_for(children, logs, world)
        finally:
            for child in children:
                child.kill()
                child.wait()
            for log in logs:
                log.close()
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    table = []
    for g in group_sizes(world):
        small, large, chunk, chunk_and_call = (max(r[str(g)][i] for r in per_rank) for i in range(4))
        slope = max(chunk_and_call - chunk - small, 0.0) / chunk if world > cores else 0.0
        table.append((g, small, sent_per_rank(g, nbytes) / max(large - small, 1e-9), slope))
    return tuple(table)


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


def _rank(rank: int, world: int, port: int, nbytes: int) -> dict[str, tuple[float, float, float, float]]:
    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, None, False, TIMEOUT)  # (the measuring process holds it)
    everyone = ProcessGroupGloo(PrefixStore("all", store), rank, world, TIMEOUT)
    small, large = torch.ones(1), torch.ones(nbytes // 4)
    x, w = torch.randn(256, 96), torch.randn(96, 96) / 10

    def chunk():  # (about 1 ms of one core: a layer's worth of small products and element-wise work)
        y = x
        for _ in range(10):
            y = torch.nn.functional.silu(y @ w) + x

    def row(calls: int, body) -> float:
        """The mean wall time of `body` in a row of `calls`, every rank at once."""
        everyone.barrier().wait()
        start = time.perf_counter()
        for _ in range(calls):
            body()
        return (time.perf_counter() - start) / calls

    out = {}
    for g in group_sizes(world):
        group = ProcessGroupGloo(PrefixStore(f"{g}/{rank // g}", store), rank % g, g, TIMEOUT)
        group.allreduce([large]).wait()  # (warm: the pair's connections)

        def call(t, group=group):
            group.allreduce([t]).wait()

        out[str(g)] = (row(SMALL_CALLS, lambda: call(small)), row(LARGE_CALLS, lambda: call(large)),
                       row(CHUNKS, chunk), row(CHUNKS, lambda: (chunk(), call(small))))
    everyone.barrier().wait()
    return out


if __name__ == "__main__":
    print(json.dumps(_rank(*(int(a) for a in sys.argv[1:5]))))

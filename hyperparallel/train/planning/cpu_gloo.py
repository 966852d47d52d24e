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
to the same point (among 4 processes on 2 cores, a small all-reduce in groups of 2 took 0.75 ms
more per call after 0.6 ms of compute, 1.3 after 3.6 and 5.0 after 11 ms of compute; in groups
of 4, 2.0 after 1.3 ms and 3.9 after 3.6). So each group size is measured a second time with a
chunk of compute before every call, against the same chunks without calls: what a call adds per
second of compute before it (its wall time, every rank computing at once) is its `slope`.

    python -m hyperparallel.train.planning.cpu_gloo RANK RANKS PORT NBYTES   # one rank (measure() starts them)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

SMALL_CALLS, LARGE_CALLS, CHUNKS = 200, 10, 100
TIMEOUT = timedelta(seconds=120)  # a rank that fails to start must not leave the others waiting for ever


def group_sizes(ranks: int) -> list[int]:
    """The group sizes a layout over `ranks` ranks can have: the divisors from 2 up (2 alone for one rank)."""
    return [g for g in range(2, ranks + 1) if ranks % g == 0] or [2]


def sent_per_rank(group: int, nbytes: int) -> float:
    """What one rank of a ring all-reduce of `nbytes` over `group` ranks sends."""
    return 2 * (group - 1) * nbytes / group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(ranks: int, nbytes: int = 2**20) -> tuple[tuple[int, float, float, float], ...]:
    """(group size, seconds a call takes besides its bytes, bytes sent per second, seconds a call
    adds per second of compute before it) for each group size of `group_sizes(ranks)`, from
    `max(ranks, 2)` processes started here; the slowest rank's mean call, of 4 bytes and of
    `nbytes`, and after a chunk of compute."""
    world = max(ranks, 2)
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    children = [subprocess.Popen([sys.executable, "-m", __name__, str(r), str(world), str(port), str(nbytes)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for r in range(world)]
    outputs = [child.communicate(timeout=600) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        if child.returncode:
            raise RuntimeError(f"measuring gloo among {world} processes failed: {err.strip()[-500:]}")
    per_rank = [json.loads(out) for out, _ in outputs]
    table = []
    for g in group_sizes(world):
        small, large, chunk, chunk_and_call = (max(r[str(g)][i] for r in per_rank) for i in range(4))
        slope = max(chunk_and_call - chunk - small, 0.0) / chunk
        table.append((g, small, sent_per_rank(g, nbytes) / max(large - small, 1e-9), slope))
    return tuple(table)


def _rank(rank: int, world: int, port: int, nbytes: int) -> dict[str, tuple[float, float]]:
    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
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

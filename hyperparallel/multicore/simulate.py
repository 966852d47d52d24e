"""Predict a graph's makespan from a cost per task, overlapped over lanes and run sequentially.

The simulator replays the executors' policy on one rank: a lane runs one task at a time; a task
starts when its dependencies have finished and its lane is free; compute lanes take the lowest
program index among their ready tasks, the comm lane takes its tasks in the fixed issue order of
[Note: collectives in one order on every rank]. Which kinds share a lane is the machine's
resource model: `SHARED_COMPUTE` (matmul and vector work on one compute resource, communication
beside it: the CPU executor's calling thread, or a GPU whose matmul and vector streams share the
same SMs) or `LANE_PER_KIND` (separate matrix and vector units that work at once, as Ascend's
cube and vector cores). Ranks are assumed balanced: a collective costs its own time, not a wait
for a slower peer.

Costs come from a measured trace of the same graph (`costs_from_trace`: per task name, the
time it took when run without overlap) or from a `CostModel` of FLOP/s, memory and link
bandwidth and latency (what planning past this machine uses).
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from hyperparallel.multicore.graph import Task, TaskGraph

SHARED_COMPUTE = {"comm": "comm", "matmul": "compute", "vector": "compute"}
LANE_PER_KIND = {"comm": "comm", "matmul": "matmul", "vector": "vector"}


@dataclass(frozen=True)
class CostModel:
    """Seconds per task from its FLOPs or bytes: matmul tasks at `matmul_flops` FLOP/s, vector
    tasks moving their bytes at `memory_bytes_per_s`, comm tasks sending theirs at
    `link_bytes_per_s` after `link_latency_s`; every task pays `task_overhead_s` (a launch, or the
    host's work per task)."""

    matmul_flops: float
    memory_bytes_per_s: float
    link_bytes_per_s: float
    link_latency_s: float
    task_overhead_s: float = 0.0

    def __call__(self, task: Task) -> float:
        if task.kind == "matmul":
            return self.task_overhead_s + task.flops / self.matmul_flops
        if task.kind == "vector":
            return self.task_overhead_s + task.bytes / self.memory_bytes_per_s
        return self.task_overhead_s + self.link_latency_s + task.bytes / self.link_bytes_per_s


@dataclass(frozen=True)
class Prediction:
    overlapped_s: float
    sequential_s: float
    exposed_comm_s: float  # time the compute lanes stood idle, waiting on communication

    @property
    def speedup(self) -> float:
        return self.sequential_s / self.overlapped_s if self.overlapped_s else 1.0


def simulate(graph: TaskGraph, cost: Callable[[Task], float] | dict[str, float], *,
             lanes: dict[str, str] = SHARED_COMPUTE, in_order: bool = False) -> Prediction:
    """The makespan of `graph` with every task taking `cost(task)` seconds (or `cost[task.name]`).

    in_order=False: a free compute lane takes its lowest-index ready task (the CPU executor);
    in_order=True: every lane runs its tasks in issue order, a task not yet ready holding up those
    behind it (CUDA streams). The comm lane is in issue order either way."""
    tasks = graph.tasks
    seconds = [cost[t.name] if isinstance(cost, dict) else cost(t) for t in tasks]
    users = graph.users()
    waiting = [len(t.deps) for t in tasks]
    comm_lane = lanes["comm"]
    ordered = {lane: [i for i in graph.validate() if lanes[tasks[i].kind] == lane] for lane in set(lanes.values())
               if in_order or lane == comm_lane}  # lanes that take their tasks in issue order
    next_in_order = dict.fromkeys(ordered, 0)
    ready: dict[str, list[int]] = {lane: [] for lane in set(lanes.values())}
    for t in tasks:
        if not t.deps:
            heapq.heappush(ready[lanes[t.kind]], t.index)
    busy_until = {lane: 0.0 for lane in ready}
    running: list[tuple[float, int]] = []  # (finish time, task)
    now, done = 0.0, 0
    compute_busy = []  # (start, end) of tasks on non-comm lanes
    while done < len(tasks):
        for lane, queue in ready.items():
            if busy_until[lane] > now or not queue:
                continue
            if lane in ordered:
                order, at = ordered[lane], next_in_order[lane]
                if at >= len(order) or order[at] not in queue:
                    continue
                index = order[at]
                next_in_order[lane] += 1
                queue.remove(index)
                heapq.heapify(queue)
            else:
                index = heapq.heappop(queue)
            if lane != comm_lane:
                compute_busy.append((now, now + seconds[index]))
            busy_until[lane] = now + seconds[index]
            heapq.heappush(running, (now + seconds[index], index))
        if not running:
            raise RuntimeError(f"graph {graph.name!r}: no task can start (a task waits on one issued after it "
                               f"on its own lane?)")
        now, index = heapq.heappop(running)
        done += 1
        for user in users[index]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready[lanes[tasks[user].kind]], user)
    busy, covered_to = 0.0, 0.0  # the union of the compute lanes' busy time
    for start, end in sorted(compute_busy):
        busy += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return Prediction(overlapped_s=now, sequential_s=sum(seconds), exposed_comm_s=max(0.0, now - busy))


def costs_from_trace(events: list[dict], graph_name: str | None = None, rank: int | None = None) -> dict[str, float]:
    """Seconds per task name from the slices in `events` (`multicore.timeline.load`) of one graph
    if given: on one rank, the median duration of the task's slices (the median: one slow run on
    a shared machine should not decide a cost). Over all ranks (`rank` None): a compute task costs
    what it took on its slowest rank, which the pipeline waits for; a comm task what it took on
    its fastest, since on the others it also waited for a late peer. Measure with overlap=False,
    so that no task's time includes another's."""
    durations: dict[tuple[int, str], list[float]] = {}
    kinds: dict[str, str] = {}
    for e in events:
        if e["cat"] in ("wait", "step") or (graph_name and e["args"]["graph"] != graph_name) or \
                (rank is not None and e["pid"] != rank):
            continue
        durations.setdefault((e["pid"], e["name"]), []).append(e["dur"] / 1e6)
        kinds[e["name"]] = e["cat"]
    per_rank: dict[str, list[float]] = {}
    for (_, name), ds in durations.items():
        per_rank.setdefault(name, []).append(statistics.median(ds))
    return {name: (min if kinds[name] == "comm" else max)(costs) for name, costs in per_rank.items()}


# Cost models of the two executors' usual machines, for choices made before anything has run
# (MegaMoE's default wave count). cpu: one core per rank with gloo over loopback, as measured on
# this project's 2-core CI machine (fp32 matmul 81 GFLOP/s, index_select 5.8 GB/s, all_to_all
# 1.5 GB/s after 0.6 ms; `hyperparallel bench moe` measures them again). cuda: one H200-class GPU
# per rank on NVLink (bf16 matmuls at 700 of the 989 dense TFLOP/s, 4 of the 4.8 TB/s of memory
# bandwidth, all-to-all at 300 GB/s after 20 µs, 5 µs per kernel launch).
COST_MODELS = {
    "cpu": CostModel(matmul_flops=81e9, memory_bytes_per_s=5.8e9, link_bytes_per_s=1.5e9, link_latency_s=0.6e-3,
                     task_overhead_s=20e-6),
    "cuda": CostModel(matmul_flops=700e12, memory_bytes_per_s=4.0e12, link_bytes_per_s=300e9, link_latency_s=20e-6,
                      task_overhead_s=5e-6),
}
# how each executor's runs are simulated: the CPU's compute thread takes the lowest-index ready
# task; a GPU's streams run their tasks in issue order and share the SMs (one compute lane)
EXECUTORS = {"cpu": {"lanes": SHARED_COMPUTE, "in_order": False}, "cuda": {"lanes": SHARED_COMPUTE, "in_order": True}}

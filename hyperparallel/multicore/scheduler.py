"""Running a TaskGraph: dependency counters, one ready queue per lane, and two executors.

Every task waits on a counter of its unfinished dependencies; at zero it enters the ready queue
of its lane (its kind: comm, matmul, vector). What a lane is depends on the executor:

- `cpu` (any device without streams, gloo): compute runs on the calling thread, the matmul and
  vector queues feeding it (lowest program index first, or a `pick` policy); communication is
  issued asynchronously (a comm task returns gloo's async work handle) and runs on gloo's own
  threads while compute proceeds. A handle is waited on only when no compute task is ready: that
  wait is the *exposed* communication, which the run's statistics and trace report.
- `cuda`: one CUDA stream per lane; a task is issued onto its lane's stream after waiting on the
  events of its dependencies on other lanes, and records an event of its own. The host issues the
  whole graph without waiting; the caller's stream then waits for every lane.

[Note: collectives in one order on every rank]
Every rank must issue its collectives in the same order, or two ranks wait on different
collectives forever. Readiness depends on timing, which differs between ranks, so comm tasks are
issued strictly in one order computed from the graph alone (`TaskGraph.validate`: program order
where the edges allow), never in the order they happen to become ready.

[Note: tensors between lanes on CUDA]
A tensor a task allocates belongs to its lane's stream in the caching allocator. Data passes
between tasks only through the graph's buffers, and what outlives a run outside them is
declared (`TaskGraph.hold`), so at the end of a run each of those tensors is recorded on every
lane's stream and the caller's: its memory is not reused while any of them may still read it.
The lanes are the same streams for every run on a device. Tensors that an autograd call inside a
task saves (MegaMoE's shared experts) are not declared: autograd's own stream handling covers
them.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hyperparallel.multicore import timeline as tracing
from hyperparallel.multicore.graph import KINDS, TaskGraph


@dataclass
class RunStats:
    """What one run took, in nanoseconds. `exposed_comm_ns`: time the compute lane stood waiting
    for communication; `comm_ns`: time some communication was in flight."""

    wall_ns: int = 0
    compute_ns: int = 0
    comm_ns: int = 0
    exposed_comm_ns: int = 0
    spans: list = field(default_factory=list)  # tracing.Span per task (and per exposed wait)

    @property
    def exposed_comm_fraction(self) -> float:
        return self.exposed_comm_ns / self.wall_ns if self.wall_ns else 0.0


def executor_for(graph: TaskGraph) -> str:
    for buffer in graph.buffers:
        if buffer.tensor is not None:
            return "cuda" if buffer.tensor.is_cuda else "cpu"
    return "cpu"


def run(graph: TaskGraph, executor: str | None = None, *,
        pick: Callable[[list[int]], int] | None = None, overlap: bool = True) -> RunStats:
    """Run every task of `graph` once. `pick` chooses among ready compute tasks (given their
    indices, ascending; default the first): tests use it to try many ready orders. With
    overlap=False every comm task is waited on as soon as it is issued: the same graph run
    sequentially, for comparison."""
    executor = executor or executor_for(graph)
    if executor == "cpu":
        stats = _run_cpu(graph, pick, overlap)
    elif executor == "cuda":
        stats = _run_cuda(graph, overlap)
    else:
        raise ValueError(f"executor {executor!r}: use 'cpu' or 'cuda'")
    graph.held.clear()  # the graph keeps no reference past its run
    tracing.record(graph.name, stats.spans)
    return stats


def _run_cpu(graph: TaskGraph, pick, overlap: bool) -> RunStats:
    tasks = graph.tasks
    comm_order = [i for i in graph.validate() if tasks[i].kind == "comm"]
    users = graph.users()
    waiting = [len(t.deps) for t in tasks]
    ready: dict[str, list[int]] = {kind: [] for kind in KINDS}
    for task in tasks:
        if not task.deps:
            heapq.heappush(ready[task.kind], task.index)
    stats = RunStats()
    in_flight: deque = deque()  # (task index, work handle, issue time, [completion time])
    next_comm, finished = 0, 0
    start = time.perf_counter_ns()

    def finish(index: int) -> None:
        nonlocal finished
        finished += 1
        for user in users[index]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready[tasks[user].kind], user)

    def retire(item) -> None:
        index, work, issued, completed = item
        work.wait()
        end = completed[0] if completed else time.perf_counter_ns()
        stats.spans.append(tracing.Span.of(tasks[index], "comm", issued, end))
        finish(index)

    while finished < len(tasks):
        comm_ready = set(ready["comm"])
        while next_comm < len(comm_order) and comm_order[next_comm] in comm_ready:
            index = comm_order[next_comm]
            ready["comm"].remove(index)
            heapq.heapify(ready["comm"])
            next_comm += 1
            issued = time.perf_counter_ns()
            work = tasks[index].fn() if tasks[index].fn is not None else None
            if work is None:  # done synchronously (nothing to send, or a blocking call)
                stats.spans.append(tracing.Span.of(tasks[index], "comm", issued, time.perf_counter_ns()))
                finish(index)
                continue
            completed: list[int] = []
            _on_completion(work, completed)
            in_flight.append((index, work, issued, completed))
            if not overlap:
                _wait_exposed(in_flight.pop(), tasks, stats, retire)
        while in_flight and _completed(in_flight[0][1]):
            retire(in_flight.popleft())
        compute = ready["matmul"] + ready["vector"]
        if compute:
            compute.sort()
            index = pick(compute) if pick is not None else compute[0]
            task = tasks[index]
            ready[task.kind].remove(index)
            heapq.heapify(ready[task.kind])
            began = time.perf_counter_ns()
            if task.fn is not None:
                task.fn()
            ended = time.perf_counter_ns()
            stats.compute_ns += ended - began
            stats.spans.append(tracing.Span.of(task, "compute", began, ended))
            finish(index)
        elif in_flight:
            _wait_exposed(in_flight.popleft(), tasks, stats, retire)
        elif finished < len(tasks) and not (next_comm < len(comm_order) and comm_order[next_comm] in ready["comm"]):
            stuck = [t.name for t in tasks if waiting[t.index]][:5]
            raise RuntimeError(f"graph {graph.name!r} stalled with tasks {stuck} still waiting")
    stats.wall_ns = time.perf_counter_ns() - start
    stats.comm_ns = _union_ns([(s.start_ns, s.end_ns) for s in stats.spans if s.lane == "comm"])
    return stats


def _wait_exposed(item, tasks, stats: RunStats, retire) -> None:
    """Block on a comm task with no compute ready: exposed communication, shown on the compute lane."""
    began = time.perf_counter_ns()
    retire(item)
    ended = time.perf_counter_ns()
    stats.exposed_comm_ns += ended - began
    stats.spans.append(tracing.Span.wait(f"wait {tasks[item[0]].name}", began, ended))


def _completed(work) -> bool:
    """Whether an async handle is done without waiting: a c10d Work's is_completed(), a Future's done()."""
    probe = getattr(work, "is_completed", None) or getattr(work, "done", None)
    return bool(probe()) if probe is not None else False


def _on_completion(work, completed: list[int]) -> None:
    """Note the moment `work` completes (from gloo's thread), for the trace: polling would only see
    it when the compute task then running ends."""
    get_future = getattr(work, "get_future", None)
    if get_future is None:
        return
    try:
        get_future().add_done_callback(lambda _: completed.append(time.perf_counter_ns()))
    except RuntimeError:  # a backend whose works have no future: the polled time stands
        pass


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


_LANE_STREAMS: dict[int, dict[str, torch.cuda.Stream]] = {}  # per device, made once


def _lane_streams(device: int) -> dict[str, torch.cuda.Stream]:
    """The same streams for every run on a device, so that a tensor one run's lane allocated and a
    later run's lanes read is protected by the same record_stream as any other."""
    if device not in _LANE_STREAMS:
        _LANE_STREAMS[device] = {kind: torch.cuda.Stream(device) for kind in KINDS}
    return _LANE_STREAMS[device]


def _run_cuda(graph: TaskGraph, overlap: bool) -> RunStats:
    tasks = graph.tasks
    caller = torch.cuda.current_stream()
    streams = _lane_streams(torch.cuda.current_device()) if overlap else {kind: caller for kind in KINDS}
    timing = tracing.active()
    base = torch.cuda.Event(enable_timing=True)
    base.record(caller)
    for stream in streams.values():
        stream.wait_stream(caller)
    events: dict[int, torch.cuda.Event] = {}
    timed = []
    began_ns = time.perf_counter_ns()
    for index in graph.validate():
        task = tasks[index]
        stream = streams[task.kind]
        with torch.cuda.stream(stream):
            for dep in task.deps:
                if streams[tasks[dep].kind] is not stream:
                    stream.wait_event(events[dep])
            start = torch.cuda.Event(enable_timing=True) if timing else None
            if start is not None:
                start.record(stream)
            work = task.fn() if task.fn is not None else None
            if work is not None:
                work.wait()  # the lane's stream waits for the collective; the host does not
            done = torch.cuda.Event(enable_timing=timing)
            done.record(stream)
            events[index] = done
            if timing:
                timed.append((task, start, done))
    for stream in set(streams.values()):
        caller.wait_stream(stream)
    held = [b.tensor for b in graph.buffers if b.tensor is not None] + graph.held
    for tensor in held:  # see [Note: tensors between lanes on CUDA]
        if tensor.is_cuda:
            for stream in set(streams.values()) | {caller}:
                tensor.record_stream(stream)
    stats = RunStats()
    if timing:  # the trace needs the device's times: one sync, only while tracing
        torch.cuda.synchronize()
        to_ns = lambda event: began_ns + int(base.elapsed_time(event) * 1e6)  # noqa: E731
        for task, start, done in timed:
            lane = "comm" if task.kind == "comm" else task.kind
            stats.spans.append(tracing.Span.of(task, lane, to_ns(start), to_ns(done)))
        stats.wall_ns = max((s.end_ns for s in stats.spans), default=began_ns) - began_ns
        stats.comm_ns = _union_ns([(s.start_ns, s.end_ns) for s in stats.spans if s.lane == "comm"])
        stats.compute_ns = _union_ns([(s.start_ns, s.end_ns) for s in stats.spans if s.lane != "comm"])
        stats.exposed_comm_ns = stats.wall_ns - stats.compute_ns  # no compute lane busy: waiting on comm
    return stats

"""Timelines of graph runs as Chrome trace-event JSON (opens in Perfetto or chrome://tracing).

    with multicore.trace("run/trace.json"):
        ...  # every TaskGraph run in here is recorded

One process per rank, one track per lane (the CPU executor's `compute` and `comm`; on CUDA one
per stream: `matmul`, `vector`, `comm`), each slice a task with its graph, bytes and FLOPs, and a
`step` track for spans the caller marks (`span("step 3")`: a trainer's steps). Under
torch.distributed every rank must enter and leave `trace` together: leaving gathers the ranks'
slices to rank 0 (a collective), which writes the file (under a temporary name, then renamed).
Timestamps come from the monotonic clock, which the processes of one machine share; on CUDA a
task's times are its events' offsets from one event recorded at the start of the run, placed at
the host time of that start (within a launch latency of the host-timed `step` track).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

_recording: list[list[dict]] = []  # the slices of each open `trace`


@dataclass
class Span:
    """What a run did when: a task (its index, name, kind, bytes and FLOPs) or a wait (kind "wait",
    index -1). It holds no reference to the task, so keeping a run's statistics keeps no tensor."""

    index: int
    name: str
    kind: str
    lane: str
    start_ns: int
    end_ns: int
    bytes: int = 0
    flops: int = 0

    @classmethod
    def of(cls, task, lane: str, start_ns: int, end_ns: int) -> Span:
        return cls(task.index, task.name, task.kind, lane, start_ns, end_ns, task.bytes, task.flops)

    @classmethod
    def wait(cls, name: str, start_ns: int, end_ns: int) -> Span:
        return cls(-1, name, "wait", "compute", start_ns, end_ns)


def active() -> bool:
    return bool(_recording)


def _append(slice_: dict) -> None:
    for slices in _recording:  # nested traces each record what runs inside them
        slices.append(slice_)


def record(graph_name: str, spans: list[Span]) -> None:
    if not _recording:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    for span in spans:
        _append({"name": span.name, "lane": span.lane, "rank": rank, "start_ns": span.start_ns,
                 "end_ns": span.end_ns, "graph": graph_name, "kind": span.kind, "bytes": span.bytes,
                 "flops": span.flops})


@contextmanager
def trace(path: str | os.PathLike, *, group=None):
    """Record every graph run inside into a Chrome trace at `path` (see the module docstring)."""
    slices: list[dict] = []
    _recording.append(slices)
    try:
        yield slices
    finally:
        _recording.pop()
        write = True
        if dist.is_initialized():
            write = dist.get_rank(group) == 0
            gathered: list | None = [None] * dist.get_world_size(group) if write else None
            first = dist.get_global_rank(group, 0) if group is not None else 0
            dist.gather_object(slices, gathered, dst=first, group=group)  # to rank 0 only
            if write:
                slices = [s for rank_slices in gathered for s in rank_slices]
        if write:
            _write(Path(path), slices)


LANES = ("step", "compute", "matmul", "vector", "comm")


@contextmanager
def span(name: str, lane: str = "step"):
    """Record the time inside as a slice `name` on the track `lane` (`step`, or `comm` for a blocking
    collective outside any graph); nothing when not tracing."""
    if not _recording:
        yield
        return
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        _append({"name": name, "lane": lane, "rank": dist.get_rank() if dist.is_initialized() else 0,
                 "start_ns": start, "end_ns": time.perf_counter_ns(), "graph": "", "kind": lane, "bytes": 0, "flops": 0})


def chrome_events(slices: list[dict]) -> list[dict]:
    """Trace events: a complete event ("X") per slice, and names for every rank and lane."""
    origin = min((s["start_ns"] for s in slices), default=0)
    events = []
    for rank in sorted({s["rank"] for s in slices}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for lane in sorted({s["lane"] for s in slices if s["rank"] == rank}, key=LANES.index):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": LANES.index(lane),
                           "args": {"name": lane}})
    for s in slices:
        events.append({"ph": "X", "name": s["name"], "cat": s["kind"], "pid": s["rank"], "tid": LANES.index(s["lane"]),
                       "ts": (s["start_ns"] - origin) / 1e3, "dur": (s["end_ns"] - s["start_ns"]) / 1e3,
                       "args": {"graph": s["graph"], "bytes": s["bytes"], "flops": s["flops"]}})
    return events


def _write(path: Path, slices: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"traceEvents": chrome_events(slices), "displayTimeUnit": "ms"}))
    os.replace(temporary, path)


def load(path: str | os.PathLike) -> list[dict]:
    """The complete events of a trace file this module wrote (times in µs, lanes by name)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [dict(e, lane=LANES[e["tid"]]) for e in events if e["ph"] == "X"]


def plot(path: str | os.PathLike, image: str | os.PathLike, *, graph: str | None = None,
         title: str | None = None) -> None:
    """Draw a trace (optionally one graph's runs) as one row per rank and lane, into `image`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in load(path) if graph is None or e["args"]["graph"] == graph]
    if not events:
        raise ValueError(f"{path} has no slices" + (f" of graph {graph!r}" if graph else ""))
    origin = min(e["ts"] for e in events)
    rows = sorted({(e["pid"], e["lane"]) for e in events}, key=lambda r: (r[0], LANES.index(r[1])))
    colours = {"comm": "tab:orange", "matmul": "tab:blue", "vector": "tab:green", "wait": "tab:red",
               "step": "lightgrey"}
    figure, axes = plt.subplots(figsize=(12, 0.5 + 0.55 * len(rows)))
    for y, (rank, lane) in enumerate(rows):
        for e in (e for e in events if (e["pid"], e["lane"]) == (rank, lane)):
            start, width = (e["ts"] - origin) / 1e3, e["dur"] / 1e3
            axes.broken_barh([(start, width)], (y - 0.4, 0.8), color=colours.get(e["cat"], "grey"),
                             edgecolor="black", linewidth=0.3)
            if width > 0.04 * max(1e-9, max(x["ts"] + x["dur"] - origin for x in events) / 1e3):
                axes.text(start + width / 2, y, e["name"], ha="center", va="center", fontsize=6)
    axes.set_yticks(range(len(rows)), [f"rank {rank} {lane}" for rank, lane in rows])
    axes.invert_yaxis()
    axes.set_xlabel("ms")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colours.items()]
    figure.legend(handles=handles, loc="lower center", fontsize=7, ncol=len(handles), frameon=False)
    if title:
        axes.set_title(title)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(image, dpi=130)
    plt.close(figure)

"""`multicore.trace` of CPU runs: on two gloo ranks, a comm task (an asynchronous all_to_all_single
of 4 MB) and an independent matmul loop of one graph overlap in time on each rank's trace, the
trace has one process per rank and one track per lane, and the exchange delivers the right data.
In one process: the slices written are the run's spans, and `trace.load` reads them back."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from hyperparallel import multicore
from hyperparallel.multicore import TaskGraph
from hyperparallel.multicore.timeline import LANES, load
from tests.dist.test_fsdp import one_thread

WORLD = 2
ELEMENTS = 1 << 20  # float32: 4 MB sent by each rank
SIZE, REPS = 192, 100  # the matmul loop: 1.4 GFLOP, measured ~30 ms; the exchange 6-22 ms


def sent(rank: int) -> torch.Tensor:
    """What `rank` sends: distinct exact integers (float32 holds them exactly below 2**24)."""
    return torch.arange(ELEMENTS, dtype=torch.float32) + rank * ELEMENTS


def weights() -> torch.Tensor:
    return torch.randn(SIZE, SIZE, generator=torch.Generator().manual_seed(3)) / SIZE ** 0.5


def matmul_loop(w: torch.Tensor) -> torch.Tensor:
    x = w
    for _ in range(REPS):
        x = torch.tanh(x @ w)
    return x


def overlap_graph(rank: int) -> tuple[TaskGraph, dict]:
    g = TaskGraph("overlap")
    send = g.input("send", sent(rank))
    recv = g.buffer("recv", torch.empty(ELEMENTS))
    w = g.input("w", weights())
    out = g.buffer("out", rows=SIZE)
    g.add("exchange", "comm", lambda: dist.all_to_all_single(recv.tensor, send.tensor, async_op=True),
          reads=[send], writes=[recv], bytes=ELEMENTS * 4)
    g.add("loop", "matmul", lambda: out.set(matmul_loop(w.tensor)), reads=[w], writes=[out],
          flops=2 * SIZE ** 3 * REPS)
    return g, {"recv": recv, "out": out}


def run_on_rank(rank: int, out_dir: str) -> dict:
    """This file's graph on one rank of the 2-rank spawn of tests/conftest.py (`ep_spawn_2`, shared
    so that the ranks start once), traced into out_dir/trace.json."""
    graph, buffers = overlap_graph(rank)
    path = os.path.join(out_dir, "trace.json")
    with multicore.trace(path):
        stats = multicore.run(graph)
    return {"path": path, "recv": buffers["recv"].tensor, "out": buffers["out"].tensor,
            "spans": [(s.name, s.lane) for s in stats.spans]}


@pytest.fixture(scope="module")
def two_ranks(ep_spawn_2) -> dict:
    ranks = [results["trace"] for results in ep_spawn_2]
    path = ranks[0]["path"]
    with open(path) as f:
        raw = json.load(f)
    return {"path": path, "raw": raw, "ranks": ranks}


def slice_of(events: list[dict], rank: int, name: str) -> dict:
    found = [e for e in events if e["pid"] == rank and e["name"] == name]
    assert len(found) == 1, f"rank {rank}: {len(found)} slices named {name!r}"
    return found[0]


def test_on_each_rank_the_comm_slice_overlaps_the_compute_slice(two_ranks):
    events = load(two_ranks["path"])
    for rank in range(WORLD):
        comm, compute = slice_of(events, rank, "exchange"), slice_of(events, rank, "loop")
        assert (comm["lane"], comm["cat"]) == ("comm", "comm")
        assert (compute["lane"], compute["cat"]) == ("compute", "matmul")
        assert comm["args"] == {"graph": "overlap", "bytes": ELEMENTS * 4, "flops": 0}
        assert compute["args"]["flops"] == 2 * SIZE ** 3 * REPS
        assert comm["ts"] < compute["ts"] + compute["dur"] and compute["ts"] < comm["ts"] + comm["dur"], \
            f"rank {rank}: exchange at {comm['ts']}+{comm['dur']} us, loop at {compute['ts']}+{compute['dur']} us"


def test_the_trace_has_one_process_per_rank_and_tracks_named_by_lane(two_ranks):
    raw = two_ranks["raw"]["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in raw if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    tracks = {}
    for e in raw:
        if e["ph"] == "M" and e["name"] == "thread_name":
            tracks.setdefault(e["pid"], {})[e["tid"]] = e["args"]["name"]
    lanes = {name: LANES.index(name) for name in ("compute", "comm")}
    assert tracks == {r: {tid: name for name, tid in lanes.items()} for r in range(WORLD)}
    slices = [e for e in raw if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == set(processes)
    assert all(tracks[e["pid"]][e["tid"]] == ("comm" if e["cat"] == "comm" else "compute") for e in slices)
    assert min(e["ts"] for e in slices) == 0.0  # times from the earliest slice of any rank


def test_every_span_of_each_rank_is_in_the_trace(two_ranks):
    events = load(two_ranks["path"])
    for rank, result in enumerate(two_ranks["ranks"]):
        assert sorted((e["name"], e["lane"]) for e in events if e["pid"] == rank) == sorted(result["spans"])


def test_the_exchange_delivers_each_rank_its_chunk_of_every_rank(two_ranks):
    chunk = ELEMENTS // WORLD
    for rank, result in enumerate(two_ranks["ranks"]):
        want = torch.cat([sent(peer)[rank * chunk:(rank + 1) * chunk] for peer in range(WORLD)])
        assert torch.equal(result["recv"], want), f"rank {rank}"


def test_the_compute_task_beside_the_exchange_computes_its_result(two_ranks):
    with one_thread():  # as the ranks computed
        want = matmul_loop(weights())
    for rank, result in enumerate(two_ranks["ranks"]):
        torch.testing.assert_close(result["out"], want, msg=lambda m, rank=rank: f"rank {rank}: {m}")


def test_in_one_process_the_trace_holds_the_runs_spans_as_rank_0(tmp_path):
    g = TaskGraph("solo")
    y = g.buffer("y", torch.zeros(2))
    g.add("fill", "vector", lambda: y.tensor.fill_(1.0), writes=[y])
    g.add("double", "matmul", lambda: y.tensor.mul_(2.0), reads=[y], writes=[y])
    path = tmp_path / "sub" / "solo.json"
    with multicore.trace(path) as slices:
        stats = multicore.run(g)
        multicore.run(g)  # a second run: recorded too
    assert torch.equal(y.tensor, torch.tensor([2.0, 2.0]))
    assert len(slices) == 4 and not (tmp_path / "sub" / "solo.json.tmp").exists()
    events = load(path)
    assert [(e["name"], e["pid"], e["lane"], e["cat"]) for e in events] == \
        [("fill", 0, "compute", "vector"), ("double", 0, "compute", "matmul")] * 2
    origin = min(s.start_ns for s in stats.spans)
    for event, span in zip(events, stats.spans, strict=False):  # the first run's, in µs from its start
        assert event["ts"] == pytest.approx((span.start_ns - origin) / 1e3, abs=1e-3)
        assert event["dur"] == pytest.approx((span.end_ns - span.start_ns) / 1e3, abs=1e-3)


def test_runs_outside_a_trace_are_not_recorded(tmp_path):
    g = TaskGraph("untraced")
    g.add("nothing", "vector", None)
    with multicore.trace(tmp_path / "t.json") as slices:
        pass
    multicore.run(g)
    assert slices == [] and load(tmp_path / "t.json") == []


def test_nested_traces_each_record_the_runs_inside_them(tmp_path):
    g = TaskGraph("nested")
    g.add("work", "vector", None)
    with multicore.trace(tmp_path / "outer.json") as outer:
        multicore.run(g)
        with multicore.trace(tmp_path / "inner.json") as inner:
            multicore.run(g)
    assert len(outer) == 2 and len(inner) == 1
    assert [e["name"] for e in load(tmp_path / "outer.json")] == ["work", "work"]

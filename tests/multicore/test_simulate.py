"""`simulate` on hand-built graphs whose makespan is worked out by hand (overlap of independent
comm and compute, a chain, comm tasks serialized in issue order, kinds sharing a lane or not),
`CostModel`'s seconds per kind, and `costs_from_trace` taking the median slice duration by task name."""

from __future__ import annotations

import pytest

from hyperparallel.multicore import (
    LANE_PER_KIND,
    SHARED_COMPUTE,
    CostModel,
    Prediction,
    TaskGraph,
    costs_from_trace,
    simulate,
)


def independent(*kinds: str) -> TaskGraph:
    """Tasks named by kind and position (comm0, matmul1, ...), each writing rows of its own buffer."""
    g = TaskGraph("independent")
    for i, kind in enumerate(kinds):
        g.add(f"{kind}{i}", kind, None, writes=[g.buffer(f"out{i}", rows=1)])
    return g


def assert_prediction(got: Prediction, overlapped: float, sequential: float, exposed: float) -> None:
    assert got.overlapped_s == pytest.approx(overlapped, abs=1e-12)
    assert got.sequential_s == pytest.approx(sequential, abs=1e-12)
    assert got.exposed_comm_s == pytest.approx(exposed, abs=1e-12)


def test_an_independent_comm_and_compute_overlap_the_makespan_is_the_longer():
    g = independent("comm", "matmul")
    # compute longer: the comm hides entirely
    assert_prediction(simulate(g, {"comm0": 2.0, "matmul1": 3.0}), overlapped=3.0, sequential=5.0, exposed=0.0)
    # comm longer: the compute lane stands idle for the difference
    assert_prediction(simulate(g, {"comm0": 4.0, "matmul1": 3.0}), overlapped=4.0, sequential=7.0, exposed=1.0)


def test_a_chain_takes_the_sum_of_its_tasks():
    g = TaskGraph("chain")
    x = g.input("x", rows=2)
    a, b, c = (g.buffer(n, rows=2) for n in "abc")
    g.add("recv", "comm", None, reads=[x], writes=[a])
    g.add("mm", "matmul", None, reads=[a], writes=[b])
    g.add("act", "vector", None, reads=[b], writes=[c])
    got = simulate(g, {"recv": 1.0, "mm": 2.0, "act": 3.0})
    assert_prediction(got, overlapped=6.0, sequential=6.0, exposed=1.0)  # compute waits for the recv
    assert got.speedup == pytest.approx(1.0)


def test_two_comm_tasks_serialize_in_issue_order():
    # first (2 s) is issued before second (3 s); a matmul (1 s) needs second's result:
    # second runs 2..5, the matmul 5..6. Had second gone first, the matmul would end at 4, first at 5.
    g = TaskGraph("two comms")
    a, b, c = (g.buffer(n, rows=1) for n in "abc")
    first = g.add("first", "comm", None, writes=[a])
    second = g.add("second", "comm", None, writes=[b])
    g.add("use", "matmul", None, reads=[b], writes=[c])
    costs = {"first": 2.0, "second": 3.0, "use": 1.0}
    assert_prediction(simulate(g, costs), overlapped=6.0, sequential=6.0, exposed=5.0)
    g.precede(second, first)  # the issue order is validate's: now second, then first
    assert_prediction(simulate(g, costs), overlapped=5.0, sequential=6.0, exposed=4.0)


def test_a_comm_waits_for_its_turn_even_when_a_later_one_is_ready_first():
    # comm "late" (issued first) needs a 2 s matmul; comm "early" (issued second) is ready at 0 but waits
    # its turn: late 2..3, early 3..4
    g = TaskGraph("turns")
    a, b, c = (g.buffer(n, rows=1) for n in "abc")
    g.add("mm", "matmul", None, writes=[a])
    g.add("late", "comm", None, reads=[a], writes=[b])
    g.add("early", "comm", None, writes=[c])
    assert simulate(g, {"mm": 2.0, "late": 1.0, "early": 1.0}).overlapped_s == pytest.approx(4.0)


def test_matmul_and_vector_share_one_lane_or_have_a_lane_each():
    g = independent("matmul", "vector")
    costs = {"matmul0": 2.0, "vector1": 3.0}
    assert simulate(g, costs, lanes=SHARED_COMPUTE).overlapped_s == pytest.approx(5.0)
    assert simulate(g, costs, lanes=LANE_PER_KIND).overlapped_s == pytest.approx(3.0)


def test_a_compute_lane_takes_the_lowest_program_index_among_its_ready_tasks():
    # compute0 (1 s) and compute1 (1 s) are ready at 0; compute1 feeds a 5 s comm. Lowest index
    # first: compute0 0..1, compute1 1..2, comm 2..7.
    g = TaskGraph("priority")
    a, b, c = (g.buffer(n, rows=1) for n in "abc")
    g.add("compute0", "vector", None, writes=[a])
    g.add("compute1", "vector", None, writes=[b])
    g.add("send", "comm", None, reads=[b], writes=[c])
    assert_prediction(simulate(g, {"compute0": 1.0, "compute1": 1.0, "send": 5.0}),
                      overlapped=7.0, sequential=7.0, exposed=5.0)


def test_cost_model_seconds_for_each_kind():
    model = CostModel(matmul_flops=1e12, memory_bytes_per_s=1e9, link_bytes_per_s=1e8, link_latency_s=1e-5,
                      task_overhead_s=2e-6)
    g = TaskGraph("model")
    mm = g.add("mm", "matmul", None, flops=3_000_000_000, bytes=10**9)  # bytes ignored for a matmul
    vec = g.add("vec", "vector", None, bytes=5_000_000, flops=10**12)  # flops ignored for a vector task
    comm = g.add("comm", "comm", None, bytes=2_000_000)
    assert model(mm) == pytest.approx(2e-6 + 3e-3)
    assert model(vec) == pytest.approx(2e-6 + 5e-3)
    assert model(comm) == pytest.approx(2e-6 + 1e-5 + 2e-2)
    assert CostModel(1e12, 1e9, 1e8, 1e-5)(comm) == pytest.approx(1e-5 + 2e-2)  # no overhead by default


def test_simulate_takes_a_cost_model():
    model = CostModel(matmul_flops=1e9, memory_bytes_per_s=1e9, link_bytes_per_s=1e9, link_latency_s=0.5)
    g = TaskGraph("modelled")
    g.add("send", "comm", None, bytes=10**9, writes=[g.buffer("a", rows=1)])  # 0.5 + 1 s
    g.add("mm", "matmul", None, flops=2 * 10**9, writes=[g.buffer("b", rows=1)])  # 2 s, independent
    assert_prediction(simulate(g, model), overlapped=2.0, sequential=3.5, exposed=0.0)
    assert simulate(g, model).speedup == pytest.approx(3.5 / 2.0)


def test_an_empty_graph_takes_no_time():
    got = simulate(TaskGraph("empty"), {})
    assert_prediction(got, overlapped=0.0, sequential=0.0, exposed=0.0)
    assert got.speedup == 1.0


def event(name: str, dur_us: float, *, graph: str = "g", pid: int = 0, cat: str = "matmul") -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": 0, "ts": 0.0, "dur": dur_us,
            "args": {"graph": graph, "bytes": 0, "flops": 0}}


def test_costs_from_trace_take_the_median_duration_by_name_in_seconds():
    events = [event("mm", 100.0), event("mm", 300.0), event("send", 50.0, cat="comm"),
              event("wait send", 40.0, cat="wait")]  # waits are no task's cost
    assert costs_from_trace(events) == pytest.approx({"mm": 200e-6, "send": 50e-6})
    # one slow run of a task does not decide its cost
    assert costs_from_trace([event("mm", 100.0), event("mm", 110.0), event("mm", 900.0)]) == pytest.approx({"mm": 110e-6})


def test_costs_from_trace_of_one_graph_and_one_rank():
    events = [event("mm", 100.0, graph="fwd", pid=0), event("mm", 200.0, graph="fwd", pid=1),
              event("mm", 900.0, graph="bwd", pid=0), event("act", 10.0, graph="bwd", pid=1, cat="vector")]
    # over the ranks: a compute task's slowest, a comm task's fastest (the others waited for it)
    assert costs_from_trace(events, graph_name="fwd") == pytest.approx({"mm": 200e-6})
    exchange = [event("send", 90.0, cat="comm", pid=0), event("send", 30.0, cat="comm", pid=1)]
    assert costs_from_trace(exchange) == pytest.approx({"send": 30e-6})
    assert costs_from_trace(events, rank=0) == pytest.approx({"mm": 500e-6})
    assert costs_from_trace(events, graph_name="bwd", rank=1) == pytest.approx({"act": 10e-6})
    assert costs_from_trace(events, graph_name="bwd", rank=0) == pytest.approx({"mm": 900e-6})


def test_costs_from_trace_feed_simulate():
    g = independent("comm", "matmul")
    costs = costs_from_trace([event("comm0", 4000.0, cat="comm"), event("matmul1", 1000.0),
                              event("matmul1", 3000.0)])
    assert_prediction(simulate(g, costs), overlapped=4e-3, sequential=6e-3, exposed=2e-3)


def test_exposed_comm_on_cuda_lanes_is_the_time_no_compute_lane_works():
    """matmul and vector run side by side for 1 s, then both wait for the 2 s comm: 1 s exposed."""
    g = independent("comm", "matmul", "vector")
    assert_prediction(simulate(g, {"comm0": 2.0, "matmul1": 1.0, "vector2": 1.0}, lanes=LANE_PER_KIND),
                      overlapped=2.0, sequential=4.0, exposed=1.0)


def test_in_order_lanes_hold_a_ready_task_behind_one_that_is_not():
    """As a CUDA stream does: "late" waits for the comm, and "ready", issued after it on the same
    lane, waits for "late" although nothing it reads is missing."""
    g = TaskGraph("streams")
    received, out = g.buffer("received", rows=1), g.buffer("out", rows=2)
    g.add("comm", "comm", None, writes=[received])
    g.add("late", "matmul", None, reads=[received], writes=[out[0:1]])
    g.add("ready", "matmul", None, writes=[out[1:2]])
    costs = {"comm": 2.0, "late": 1.0, "ready": 1.0}
    assert_prediction(simulate(g, costs), overlapped=3.0, sequential=4.0, exposed=1.0)  # "ready" fills the wait
    assert_prediction(simulate(g, costs, in_order=True), overlapped=4.0, sequential=4.0, exposed=2.0)

"""TaskGraph's dependency inference on hand-built graphs (read-after-write, write-after-read,
write-after-write, by overlapping row ranges), its errors (a read that no earlier task produces,
a cycle through an explicit edge, an unknown kind, an `after=` task of another graph) and the
order `validate` gives (program order wherever the edges allow)."""

from __future__ import annotations

import re

import pytest
import torch

from hyperparallel.errors import ConfigError
from hyperparallel.multicore import TaskGraph, run


def noop() -> None:
    return None


def cycle_in(message: str) -> list[str]:
    """The task names of a cycle message ("'a' -> 'b' -> 'a'"), rotated to start at the smallest
    name and without the repeated start: the cycle, whichever task the message starts it at."""
    path = re.findall(r"'([^']*)'(?= ->| \()", message.split("has a cycle: ", 1)[1])
    assert len(path) >= 2 and path[0] == path[-1], message
    ring = path[:-1]
    start = ring.index(min(ring))
    return ring[start:] + ring[:start]


def deps_by_name(graph: TaskGraph) -> dict[str, set[str]]:
    """Every task's dependencies, by name."""
    return {t.name: {graph.tasks[d].name for d in t.deps} for t in graph.tasks}


def test_a_chain_of_producers_and_consumers_depends_link_by_link():
    g = TaskGraph("chain")
    x = g.input("x", torch.zeros(4, 2))
    a, b, c = (g.buffer(n, rows=4) for n in "abc")
    g.add("t0", "matmul", noop, reads=[x], writes=[a])
    g.add("t1", "vector", noop, reads=[a], writes=[b])
    g.add("t2", "comm", noop, reads=[b], writes=[c])
    assert deps_by_name(g) == {"t0": set(), "t1": {"t0"}, "t2": {"t1"}}
    assert g.validate() == [0, 1, 2]


def test_a_diamond_joins_both_branches_and_the_branches_are_independent():
    g = TaskGraph("diamond")
    x = g.input("x", rows=4)
    top, left, right, out = (g.buffer(n, rows=4) for n in ("top", "left", "right", "out"))
    g.add("top", "matmul", noop, reads=[x], writes=[top])
    g.add("left", "vector", noop, reads=[top], writes=[left])
    g.add("right", "matmul", noop, reads=[top], writes=[right])
    g.add("join", "vector", noop, reads=[left, right], writes=[out])
    assert deps_by_name(g) == {"top": set(), "left": {"top"}, "right": {"top"}, "join": {"left", "right"}}


def test_write_after_read_makes_the_overwriter_wait_for_the_reader():
    g = TaskGraph("war")
    x = g.input("x", rows=4)
    y = g.buffer("y", rows=4)
    g.add("reader", "matmul", noop, reads=[x], writes=[y])
    g.add("overwriter", "vector", noop, writes=[x])  # reads nothing: only the hazard orders it
    assert deps_by_name(g) == {"reader": set(), "overwriter": {"reader"}}


def test_write_after_write_makes_the_second_writer_wait_for_the_first():
    g = TaskGraph("waw")
    y = g.buffer("y", rows=4)
    g.add("first", "matmul", noop, writes=[y[0:3]])
    g.add("second", "vector", noop, writes=[y[2:4]])
    assert deps_by_name(g) == {"first": set(), "second": {"first"}}


def test_disjoint_row_ranges_of_one_buffer_create_no_dependency_and_overlapping_ones_do():
    g = TaskGraph("rows")
    y = g.buffer("y", rows=8)
    z = g.buffer("z", rows=8)
    g.add("w_lo", "matmul", noop, writes=[y[0:4]])
    g.add("w_hi", "matmul", noop, writes=[y[4:8]])  # disjoint from w_lo: no WAW edge
    g.add("r_lo", "vector", noop, reads=[y[0:4]], writes=[z[0:4]])  # reads only w_lo's rows
    g.add("r_mid", "vector", noop, reads=[y[3:5]], writes=[z[4:8]])  # straddles both writers
    g.add("w_edge", "matmul", noop, writes=[y[3:4]])  # rows 3:4: after w_lo (WAW), r_lo and r_mid (WAR)
    assert deps_by_name(g) == {"w_lo": set(), "w_hi": set(), "r_lo": {"w_lo"}, "r_mid": {"w_lo", "w_hi"},
                               "w_edge": {"w_lo", "r_lo", "r_mid"}}


def test_adjacent_ranges_touching_at_a_boundary_do_not_overlap():
    g = TaskGraph("adjacent")
    y = g.buffer("y", rows=4)
    assert not y[0:2].overlaps(y[2:4]) and not y[2:4].overlaps(y[0:2])
    assert y[0:3].overlaps(y[2:4]) and y[2:4].overlaps(y[0:3])
    other = g.buffer("other", rows=4)
    assert not y[0:4].overlaps(other[0:4])  # same rows of another buffer


def test_reading_graph_inputs_needs_no_producer_and_no_dependency():
    g = TaskGraph("inputs")
    x = g.input("x", torch.zeros(4, 2))
    w = g.input("w", rows=3)  # a row count alone, for planning
    out = g.buffer("out", rows=4)
    g.add("a", "matmul", noop, reads=[x[1:3], w], writes=[out[0:2]])
    g.add("b", "matmul", noop, reads=[x, w[0:1]], writes=[out[2:4]])
    assert deps_by_name(g) == {"a": set(), "b": set()}  # reads of reads are no hazard


def test_reading_a_produced_buffer_that_nothing_writes_names_the_task_buffer_and_rows():
    g = TaskGraph("missing")
    h = g.buffer("hidden", rows=4)
    out = g.buffer("out", rows=4)
    with pytest.raises(ConfigError) as error:
        g.add("consumer", "vector", noop, reads=[h], writes=[out])
    message = str(error.value)
    assert "'consumer'" in message and "hidden[0:4]" in message
    assert "declare 'hidden' a graph input" in message
    assert g.tasks == []  # the rejected task was not added


def test_reading_rows_past_those_written_names_only_the_missing_rows():
    g = TaskGraph("partial")
    h = g.buffer("h", rows=4)
    out = g.buffer("out", rows=4)
    g.add("producer", "matmul", noop, writes=[h[0:2]])
    g.add("ok", "vector", noop, reads=[h[0:2]], writes=[out[0:2]])  # the written rows alone: fine
    with pytest.raises(ConfigError) as error:
        g.add("consumer", "vector", noop, reads=[h[0:4]], writes=[out])
    message = str(error.value)
    assert "'consumer' reads h[0:4]" in message
    assert "produces h[2:4]" in message
    assert "'producer'" not in message  # names the reader, not the partial writer


def test_rows_covered_by_several_earlier_writers_together_need_no_single_producer():
    g = TaskGraph("pieces")
    h = g.buffer("h", rows=6)
    out = g.buffer("out", rows=6)
    g.add("p1", "matmul", noop, writes=[h[3:6]])
    g.add("p0", "matmul", noop, writes=[h[0:3]])
    g.add("consumer", "vector", noop, reads=[h], writes=[out])
    assert deps_by_name(g)["consumer"] == {"p0", "p1"}


def test_a_producer_added_after_the_reader_does_not_count():
    g = TaskGraph("late")
    h = g.buffer("h", rows=2)
    with pytest.raises(ConfigError, match=r"task 'early' reads h\[0:2\], but no task before it produces h\[0:2\]"):
        g.add("early", "vector", noop, reads=[h])


def test_a_cycle_through_precede_is_reported_on_validate_naming_its_tasks():
    g = TaskGraph("loop")
    x = g.input("x", rows=2)
    a, b = g.buffer("a", rows=2), g.buffer("b", rows=2)
    first = g.add("first", "matmul", noop, reads=[x], writes=[a])
    g.add("bystander", "vector", noop, reads=[x])  # not on the cycle
    second = g.add("second", "vector", noop, reads=[a], writes=[b])
    g.precede(second, first)  # first waits for second, which reads first's output
    with pytest.raises(ConfigError) as error:
        g.validate()
    message = str(error.value)
    assert "graph 'loop' has a cycle" in message
    assert cycle_in(message) == ["first", "second"]
    assert "bystander" not in message


def test_a_task_made_to_precede_itself_is_a_cycle_naming_it():
    g = TaskGraph("self")
    t = g.add("lonely", "vector", noop)
    g.precede(t, t)
    with pytest.raises(ConfigError, match="task 'lonely' waits for itself"):
        g.validate()


def test_a_three_task_cycle_names_every_task_on_it():
    g = TaskGraph("three")
    y = g.buffer("y", rows=3)
    t0 = g.add("t0", "matmul", noop, writes=[y[0:1]])
    g.add("t1", "matmul", noop, reads=[y[0:1]], writes=[y[1:2]])
    t2 = g.add("t2", "matmul", noop, reads=[y[1:2]], writes=[y[2:3]])
    g.precede(t2, t0)
    with pytest.raises(ConfigError) as error:
        g.validate()
    assert cycle_in(str(error.value)) == ["t0", "t1", "t2"]  # in running order: t0 before t1 before t2


def test_an_unknown_task_kind_is_rejected_naming_the_task_and_kind():
    g = TaskGraph("kinds")
    with pytest.raises(ConfigError) as error:
        g.add("odd", "gpu", noop)
    message = str(error.value)
    assert "task 'odd' has kind 'gpu'" in message and "comm, matmul, vector" in message
    assert g.tasks == []


def test_after_adds_an_explicit_edge_between_otherwise_independent_tasks():
    g = TaskGraph("after")
    a, b = g.buffer("a", rows=2), g.buffer("b", rows=2)
    first = g.add("first", "matmul", noop, writes=[a])
    g.add("free", "matmul", noop, writes=[b[0:1]])
    g.add("second", "vector", noop, writes=[b[1:2]], after=[first])
    assert deps_by_name(g) == {"first": set(), "free": set(), "second": {"first"}}


def test_after_a_task_of_another_graph_is_rejected_naming_both():
    other = TaskGraph("other")
    foreign = other.add("foreign", "vector", noop)
    g = TaskGraph("mine")
    g.add("local", "vector", noop)  # index 0, like `foreign`: the check is by identity
    with pytest.raises(ConfigError, match="task 'mine_task' is to run after 'foreign', which is not in graph 'mine'"):
        g.add("mine_task", "vector", noop, after=[foreign])


def test_precede_with_a_task_of_another_graph_is_rejected_naming_it():
    other = TaskGraph("other")
    foreign = other.add("foreign", "vector", noop)
    g = TaskGraph("mine")
    local = g.add("local", "vector", noop)
    with pytest.raises(ConfigError, match="task 'foreign' is not in graph 'mine'"):
        g.precede(foreign, local)


def test_validate_gives_program_order_when_the_edges_allow_it():
    g = TaskGraph("order")
    y = g.buffer("y", rows=4)
    for i in range(4):  # independent: each its own row
        g.add(f"t{i}", "matmul" if i % 2 else "comm", noop, writes=[y[i:i + 1]])
    g.add("reduce", "vector", noop, reads=[y])
    assert g.validate() == [0, 1, 2, 3, 4]


def test_validate_moves_a_task_only_as_far_as_an_explicit_edge_requires():
    g = TaskGraph("moved")
    tasks = [g.add(f"t{i}", "vector", noop) for i in range(5)]
    g.precede(tasks[3], tasks[1])  # t1 after t3: t2 and t3 move ahead of it, t4 stays last
    assert g.validate() == [0, 2, 3, 1, 4]
    g.precede(tasks[4], tasks[0])  # a second edge invalidates the cached order
    assert g.validate() == [2, 3, 1, 4, 0]


def test_a_region_is_a_contiguous_row_range_with_python_slice_bounds():
    g = TaskGraph("slices")
    y = g.buffer("y", torch.arange(12).reshape(6, 2))
    assert (y[-2:].start, y[-2:].stop) == (4, 6)
    assert (y[4:2].start, y[4:2].stop) == (4, 4)  # an empty range, not a reversed one
    assert torch.equal(y[1:3].tensor, torch.tensor([[2, 3], [4, 5]]))
    assert str(y[1:3]) == "y[1:3]"
    with pytest.raises(ConfigError, match="region of buffer 'y' is a contiguous row range; got a step of 2"):
        y[::2]


def test_a_buffer_needs_a_tensor_or_a_row_count_and_set_checks_the_rows():
    g = TaskGraph("sizes")
    with pytest.raises(ConfigError, match="buffer 'nothing' needs a tensor or a row count"):
        g.buffer("nothing")
    y = g.buffer("y", rows=3)
    y.set(torch.zeros(3, 5))
    assert y.tensor.shape == (3, 5)
    with pytest.raises(ConfigError, match=r"buffer 'y' has 3 rows; a task set it to \(4, 5\)"):
        y.set(torch.zeros(4, 5))


def test_an_empty_region_orders_against_the_writers_around_its_place():
    """A producer may set a buffer's tensor itself: a reader of zero rows still needs that tensor
    (MegaMoE's waves that receive no rows), so it waits for a writer touching its place."""
    g = TaskGraph("empty")
    y = g.buffer("y", rows=0)
    g.add("set empty", "vector", lambda: y.set(torch.zeros(0, 3)), writes=[y])
    g.add("read empty", "comm", noop, reads=[y])
    assert deps_by_name(g)["read empty"] == {"set empty"}
    z = g.buffer("z", rows=0)
    with pytest.raises(ConfigError, match=r"task 'read z' reads z\[0:0\], but no task before it writes buffer 'z'"):
        g.add("read z", "vector", noop, reads=[z])


def test_an_empty_region_of_a_buffer_that_has_its_tensor_touches_nothing():
    """A rank that sends no rows in a wave writes an empty region of the returned rows: that must
    not chain the waves' exchanges together."""
    g = TaskGraph("empty rows")
    out = g.buffer("out", torch.zeros(4, 2))
    g.add("wave 0", "comm", noop, writes=[out[0:2]])
    g.add("wave 1", "comm", noop, writes=[out[2:2]])
    g.add("wave 2", "comm", noop, writes=[out[2:4]])
    assert deps_by_name(g) == {"wave 0": set(), "wave 1": set(), "wave 2": set()}


def test_a_gap_between_two_writers_is_named_exactly():
    g = TaskGraph("gap")
    h = g.buffer("h", rows=4)
    g.add("first", "vector", noop, writes=[h[0:2]])
    g.add("last", "vector", noop, writes=[h[3:4]])
    with pytest.raises(ConfigError, match=r"no task before it produces h\[2:3\]"):
        g.add("reader", "vector", noop, reads=[h[0:4]])


def run_a_graph_that_closes_over_itself() -> tuple[TaskGraph, object]:
    import weakref

    g = TaskGraph("cycle")
    y = g.buffer("y", rows=2)
    g.add("make", "vector", lambda: (y.set(torch.ones(2)), g.hold(torch.zeros(1))), writes=[y])
    run(g)
    return g, weakref.ref(y.tensor)


def test_release_frees_a_graph_whose_tasks_close_over_it_without_the_cycle_collector():
    import gc
    import weakref

    gc.disable()  # what is freed must go by reference counting alone
    try:
        g, tensor = run_a_graph_that_closes_over_itself()
        graph = weakref.ref(g)
        g.release()
        g = None
        assert tensor() is None and graph() is None
        g, tensor = run_a_graph_that_closes_over_itself()
        graph = weakref.ref(g)
        g = None
        assert graph() is not None  # (without release: a cycle, alive until the collector runs)
    finally:
        gc.enable()

"""The CPU executor (`multicore.run`) on random graphs: whatever order it runs the ready compute
tasks in (a seeded random `pick`), and whenever asynchronous communication does its work (at
issue, at `wait`, or split between them), the buffers end exactly as running the tasks one after
another in program order leaves them; the same with overlap=False. Also: RunStats' fields are
consistent with the spans of the run."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from hyperparallel import multicore
from hyperparallel.multicore import TaskGraph

GRAPHS = 30
SEEDS = range(4)  # ready orders tried per graph, besides the default (lowest index first)
COLUMNS = 3
MODULUS = 1_000_003  # int64 values stay small and every operation is exact


@dataclass(frozen=True)
class Spec:
    """One task of a random graph: regions as (buffer index, start, stop)."""

    name: str
    kind: str
    reads: tuple[tuple[int, int, int], ...]
    writes: tuple[tuple[int, int, int], ...]
    constant: int
    accumulate: bool  # the writes add to the rows' old contents (the write regions are also read)
    mode: str  # comm tasks: "sync" (returns None), "late" (all work at wait), "split" (read at issue)


@dataclass(frozen=True)
class GraphSpec:
    rows: tuple[int, ...]
    inputs: tuple[bool, ...]
    tasks: tuple[Spec, ...]


def random_range(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    start = rng.randrange(lo, hi)
    return start, rng.randrange(start + 1, hi + 1)


def random_spec(seed: int) -> GraphSpec:
    """8-20 tasks over 2-4 buffers of 4-8 rows; reads of produced buffers only of rows an earlier
    task wrote (the graph refuses others)."""
    rng = random.Random(seed)
    count = rng.randrange(2, 5)
    rows = tuple(rng.randrange(4, 9) for _ in range(count))
    inputs = tuple(i == 0 or rng.random() < 0.4 for i in range(count))  # at least one input
    written = [set(range(r)) if inputs[b] else set() for b, r in enumerate(rows)]
    tasks = []
    for t in range(rng.randrange(8, 21)):
        reads = []
        for _ in range(rng.randrange(0, 3)):
            b = rng.randrange(count)
            if written[b]:
                lo = rng.choice(sorted(written[b]))
                hi = lo + 1
                while hi in written[b] and rng.random() < 0.7:
                    hi += 1
                reads.append((b, lo, hi))
        writes = []
        for _ in range(rng.randrange(1, 3)):
            b = rng.randrange(count)
            writes.append((b, *random_range(rng, 0, rows[b])))
        accumulate = rng.random() < 0.3 and all(set(range(lo, hi)) <= written[b] for b, lo, hi in writes)
        for b, lo, hi in writes:
            written[b].update(range(lo, hi))
        kind = rng.choice(("comm", "matmul", "vector", "vector"))
        tasks.append(Spec(f"t{t}", kind, tuple(reads), tuple(writes), rng.randrange(1, 1000), accumulate,
                          rng.choice(("sync", "late", "split")) if kind == "comm" else "sync"))
    return GraphSpec(rows, inputs, tuple(tasks))


def initial(spec: GraphSpec, device: str = "cpu") -> list[torch.Tensor]:
    """Every buffer's contents before a run: inputs numbered, produced buffers a marker value
    that no task writes (so a read of stale rows shows)."""
    g = torch.Generator().manual_seed(len(spec.tasks))
    return [(torch.randint(0, MODULUS, (r, COLUMNS), generator=g, dtype=torch.int64) if is_input
             else torch.full((r, COLUMNS), -7, dtype=torch.int64)).to(device)
            for r, is_input in zip(spec.rows, spec.inputs, strict=True)]


class DeferredWork:
    """An asynchronous work handle: `finish` runs at `wait`, as a collective's result lands at some
    time before its wait returns. `is_completed` answers from a seeded RNG, so that the executor
    retires handles at varying points."""

    def __init__(self, finish, rng: random.Random):
        self.finish, self.rng, self.done = finish, rng, False

    def is_completed(self) -> bool:
        return self.rng.random() < 0.5

    def wait(self) -> None:
        assert not self.done, "a work handle was waited on twice"
        self.done = True
        self.finish()


def task_fn(spec: Spec, tensors: list[torch.Tensor], rng: random.Random):
    """writes = (sum over the read rows, each weighted by its position) * 31 + the task's constant
    + a pattern over the written rows, mod MODULUS; accumulating tasks add it to the old rows."""

    def gather() -> int:
        total = 0
        for k, (b, lo, hi) in enumerate(spec.reads):
            block = tensors[b][lo:hi]
            weights = torch.arange(1, block.numel() + 1, dtype=torch.int64, device=block.device).reshape(block.shape)
            total += int((block * weights).sum()) * (k + 2)
        return total % MODULUS

    def scatter(total: int) -> None:
        for k, (b, lo, hi) in enumerate(spec.writes):
            pattern = torch.arange((hi - lo) * COLUMNS, dtype=torch.int64, device=tensors[b].device).reshape(
                hi - lo, COLUMNS) * (k + 5)
            value = (total * 31 + spec.constant + pattern) % MODULUS
            if spec.accumulate:
                value = (tensors[b][lo:hi] + value) % MODULUS
            tensors[b][lo:hi] = value

    def fn():
        if spec.mode == "late":
            return DeferredWork(lambda: scatter(gather()), rng)
        total = gather()
        if spec.mode == "split":
            return DeferredWork(lambda: scatter(total), rng)
        scatter(total)
        return None

    return fn


def build(spec: GraphSpec, rng: random.Random, device: str = "cpu") -> tuple[TaskGraph, list[torch.Tensor]]:
    tensors = initial(spec, device)
    g = TaskGraph("random")
    buffers = [(g.input if is_input else g.buffer)(f"b{i}", t)
               for i, (t, is_input) in enumerate(zip(tensors, spec.inputs, strict=True))]
    for task in spec.tasks:
        reads = [buffers[b][lo:hi] for b, lo, hi in task.reads]
        writes = [buffers[b][lo:hi] for b, lo, hi in task.writes]
        if task.accumulate:
            reads += writes
        g.add(task.name, task.kind, task_fn(task, tensors, rng), reads=reads, writes=writes)
    return g, tensors


def program_order(spec: GraphSpec) -> list[torch.Tensor]:
    """The buffers after every task ran one after another, in the order they were added."""
    tensors = initial(spec)
    for task in spec.tasks:
        work = task_fn(task, tensors, random.Random(0))()
        if work is not None:
            work.wait()
    return tensors


def executed_order(stats: multicore.RunStats) -> list[str]:
    """The tasks in the order their spans end."""
    return [s.name for s in sorted((s for s in stats.spans if s.kind != "wait"), key=lambda s: s.end_ns)]


def assert_same_buffers(got: list[torch.Tensor], want: list[torch.Tensor], label: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{label}: buffer b{i} differs from program order in rows " \
                                  f"{sorted(set((a != b).nonzero()[:, 0].tolist()))}"


@pytest.fixture(scope="module")
def specs() -> list[GraphSpec]:
    return [random_spec(seed) for seed in range(GRAPHS)]


def test_the_random_graphs_have_the_promised_shape(specs):
    assert all(8 <= len(s.tasks) <= 20 and 2 <= len(s.rows) <= 4 for s in specs)
    kinds = {t.kind for s in specs for t in s.tasks}
    modes = {t.mode for s in specs for t in s.tasks if t.kind == "comm"}
    assert kinds == {"comm", "matmul", "vector"} and modes == {"sync", "late", "split"}
    assert any(t.accumulate for s in specs for t in s.tasks)


def test_the_check_is_sensitive_without_the_inferred_dependencies_every_graph_goes_wrong(specs):
    """Not vacuous: with its edges removed, a random ready order of every generated graph leaves
    other buffer contents than program order (measured: all 30 graphs), so a schedule that broke a
    dependency would show."""
    for seed, spec in enumerate(specs):
        rng = random.Random(seed)
        graph, tensors = build(spec, rng)
        for task in graph.tasks:
            task.deps.clear()
        multicore.run(graph, pick=lambda ready, rng=rng: rng.choice(ready))
        assert any(not torch.equal(a, b) for a, b in zip(tensors, program_order(spec), strict=True)), f"graph {seed}"


def test_random_ready_orders_give_exactly_the_buffers_of_program_order(specs):
    distinct_orders = 0
    for seed, spec in enumerate(specs):
        want = program_order(spec)
        orders = set()
        for pick_seed in [None, *SEEDS]:
            rng = random.Random(1000 * seed + (pick_seed if pick_seed is not None else 999))
            graph, tensors = build(spec, rng)
            pick = None if pick_seed is None else (lambda ready, rng=rng: rng.choice(ready))
            stats = multicore.run(graph, pick=pick)
            assert_same_buffers(tensors, want, f"graph {seed}, pick seed {pick_seed}")
            orders.add(tuple(executed_order(stats)))
        distinct_orders += len(orders) > 1
    # the seeds did try different ready orders (measured: in 29 of the 30 graphs)
    assert distinct_orders >= GRAPHS - 3, distinct_orders


def test_overlap_false_gives_exactly_the_buffers_of_program_order(specs):
    for seed, spec in enumerate(specs):
        rng = random.Random(seed)
        graph, tensors = build(spec, rng)
        multicore.run(graph, pick=lambda ready, rng=rng: rng.choice(ready), overlap=False)
        assert_same_buffers(tensors, program_order(spec), f"graph {seed}, overlap=False")


def test_the_executor_never_starts_a_task_before_its_dependencies_finish(specs):
    for seed, spec in enumerate(specs[:10]):
        rng = random.Random(seed)
        graph, _ = build(spec, rng)
        stats = multicore.run(graph, pick=lambda ready, rng=rng: rng.choice(ready))
        span = {s.index: s for s in stats.spans if s.kind != "wait"}
        for task in graph.tasks:
            for dep in task.deps:
                assert span[dep].end_ns <= span[task.index].start_ns, f"graph {seed}: {task.name} before {dep}"


def test_run_stats_are_consistent_with_the_spans(specs):
    spec = next(s for s in specs if sum(t.mode != "sync" for t in s.tasks) >= 2)  # async comm in it
    for overlap in (True, False):
        rng = random.Random(5)
        graph, _ = build(spec, rng)
        stats = multicore.run(graph, pick=lambda ready, rng=rng: rng.choice(ready), overlap=overlap)
        task_spans = [s for s in stats.spans if s.kind != "wait"]
        waits = [s for s in stats.spans if s.kind == "wait"]
        assert sorted(s.index for s in task_spans) == list(range(len(graph.tasks)))  # one per task
        assert all(s.lane == ("comm" if s.kind == "comm" else "compute") for s in task_spans)
        assert all(s.lane == "compute" and s.name.startswith("wait t") for s in waits)
        assert all(s.start_ns <= s.end_ns for s in stats.spans)
        compute = sum(s.end_ns - s.start_ns for s in task_spans if s.lane == "compute")
        assert stats.compute_ns == compute
        assert stats.exposed_comm_ns == sum(s.end_ns - s.start_ns for s in waits)
        assert 0 <= stats.compute_ns <= stats.wall_ns
        assert stats.compute_ns + stats.exposed_comm_ns <= stats.wall_ns  # both on the calling thread, disjoint
        assert 0 <= stats.comm_ns <= stats.wall_ns
        assert 0.0 <= stats.exposed_comm_fraction <= 1.0
        if not overlap:  # every asynchronous comm task was waited on at once: one wait each
            assert len(waits) == sum(t.mode != "sync" for t in spec.tasks)


def noting(fn, name: str, issued: list[str]):
    """`fn`, noting `name` in `issued` when called."""

    def call():
        issued.append(name)
        return fn()

    return call


def test_comm_tasks_are_issued_in_validate_order_whatever_the_ready_order(specs):
    for seed, spec in enumerate(specs[:10]):
        issued: list[str] = []
        rng = random.Random(seed)
        graph, _ = build(spec, rng)
        for task in graph.tasks:
            if task.kind == "comm":
                task.fn = noting(task.fn, task.name, issued)
        multicore.run(graph, pick=lambda ready, rng=rng: rng.choice(ready))
        assert issued == [graph.tasks[i].name for i in graph.validate() if graph.tasks[i].kind == "comm"]


def test_a_task_without_a_function_is_skipped_and_still_releases_its_users():
    g = TaskGraph("placeholders")
    y = g.buffer("y", torch.zeros(2, dtype=torch.int64))
    g.add("plan", "comm", None, writes=[y[0:1]])
    g.add("marker", "matmul", None, writes=[y[1:2]])
    g.add("use", "vector", lambda: y.tensor.add_(3), reads=[y], writes=[y])
    stats = multicore.run(g)
    assert torch.equal(y.tensor, torch.tensor([3, 3]))
    assert sorted(s.name for s in stats.spans) == ["marker", "plan", "use"]


def test_an_unknown_executor_is_rejected_naming_it():
    g = TaskGraph("x")
    with pytest.raises(ValueError, match="executor 'tpu'"):
        multicore.run(g, "tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-stream executor needs a CUDA device; "
                                                          "this test runs unchanged where there is one")
def test_the_cuda_stream_executor_gives_exactly_the_buffers_of_program_order(specs):
    """One stream per lane, events between lanes: the same buffers as program order."""
    for n, spec in enumerate(specs):
        graph, tensors = build(spec, random.Random(n), device="cuda")
        multicore.run(graph, "cuda")
        torch.cuda.synchronize()
        assert_same_buffers([t.cpu() for t in tensors], program_order(spec), f"graph {n} on cuda streams")

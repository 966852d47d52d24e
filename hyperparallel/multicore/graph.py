"""TaskGraph: tasks of three kinds whose order is inferred from the data they read and write.

A graph is written like a sequential program: tasks are added in an order that would be correct
if they ran one after another (the *program order*). Each task names the buffer regions it reads
and writes, and the graph infers from them what must run before what:

    read-after-write   a task reading rows some earlier task writes runs after that writer;
    write-after-read   a task writing rows some earlier task reads runs after that reader;
    write-after-write  a task writing rows some earlier task writes runs after that writer.

Nothing is numbered by hand, so a schedule that respects these edges computes what the program
order computes, whatever else runs in between. Explicit edges can be added too (`after=` when
adding a task, `precede(a, b)` between any two: to hold a memory peak down, say); an edge from a
task to one before it can close a cycle, which `validate` reports with the tasks on it.

A region is a range of rows (dim 0) of a `Buffer`, so the waves of one output buffer (or the
experts of one weight gradient) are written by separate tasks without false dependencies. An
empty region touches nothing, except in a buffer whose tensor a producer sets (`Buffer.set`):
there it orders against the writers around its place, since its reader needs that tensor.
A buffer is either an input (`TaskGraph.input`, produced before the graph runs) or produced by
the graph (`TaskGraph.buffer`); reading rows of a produced buffer that no earlier task writes is
an error naming the reader, the buffer and the rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from hyperparallel.errors import ConfigError

KINDS = ("comm", "matmul", "vector")


class Buffer:
    """A named tensor (or, for planning, a row count) that tasks read and write by row ranges.

    `tensor` may be None until a task sets it (`Buffer.set`): a producing task can allocate its
    output itself. `rows` fixes the buffer's extent for dependency tracking."""

    def __init__(self, name: str, rows: int, tensor: torch.Tensor | None, is_input: bool):
        self.name, self.rows, self.tensor, self.is_input = name, rows, tensor, is_input

    def __getitem__(self, rows: slice) -> Region:
        start, stop, step = rows.indices(self.rows)
        if step != 1:
            raise ConfigError(f"a region of buffer {self.name!r} is a contiguous row range; got a step of {step}")
        return Region(self, start, max(start, stop))

    @property
    def whole(self) -> Region:
        return Region(self, 0, self.rows)

    def set(self, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.rows:
            raise ConfigError(f"buffer {self.name!r} has {self.rows} rows; a task set it to {tuple(tensor.shape)}")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"Buffer({self.name!r}, rows={self.rows})"


@dataclass(frozen=True)
class Region:
    buffer: Buffer
    start: int
    stop: int

    @property
    def tensor(self) -> torch.Tensor:
        return self.buffer.tensor[self.start:self.stop]

    def overlaps(self, other: Region) -> bool:
        if self.buffer is not other.buffer:
            return False
        if self.start == self.stop or other.start == other.stop:
            # an empty region of a buffer whose tensor a producer will set (none yet) still orders
            # against the writers around its place: the reader needs that tensor, empty or not.
            # Of a buffer that has its tensor, an empty region touches nothing.
            return self.buffer.tensor is None and self.start <= other.stop and other.start <= self.stop
        return self.start < other.stop and other.start < self.stop

    def __str__(self) -> str:
        return f"{self.buffer.name}[{self.start}:{self.stop}]"


@dataclass
class Task:
    """One unit of work. `fn()` does it; a comm task may return an async work handle (anything
    with `wait()`: a c10d Work, a torch.futures.Future), which the executor waits on only where a
    consumer needs the result.
    `bytes` (moved or sent) and `flops` describe the task to traces and the simulator."""

    index: int
    name: str
    kind: str
    fn: Callable[[], object] | None
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    after: tuple[Task, ...] = ()
    bytes: int = 0
    flops: int = 0
    deps: set[int] = field(default_factory=set)  # indices of the tasks this one waits for

    def __repr__(self) -> str:
        return f"Task({self.index}, {self.name!r}, {self.kind})"


def _regions(items: Iterable[Buffer | Region]) -> tuple[Region, ...]:
    return tuple(item.whole if isinstance(item, Buffer) else item for item in items)


class TaskGraph:
    def __init__(self, name: str = "graph"):
        self.name = name
        self.tasks: list[Task] = []
        self.buffers: list[Buffer] = []
        self.held: list[torch.Tensor] = []
        self._order: list[int] | None = None

    def release(self) -> None:
        """Drop the tasks and buffers (and the tensors they hold) of a graph that is done. Tasks
        usually close over the graph's buffers, and so over the graph: without this, a graph and
        every tensor of it live until Python's cycle collector runs."""
        for buffer in self.buffers:
            buffer.tensor = None
        self.tasks, self.buffers, self.held, self._order = [], [], [], None

    def hold(self, *tensors: torch.Tensor) -> None:
        """Tensors a task makes that outlive the run outside any buffer (saved for a later graph):
        the CUDA executor protects them as it does buffers' tensors. Call from inside the task."""
        self.held.extend(tensors)

    def input(self, name: str, tensor: torch.Tensor | None = None, *, rows: int | None = None) -> Buffer:
        """A buffer whose contents exist before the graph runs."""
        return self._buffer(name, tensor, rows, is_input=True)

    def buffer(self, name: str, tensor: torch.Tensor | None = None, *, rows: int | None = None) -> Buffer:
        """A buffer the graph's tasks produce (pre-allocated `tensor`, or set by its first writer)."""
        return self._buffer(name, tensor, rows, is_input=False)

    def _buffer(self, name, tensor, rows, is_input) -> Buffer:
        if rows is None:
            if tensor is None:
                raise ConfigError(f"buffer {name!r} needs a tensor or a row count")
            rows = tensor.shape[0]
        buffer = Buffer(name, rows, tensor, is_input)
        self.buffers.append(buffer)
        return buffer

    def add(self, name: str, kind: str, fn: Callable[[], object] | None, *, reads: Sequence = (),
            writes: Sequence = (), after: Sequence[Task] = (), bytes: int = 0, flops: int = 0) -> Task:
        if kind not in KINDS:
            raise ConfigError(f"task {name!r} has kind {kind!r}; a task is one of {', '.join(KINDS)}")
        for earlier in after:
            if earlier.index >= len(self.tasks) or self.tasks[earlier.index] is not earlier:
                raise ConfigError(f"task {name!r} is to run after {earlier.name!r}, which is not in graph {self.name!r}")
        task = Task(len(self.tasks), name, kind, fn, _regions(reads), _regions(writes), tuple(after), int(bytes),
                    int(flops))
        self._infer(task)
        self.tasks.append(task)
        self._order = None
        return task

    def _infer(self, task: Task) -> None:
        for earlier in self.tasks:
            raw = any(r.overlaps(w) for r in task.reads for w in earlier.writes)
            war = any(w.overlaps(r) for w in task.writes for r in earlier.reads)
            waw = any(w.overlaps(v) for w in task.writes for v in earlier.writes)
            if raw or war or waw:
                task.deps.add(earlier.index)
        for read in task.reads:
            if not read.buffer.is_input:
                self._check_produced(task, read)
        task.deps.update(t.index for t in task.after)

    def precede(self, first: Task, then: Task) -> None:
        """An explicit edge: `then` starts only after `first` has finished."""
        for task in (first, then):
            if task.index >= len(self.tasks) or self.tasks[task.index] is not task:
                raise ConfigError(f"task {task.name!r} is not in graph {self.name!r}")
        then.deps.add(first.index)
        self._order = None

    def _check_produced(self, task: Task, read: Region) -> None:
        """Every row `task` reads of a produced buffer is written by some earlier task."""
        writes = [w for t in self.tasks for w in t.writes if w.buffer is read.buffer]
        if read.start == read.stop and read.buffer.tensor is None and not any(read.overlaps(w) for w in writes):
            raise ConfigError(f"task {task.name!r} reads {read}, but no task before it writes buffer "
                              f"{read.buffer.name!r}: add its producer before {task.name!r}, or declare "
                              f"{read.buffer.name!r} a graph input")
        spans = sorted((w.start, w.stop) for w in writes)
        covered, gap_end = read.start, read.stop
        for start, stop in spans:
            if start > covered:
                gap_end = min(start, read.stop)
                break
            covered = max(covered, stop)
        if covered < read.stop:
            raise ConfigError(f"task {task.name!r} reads {read}, but no task before it produces "
                              f"{read.buffer.name}[{covered}:{gap_end}]: add its producer before {task.name!r}, "
                              f"or declare {read.buffer.name!r} a graph input")

    def validate(self) -> list[int]:
        """A topological order of the tasks (program order where the edges allow: the order the
        executors issue communication in on every rank). Raises on a cycle, naming its tasks."""
        if self._order is not None:
            return self._order
        for task in self.tasks:
            if task.index in task.deps:
                raise ConfigError(f"graph {self.name!r} has a cycle: task {task.name!r} waits for itself")
        waiting = [len(t.deps) for t in self.tasks]
        users: list[list[int]] = [[] for _ in self.tasks]
        for task in self.tasks:
            for dep in task.deps:
                users[dep].append(task.index)
        ready = [t.index for t in self.tasks if not t.deps]
        heapq.heapify(ready)
        order = []
        while ready:
            index = heapq.heappop(ready)
            order.append(index)
            for user in users[index]:
                waiting[user] -= 1
                if not waiting[user]:
                    heapq.heappush(ready, user)
        if len(order) < len(self.tasks):
            cycle = self._find_cycle({i for i, n in enumerate(waiting) if n})
            raise ConfigError(f"graph {self.name!r} has a cycle: " + " -> ".join(repr(self.tasks[i].name)
                                                                               for i in cycle)
                              + " (an explicit edge points back to a task that waits for it)")
        self._order = order
        return order

    def _find_cycle(self, stuck: set[int]) -> list[int]:
        """A cycle among the tasks that never became ready, as a path that returns to its start."""
        path, on_path = [], {}
        index = min(stuck)
        while index not in on_path:
            on_path[index] = len(path)
            path.append(index)
            index = min(d for d in self.tasks[index].deps if d in stuck)
        cycle = path[on_path[index]:]
        cycle.reverse()  # deps point backwards in time: print in running order
        return cycle + [cycle[0]]

    def users(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.tasks]
        for task in self.tasks:
            for dep in task.deps:
                users[dep].append(task.index)
        return users

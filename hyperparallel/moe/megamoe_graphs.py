"""MegaMoE's forward and backward task graphs, built from one call's sizes: run, or planned.

A `Layout` holds the host-side sizes of one call (what each wave sends to and receives from each
rank). `WavePipeline` builds the two graphs from it (see hyperparallel.moe.megamoe for their
shape) with the tensors of a real call, or on the meta device from a uniform routing to predict
a layer's time with the simulator (`plan_graphs`, `default_waves`): the same builder serves both,
so the plan is the graph that runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import traffic
from hyperparallel.moe.dispatch import _inverse, _regroup_index, expert_ranges, split_evenly
from hyperparallel.moe.exchange import MXRows
from hyperparallel.multicore import CostModel, TaskGraph, simulate


def wave_ranges(num_local: int, waves: int) -> list[tuple[int, int]]:
    """(first local expert, count) of each of `waves` waves: contiguous, counts differing by at most
    one, the larger first; a rank with fewer experts than waves has empty ones."""
    return split_evenly(num_local, waves)


def interleaved(waves: int) -> list[tuple[str, int]]:
    """Program order of a wave pipeline: in 0, work 0, in 1, out 0, work 1, in 2, out 1, ... out K-1
    ('in': the exchange towards the experts, 'out': back). Comm is issued in this order on every rank."""
    order: list[tuple[str, int]] = [("in", 0), ("work", 0)]
    for w in range(1, waves):
        order += [("in", w), ("out", w - 1), ("work", w)]
    return order + [("out", waves - 1)]


@dataclass
class Layout:
    """Host-side sizes of one call."""

    waves: list[tuple[int, int]]  # this rank's local expert ranges, per wave
    send: list[list[int]]  # [wave][destination] rows this rank sends
    recv: list[list[int]]  # [wave][source] rows this rank receives
    per_source: list[list[int]]  # [source][local expert] rows received
    ep_rank: int

    def send_starts(self) -> list[int]:
        """Where each wave's rows start in the wave-major rows (and their total, last)."""
        starts = [0]
        for rows in self.send:
            starts.append(starts[-1] + sum(rows))
        return starts

    def expert_rows(self, w: int) -> list[int]:
        lo, count = self.waves[w]
        return [sum(source[e] for source in self.per_source) for e in range(lo, lo + count)]

    def link_rows(self, w: int) -> int:
        """Rows wave w's exchange moves over links: the larger of what leaves this rank and what arrives."""
        out = sum(n for r, n in enumerate(self.send[w]) if r != self.ep_rank)
        into = sum(n for r, n in enumerate(self.recv[w]) if r != self.ep_rank)
        return max(out, into)


class _Exchange:
    """One wave's all_to_all_single from a region to a buffer, issued asynchronously; `name` as
    moe.exchange names the exchanges for the traffic counter."""

    def __init__(self, group, source, target, send_splits, recv_splits, name: str):
        self.group, self.source, self.target = group, source, target
        self.send_splits, self.recv_splits, self.name = send_splits, recv_splits, name

    def __call__(self):
        sent = self.source.tensor.contiguous()
        traffic.all_to_all("ep", sent, self.send_splits, self.group, name=self.name)
        return dist.all_to_all_single(self.target.tensor, sent, self.recv_splits, self.send_splits, group=self.group,
                                      async_op=True)


@dataclass
class WavePipeline:
    """One call's graphs. `experts`: the GroupedExperts (or, for planning, anything with meta
    gate_up_proj / down_proj and intermediate_dim); `shared`: the shared experts' MLP or None."""

    layout: Layout
    num_waves: int
    group: dist.ProcessGroup
    experts: object
    shared: nn.Module | None
    grad_enabled: bool = True  # whether the call builds an autograd graph (else nothing is kept for backward)
    # the rows' MX format where the dispatch waves send MX data (moe.exchange's [Note: MX dispatch]); None: the
    # compute dtype
    wire: MXRows | None = None
    # filled by the forward graph's run, read by the backward graph's
    saved: list[list[torch.Tensor]] = field(default_factory=list)
    metas: list[object] = field(default_factory=list)
    received_mx: dict[int, object] = field(default_factory=dict)  # wave -> its MX rows, from regroup to experts
    shared_graph: dict = field(default_factory=dict)

    def _stages(self):
        if not hasattr(self, "_cached_stages"):  # one per call: MX stages keep the forward's weight copies
            self._cached_stages = self.experts.recipe.stages(self.experts, needs_grad=self.grad_enabled)
        return self._cached_stages

    def forward_graph(self, rows: torch.Tensor, shared_input: torch.Tensor | None) -> tuple[TaskGraph, dict]:
        """`rows`: wave-major, in the compute dtype, or packed MX rows (uint8) with `wire`."""
        lay, hidden, inter = self.layout, self.experts.gate_up_proj.shape[-1], self.experts.intermediate_dim
        graph = TaskGraph("megamoe forward")
        starts = lay.send_starts()
        rows_in = graph.input("rows", rows)
        dtype = self.wire.dtype if self.wire is not None else rows.dtype  # (the products' and the combine's)
        returned = graph.buffer("returned", rows.new_empty(rows.shape[0], hidden, dtype=dtype))
        sent_row_bytes = rows.shape[-1] * rows.element_size()  # (a row on its way to the experts)
        row_bytes = hidden * returned.tensor.element_size()
        waves = []
        outputs = {"returned": returned}
        self.saved, self.metas, self.received_mx = [], [None] * self.num_waves, {}
        per_source = torch.tensor(lay.per_source, device=rows.device, dtype=torch.long).view(len(lay.per_source), -1)
        for w, (lo, count) in enumerate(lay.waves):
            received = graph.buffer(f"received {w}", rows.new_empty(sum(lay.recv[w]), rows.shape[-1]))
            n = received.rows
            waves.append((received, graph.buffer(f"grouped {w}", rows=n), graph.buffer(f"products {w}", rows=n),
                          graph.buffer(f"done {w}", rows=n)))
            offsets = torch.tensor(lay.expert_rows(w), device=rows.device, dtype=torch.long).cumsum(0).to(torch.int32)
            self.saved.append([_regroup_index(per_source[:, lo:lo + count], n), offsets])

        def run_experts(w: int) -> None:
            lo, count = lay.waves[w]
            y, (tensors, meta) = self._stages().forward(waves[w][1].tensor, self.saved[w][1], lo, lo + count,
                                                        quantized=self.received_mx.pop(w, None))
            waves[w][2].set(y)
            self.saved[w] += tensors
            self.metas[w] = meta
            graph.hold(*tensors)  # they outlive the run (saved for backward)

        for step, w in interleaved(self.num_waves):
            received, grouped, products, done = waves[w]
            n, source, region = received.rows, rows_in[starts[w]:starts[w + 1]], returned[starts[w]:starts[w + 1]]
            link = lay.link_rows(w) * row_bytes
            if step == "in":
                graph.add(f"dispatch {w}", "comm", _Exchange(self.group, source, received, lay.send[w], lay.recv[w],
                                                             "dispatch"),
                          reads=[source], writes=[received], bytes=lay.link_rows(w) * sent_row_bytes)
                if w == 0 and self.shared is not None:
                    outputs["shared"] = self._add_shared_forward(graph, shared_input)
            elif step == "out":
                graph.add(f"combine {w}", "comm", _Exchange(self.group, done, region, lay.recv[w], lay.send[w],
                                                            "combine"),
                          reads=[done], writes=[region], bytes=link)
            else:
                regroup = (_select(received, grouped, self, w, inverse=False) if self.wire is None
                           else _unpack(received, grouped, self, w, hidden))
                graph.add(f"regroup {w}", "vector", regroup, reads=[received], writes=[grouped],
                          bytes=n * (sent_row_bytes + row_bytes))
                if lay.waves[w][1]:
                    graph.add(f"experts {w}", "matmul", lambda w=w: run_experts(w), reads=[grouped],
                              writes=[products], flops=6 * n * hidden * inter)
                else:  # no expert of this rank in the wave: no rows arrive
                    graph.add(f"experts {w}", "vector", lambda p=products, g=grouped: p.set(g.tensor),
                              reads=[grouped], writes=[products])
                graph.add(f"unregroup {w}", "vector", _select(products, done, self, w, inverse=True),
                          reads=[products], writes=[done], bytes=2 * n * row_bytes)
        return graph, outputs

    def _add_shared_forward(self, graph: TaskGraph, shared_input: torch.Tensor):
        """The shared experts as one matmul task, right after the first dispatch: the compute lane
        has nothing else until that dispatch arrives (on CUDA the matmul stream runs it first)."""
        shared_in = graph.input("shared input", shared_input)
        shared_out = graph.buffer("shared output", rows=shared_input.shape[0])
        graph.add("shared experts", "matmul", lambda: self._shared_forward(shared_in.tensor, shared_out),
                  reads=[shared_in], writes=[shared_out], flops=mlp_flops(self.shared, shared_input.shape[0]))
        return shared_out

    def _shared_forward(self, shared_input: torch.Tensor, out) -> None:
        # its own autograd graph, from a detached input, that backward's task differentiates; its
        # activations stay with this call until then (recompute does not drop them)
        with torch.set_grad_enabled(self.grad_enabled):
            x = shared_input.detach().requires_grad_(shared_input.requires_grad and self.grad_enabled)
            y = self.shared(x)
        if self.grad_enabled:
            self.shared_graph = {"input": x, "output": y}
        out.set(y.detach())

    def backward_graph(self, d_returned: torch.Tensor, d_shared: torch.Tensor | None) -> tuple[TaskGraph, dict]:
        lay, hidden, inter = self.layout, d_returned.shape[-1], self.experts.intermediate_dim
        graph = TaskGraph("megamoe backward")
        starts = lay.send_starts()
        d_in = graph.input("d returned", d_returned)
        d_rows = graph.buffer("d rows", torch.empty_like(d_returned))
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        d_gate_up = graph.buffer("d gate_up_proj", torch.zeros_like(gate_up))
        d_down = graph.buffer("d down_proj", torch.zeros_like(down))
        row_bytes = hidden * d_returned.element_size()
        waves, for_wgrad = [], {}
        outputs = {"rows": d_rows, "gate_up_proj": d_gate_up, "down_proj": d_down, "shared": []}
        for w in range(self.num_waves):
            n = sum(lay.recv[w])
            waves.append((graph.buffer(f"d done {w}", d_returned.new_empty(n, hidden)),
                          graph.buffer(f"d products {w}", rows=n), graph.buffer(f"d grouped {w}", rows=n),
                          graph.buffer(f"d received {w}", rows=n)))

        def dgrad(w: int) -> None:
            lo, count = lay.waves[w]
            _, offsets, *tensors = self.saved[w]
            dx, for_wgrad[w] = self._stages().input_grad((tensors, self.metas[w]), waves[w][1].tensor, offsets,
                                                         lo, lo + count)
            waves[w][2].set(dx)
            graph.hold(*(t for t in for_wgrad[w] if isinstance(t, torch.Tensor)))

        def wgrad(w: int) -> None:
            lo, count = lay.waves[w]
            d_w1, d_w2 = self._stages().weight_grad(for_wgrad.pop(w), self.saved[w][1])
            d_gate_up.tensor[lo:lo + count] = d_w1
            d_down.tensor[lo:lo + count] = d_w2

        def add_wgrad(w: int) -> None:
            """Wave w's weight gradients: one wave behind its input gradients in program order, so
            that they fill the time the next wave's exchanges take (and, on CUDA, where a stream runs
            its tasks in order, they do not wait for the last wave)."""
            lo, count = lay.waves[w]
            if count:
                graph.add(f"wgrad {w}", "matmul", lambda: wgrad(w), reads=[waves[w][2]],
                          writes=[d_gate_up[lo:lo + count], d_down[lo:lo + count]],
                          flops=6 * sum(lay.expert_rows(w)) * hidden * inter)

        for step, w in interleaved(self.num_waves):
            d_done, d_products, d_grouped, d_received = waves[w]
            n, region_in, region_out = d_done.rows, d_in[starts[w]:starts[w + 1]], d_rows[starts[w]:starts[w + 1]]
            link = lay.link_rows(w) * row_bytes
            if step == "in":  # the combine's reverse: the returned rows' gradients go to the experts
                graph.add(f"combine grad {w}", "comm", _Exchange(self.group, region_in, d_done, lay.send[w],
                                                                 lay.recv[w], "combine grad"),
                          reads=[region_in], writes=[d_done], bytes=link)
                if w == 0 and self.shared is not None and d_shared is not None:
                    outputs["shared input"] = self._add_shared_backward(graph, d_shared, outputs["shared"])
            elif step == "out":  # the dispatch's reverse: input gradients back to the tokens' ranks
                graph.add(f"dispatch grad {w}", "comm", _Exchange(self.group, d_received, region_out, lay.recv[w],
                                                                  lay.send[w], "dispatch grad"),
                          reads=[d_received], writes=[region_out], bytes=link)
            else:
                graph.add(f"regroup grad {w}", "vector", _select(d_done, d_products, self, w, inverse=False),
                          reads=[d_done], writes=[d_products], bytes=2 * n * row_bytes)
                if lay.waves[w][1]:
                    graph.add(f"dgrad {w}", "matmul", lambda w=w: dgrad(w), reads=[d_products], writes=[d_grouped],
                              flops=6 * n * hidden * inter)
                else:
                    graph.add(f"dgrad {w}", "vector", lambda g=d_grouped, p=d_products: g.set(p.tensor),
                              reads=[d_products], writes=[d_grouped])
                graph.add(f"unregroup grad {w}", "vector", _select(d_grouped, d_received, self, w, inverse=True),
                          reads=[d_grouped], writes=[d_received], bytes=2 * n * row_bytes)
                if w:  # the previous wave's weight gradients, behind this wave's input gradients
                    add_wgrad(w - 1)
        add_wgrad(self.num_waves - 1)
        return graph, outputs

    def _add_shared_backward(self, graph: TaskGraph, d_shared: torch.Tensor, param_grads: list):
        """The shared experts' backward as one matmul task, right after the first exchange."""
        d_shared_out = graph.input("d shared output", d_shared)
        d_shared_in = graph.buffer("d shared input", rows=d_shared.shape[0])
        graph.add("shared experts grad", "matmul",
                  lambda: self._shared_backward(d_shared_out.tensor, d_shared_in, param_grads),
                  reads=[d_shared_out], writes=[d_shared_in], flops=2 * mlp_flops(self.shared, d_shared.shape[0]))
        return d_shared_in

    def _shared_backward(self, d_out: torch.Tensor, d_input, param_grads: list) -> None:
        x, y = self.shared_graph["input"], self.shared_graph["output"]
        params = [p for p in self.shared.parameters() if p.requires_grad]
        inputs = ([x] if x.requires_grad else []) + params
        grads = list(torch.autograd.grad(y, inputs, d_out, allow_unused=True))
        d_input.set(grads.pop(0) if x.requires_grad else torch.zeros_like(x))
        param_grads.extend(grads)


def _select(source, target, pipeline: WavePipeline, w: int, inverse: bool):
    """A task setting `target` to `source`'s rows regrouped by wave w's index (or its inverse)."""
    def regroup() -> None:
        index = pipeline.saved[w][0]
        target.set(source.tensor.index_select(0, _inverse(index) if inverse else index))
    return regroup


def _unpack(source, target, pipeline: WavePipeline, w: int, hidden: int):
    """A task setting `target` to the values of wave w's received MX rows, regrouped, and keeping
    the MX rows for the wave's experts (an MX dispatch)."""
    def unpack() -> None:
        values, pipeline.received_mx[w] = pipeline.wire.unpacked(source.tensor, pipeline.saved[w][0], hidden)
        target.set(values)
    return unpack


def mlp_flops(module: nn.Module, tokens: int) -> int:
    """2 FLOPs per weight per token: the matrix products of an MLP."""
    return 2 * tokens * sum(p.numel() for p in module.parameters() if p.dim() >= 2)


# -- planning --------------------------------------------------------------------------------------

def uniform_layout(tokens: int, top_k: int, num_experts: int, ep: int, waves: int, rank: int = 0) -> Layout:
    """The layout of a perfectly balanced routing: every rank sends tokens * top_k rows, spread
    evenly over the experts."""
    ranges = expert_ranges(num_experts, ep)
    pairs = tokens * top_k
    per_expert = [pairs // num_experts + (e < pairs % num_experts) for e in range(num_experts)]
    wave_of = [wave_ranges(count, waves) for _, count in ranges]
    send = [[sum(per_expert[offset + lo:offset + lo + count]) for (offset, _), (lo, count)
             in zip(ranges, (wr[w] for wr in wave_of), strict=True)] for w in range(waves)]
    offset, count = ranges[rank]
    per_source = [per_expert[offset:offset + count] for _ in range(ep)]
    recv = [[sum(per_expert[offset + lo:offset + lo + c]) for _ in range(ep)] for lo, c in wave_of[rank]]
    return Layout(wave_of[rank], send, recv, per_source, rank)


@dataclass(frozen=True)
class MoEShape:
    """What predicting a MoE layer's time needs: tokens per rank and the layer's sizes."""

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    shared_intermediate: int = 0  # 0: no shared experts
    element_bytes: int = 4


def plan_graphs(shape: MoEShape, ep: int, waves: int) -> tuple[TaskGraph, TaskGraph]:
    """The forward and backward graphs of rank 0 of an `ep`-rank layer under uniform routing, on the
    meta device (tasks carry their bytes and FLOPs; nothing runs)."""
    layout = uniform_layout(shape.tokens, shape.top_k, shape.experts, ep, waves)
    local = expert_ranges(shape.experts, ep)[0][1]
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[shape.element_bytes]
    meta = {"device": "meta", "dtype": dtype}
    experts = _PlannedExperts(torch.empty(local, 2 * shape.intermediate, shape.hidden, **meta),
                              torch.empty(local, shape.hidden, shape.intermediate, **meta), shape.intermediate)
    shared = None
    if shape.shared_intermediate:
        with torch.device("meta"):
            shared = nn.Sequential(nn.Linear(shape.hidden, 2 * shape.shared_intermediate, bias=False),
                                   nn.Linear(shape.shared_intermediate, shape.hidden, bias=False))
    pipeline = WavePipeline(layout, waves, None, experts, shared)
    rows = torch.empty(layout.send_starts()[-1], shape.hidden, **meta)
    tokens = torch.empty(shape.tokens, shape.hidden, **meta)
    forward, _ = pipeline.forward_graph(rows, tokens if shared is not None else None)
    backward, _ = pipeline.backward_graph(rows, tokens if shared is not None else None)
    return forward, backward


@dataclass
class _PlannedExperts:
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    intermediate_dim: int


def default_waves(shape: MoEShape, ep: int, cost: CostModel, **simulation) -> int:
    """The wave count `cost` predicts fastest (forward plus backward) under uniform routing, ties
    to the fewer waves; every rank computes the same from the same config. `simulation`: how the
    executor runs (`multicore.EXECUTORS[device type]`: lanes, in_order)."""
    local = max(count for _, count in expert_ranges(shape.experts, ep))
    best, best_time = 1, None
    for waves in range(1, local + 1):
        forward, backward = plan_graphs(shape, ep, waves)
        time = simulate(forward, cost, **simulation).overlapped_s + simulate(backward, cost, **simulation).overlapped_s
        if best_time is None or time < best_time * 0.99:
            best, best_time = waves, time
    return best

"""The step-time half of `hyperparallel plan`: one rank's time per optimizer step, predicted from
what the memory plan already has (every operator of one micro-batch's forward and backward, with
its FLOPs and bytes; every collective of the step, with its group and bytes) and a device model
(`device_model.py`). Nothing runs; nothing is launched.

[Note: how a step's time is predicted]
- compute: each operator of the recorded micro-batch takes the longer of its FLOPs at the
  device's matmul rate for its operand dtype (attention's fused kernels: their own rate; on the
  CPU times the fraction a product of its size reaches, measured: `DeviceModel.efficiency`) and
  its bytes (inputs read, outputs written) at the memory bandwidth, and at least the device's op
  floor (a GPU's kernel); on the CPU, whose ranks dispatch every operator themselves, the floor
  is added instead, and so are the host's time per view and per module call (measured; a GPU's
  host runs ahead of its kernels). Recompute's replays are in the recording. With context
  parallelism the recorded attention is a rank's own chunk against its own chunk; ring and
  Ulysses attention do cp times that work, so attention operators count cp times.
- compiled layers (`training.compile` inductor or dvm: every decoder layer, forward and
  backward, and the fused loss's chunks; timeline.py records which operator runs in which
  graph): consecutive fusible operators of one graph (ATen's element-wise and reduction
  operators, casts, copies, constants: `fusible`) are one kernel, one memory pass: what they read
  that none of them wrote, and what they write that anything after them reads (or nothing reads:
  a gradient, a mutated buffer), once each, and one op floor. Products, attention, the custom
  operators (grouped products, the MoE permutation, MegaGate) and collectives stay as they are.
- FSDP under bf16 mixed precision gathers the products' weights in bf16 (parallel/
  mixed_precision.py): autocast's casts of them and their gradients' casts back, which the
  recording of the float32 model has, do not run (`OpCosts.without_casts_of`; their copies are
  not held either: `Timeline.without_casts_of`).
- communication, by collective, ring algorithms: all-gather and reduce-scatter (W-1) steps of a
  slot, all-reduce 2 (W-1) steps of bytes / W, all-to-all (W-1) steps of bytes / W; each step pays
  the link's latency, the bytes its bandwidth. A group whose ranks span machines (the mesh's
  order: dp_replicate, dp_shard, cp, tp, tp innermost) uses the inter-node link. On the CPU a
  call takes what one of its group size and bytes took after a chunk of compute, measured among as
  many processes as the run has ranks, on the same cores, every group calling at once
  (`cpu_gloo.py`), plus what more compute before it adds (the step's compute spread evenly over
  its calls, times the measured seconds a call adds per second of compute beyond the chunk).
- what is exposed: tensor parallelism's, context parallelism's and the sequential expert
  dispatch's collectives sit on the critical path. FSDP's all-gathers (prefetched) and
  reduce-scatters, HSDP's and DDP's all-reduces run beside the step's compute on a GPU: exposed is
  the first layer's gather and the last reduce, or what exceeds the compute (not hidden behind the
  critical path's collectives, which use the same links). MegaMoE's layers are
  simulated as task graphs (`multicore.simulate`, the trainer's own wave graphs) with this
  device's costs, and only their exposed communication counts. On the CPU nothing overlaps (gloo
  works on the ranks' own cores).
- optimizer: AdamW reads parameters, gradients and both moments and writes three of them back
  (memory-bound); Muon adds Newton-Schulz's products on the matrices this rank owns; clipping
  reads the gradients once.

Left out: the operators of the parallel wrappers, which the recording of one rank's model does
not run (FSDP's flat-buffer copies and hooks, TP's and CP's autograd functions, the expert
dispatcher's permutations and count exchange: on the CPU a fifth to a half of a rank's host
time at the example configs' sizes), the wait for the slowest rank at each collective (on the
CPU measured with the calls, as above), stragglers and network contention, the data loader, and compiled graphs' common-subexpression
elimination and smaller saved set (an operator read twice is cast twice here).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hyperparallel.train.planning.device_model import DeviceModel

aten = torch.ops.aten

COLLECTIVE_STEPS = {"all_gather": lambda w: w - 1, "reduce_scatter": lambda w: w - 1,
                    "all_reduce": lambda w: 2 * (w - 1), "all_to_all": lambda w: w - 1, "send": lambda w: 1}


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step: `calls` of them per optimizer step, each over `ranks` ranks
    of mesh dimension `dimension`, of `nbytes` (all-gather / reduce-scatter: one rank's slot;
    all-reduce: the tensor; all-to-all: all the rows this rank sends and keeps; send: what one
    rank sends the next, `ranks` 2)."""

    name: str
    dimension: str  # dp_shard (FSDP's group, or DDP's ranks) | dp_replicate | tp | cp | ep | pp
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send
    ranks: int
    nbytes: int
    calls: int
    spans_nodes: bool = False
    # critical: on the step's critical path (TP, CP, the sequential expert dispatch, Muon's exchange);
    # beside: runs beside compute on a GPU (FSDP, HSDP, DDP); simulated: MegaMoE's, whose exposed
    # part comes from its layer's task graphs
    exposure: str = "critical"

    def sent_per_call(self) -> int:
        w = self.ranks
        if w <= 1:
            return 0
        if self.kind in ("all_gather", "reduce_scatter"):
            return (w - 1) * self.nbytes
        if self.kind == "all_reduce":
            return 2 * (w - 1) * self.nbytes // w
        if self.kind == "send":
            return self.nbytes
        return (w - 1) * self.nbytes // w

    def sent(self) -> int:
        return self.calls * self.sent_per_call()

    def seconds(self, device: DeviceModel, compute_s: float = 0.0) -> float:
        """Its calls' time in a step (`compute_s`: the step's compute before each call, on average:
        on the CPU, where the ranks share the cores, a call waits longer the more its peers had to
        compute first)."""
        if self.ranks <= 1:
            return 0.0
        if device.collective_calls:  # (the CPU: a call as measured among the run's ranks on their cores)
            return self.calls * device.call(self.ranks, self.sent_per_call(), compute_s)
        bandwidth, latency = device.link(self.spans_nodes)
        return self.calls * (COLLECTIVE_STEPS[self.kind](self.ranks) * latency + self.sent_per_call() / bandwidth)


def spans_nodes(stride: int, size: int, ranks_per_node: int) -> bool:
    """Whether a mesh group of `size` ranks `stride` apart leaves one machine."""
    return size > 1 and stride * size > ranks_per_node


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """QK^T and PV of [batch, heads, queries, dim] attention, forward."""
    *lead, queries, dim = q.shape
    keys, v_dim = k.shape[-2], v.shape[-1]
    flops = 2 * math.prod(lead) * queries * keys * (dim + v_dim)
    return flops // 2 if causal else flops


# operators that launch no kernel: metadata, aliases (_unsafe_view: a view its schema does not call
# one), and allocations that write nothing
_NO_KERNEL = {torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten.empty, torch.ops.aten.empty_like,
              torch.ops.aten.empty_strided, torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense,
              torch.ops.aten._unsafe_view}


# in-place products, which torch's FLOP registry leaves out (the fused loss accumulates its head's
# gradient with addmm_), counted as their out-of-place twins
_OUT_OF_PLACE = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}


def op_cost(func, args, kwargs, out) -> tuple[int, int, str, bool, int] | None:
    """(FLOPs, bytes read and written, the operands' dtype, whether attention, its size for the
    device's efficiency ladder: a product's smallest dimension (a grouped product's rows per
    group), one attention head's FLOPs; 0 for the rest) of one operator as recorded, or None for one
    that makes no new data (a view, an alias)."""
    if getattr(func, "is_view", False) or func.overloadpacket in _NO_KERNEL:
        return None
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    if func._schema.is_mutable:  # in place (add_, copy_, ...): it writes what it reads
        outputs = []
    elif not outputs:  # metadata (a device, a size): no kernel
        return None
    nbytes = sum(t.numel() * t.element_size() for t in (*inputs, *outputs))
    dtype = str(inputs[0].dtype).replace("torch.", "") if inputs else "float32"
    packet, name = func.overloadpacket, str(func)
    packet = _OUT_OF_PLACE.get(packet, packet)  # (an in-place product counts as its out-of-place twin)
    if packet in flop_registry:
        flops = flop_registry[packet](*args, **(kwargs or {}), out_val=out)
        attention = "attention" in name
        if attention:
            size = flops // max(math.prod(inputs[0].shape[:-2]), 1)
        else:  # (mm, addmm, bmm: the operands' matrix dimensions)
            size = min(d for t in inputs if t.dim() >= 2 for d in t.shape[-2:]) if flops else 0
        return flops, nbytes, dtype, attention, size
    if "grouped_mm" in name and len(inputs) >= 2:  # a [M, K] by b [E, K, N] (or the weight grad's [M, K]^T [M, N])
        a, b = inputs[0], inputs[1]
        n = b.shape[-1] if b.dim() == 3 else b.shape[-1]
        groups = b.shape[0] if b.dim() == 3 else (inputs[2].numel() if len(inputs) > 2 else 1)
        size = min(a.shape[0] // max(groups, 1), a.shape[1], n)
        return 2 * a.shape[0] * a.shape[1] * n, nbytes, dtype, False, size
    if "scaled_dot_product" in name and len(inputs) >= 3:  # the CPU's flash attention, forward or backward
        backward = "backward" in name
        q, k, v = inputs[1:4] if backward else inputs[:3]
        causal = bool((kwargs or {}).get("is_causal", False) or any(a is True for a in args))
        flops = _attention_flops(q, k, v, causal)
        flops = flops * 5 // 2 if backward else flops
        return flops, nbytes, dtype, True, flops // max(math.prod(q.shape[:-2]), 1)
    return 0, nbytes, dtype, False, 1


# memory-bound operators a compiled graph generates its own code for, beyond those torch tags
# pointwise or reduction: casts and copies, constants, softmax, concatenation and padding
_FUSIBLE = {aten._to_copy, aten.copy_, aten.where, aten.masked_fill, aten.zeros, aten.zeros_like, aten.ones,
            aten.ones_like, aten.full, aten.full_like, aten.new_zeros, aten.fill_, aten.zero_, aten.scalar_tensor,
            aten._softmax, aten._safe_softmax, aten._softmax_backward_data, aten._log_softmax,
            aten._log_softmax_backward_data,
            aten.cat, aten.constant_pad_nd, aten.slice_backward}


def fusible(func) -> bool:
    """Whether a compiled graph (Inductor, DVM) fuses this operator with its neighbours: an
    element-wise or reduction operator of ATen, not a product, attention, a custom operator
    (grouped products, the MoE permutation, MegaGate: opaque to the compiler) or a collective."""
    if func.namespace != "aten":
        return False
    tags = func.tags
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags or func.overloadpacket in _FUSIBLE


@dataclass
class OpCosts:
    """Every operator of a recorded micro-batch: (FLOPs, bytes, operand dtype, is attention, its
    size: `op_cost`); for
    the compiled step, each one's reads and writes ((storage id, bytes) pairs; writes only of a
    fusible operator) and compiled graph (-1: eager, or not fusible); and the operators recorded
    that launch no kernel (views, aliases: Python's and the dispatcher's time only)."""

    ops: list[tuple[int, int, str, bool, int]] = field(default_factory=list)
    reads: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    writes: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    graphs: list[int] = field(default_factory=list)
    no_kernel: int = 0
    modules: int = 0  # module calls (the forward's and recompute's replays)
    # casts (_to_copy): operator -> (storage read, storage written); then, resolved, the casts of a
    # parameter or of its gradient: operator -> the parameter's index
    casts: dict[int, tuple[int, int]] = field(default_factory=dict)
    param_casts: dict[int, int] = field(default_factory=dict)
    # the storages those casts make a parameter's way (storage -> the parameter's index): a weight
    # cast's copy, and the gradient a cast back reads (timeline.Timeline.without_casts_of)
    cast_storages: dict[int, int] = field(default_factory=dict)

    def weights_cast(self, stored: dict[int, int], grad_serial: dict[int, int]) -> None:
        """Which casts are autocast's of a parameter (`stored`: its storage's id -> its index) or
        of its gradient back to the parameter's dtype (`grad_serial`: the storage that became the
        parameter's .grad -> its index)."""
        for op, (read, written) in self.casts.items():
            j = stored.get(read, grad_serial.get(written))
            if j is not None:
                self.param_casts[op] = j
                self.cast_storages[written if read in stored else read] = j
        self.casts = {}

    def without_casts_of(self, params: set[int]) -> OpCosts:
        """These operators less the casts of `params` and of their gradients: what a run computes
        when FSDP gathers those parameters in the products' dtype (bf16 under bf16 mixed
        precision: autocast then has nothing to cast, and the gradient stays in it up to the
        reduce-scatter)."""
        dropped = {op for op, j in self.param_casts.items() if j in params}
        if not dropped:
            return self
        keep = [i for i in range(len(self.ops)) if i not in dropped]
        return OpCosts([self.ops[i] for i in keep], [self.reads[i] for i in keep], [self.writes[i] for i in keep],
                       [self.graphs[i] for i in keep], self.no_kernel, self.modules)

    def add(self, flops: int, nbytes: int, dtype: str, attention: bool, size: int = 0, reads: tuple = (),
            writes: tuple = (), graph: int = -1) -> None:
        self.ops.append((flops, nbytes, dtype, attention, size))
        self.reads.append(reads)
        self.writes.append(writes)
        self.graphs.append(graph)

    def fused(self) -> OpCosts:
        """These operators as a compiled step runs them ([Note: how a step's time is predicted])."""
        last_read: dict[int, int] = {}
        for i, reads in enumerate(self.reads):
            for storage, _ in reads:
                last_read[storage] = i
        out = OpCosts(no_kernel=self.no_kernel, modules=self.modules)
        i, n = 0, len(self.ops)
        while i < n:
            j = i + 1
            if self.graphs[i] >= 0:
                while j < n and self.graphs[j] == self.graphs[i]:
                    j += 1
            if j - i == 1:  # (a chain of one: the operator as it is)
                out.add(*self.ops[i], self.reads[i], self.writes[i], self.graphs[i])
            else:
                out.add(0, self._chain_bytes(i, j, last_read), self.ops[i][2], False, graph=self.graphs[i])
            i = j
        return out

    def _chain_bytes(self, first: int, end: int, last_read: dict[int, int]) -> int:
        """One memory pass of operators first..end-1: what they read that none of them wrote, once,
        and what they write that an operator after them reads or that none reads (a gradient, a
        mutated buffer), once."""
        written: dict[int, tuple[int, int]] = {}  # storage -> (bytes, the last operator writing it)
        read: dict[int, int] = {}
        for i in range(first, end):
            for storage, nbytes in self.reads[i]:
                if storage not in written:
                    read[storage] = max(read.get(storage, 0), nbytes)
            for storage, nbytes in self.writes[i]:
                written[storage] = (max(written.get(storage, (0, 0))[0], nbytes), i)
        kept = sum(nbytes for storage, (nbytes, at) in written.items()
                   if not at < last_read.get(storage, -1) < end)
        return sum(read.values()) + kept

    def seconds(self, device: DeviceModel, attention_factor: float = 1.0, mx: bool = False) -> float:
        """The operators' time one after another (`attention_factor`: context parallelism's work
        per recorded attention operator; `mx`: products at the device's MX rate)."""
        total = 0.0
        memory = device.memory_bytes_per_s
        for flops, nbytes, dtype, attention, size in self.ops:
            if attention:
                rate = device.matmul_flops["attention"]
            elif mx:
                rate = device.matmul_flops["mx"]
            else:
                rate = device.flops_for(dtype)
            if flops:  # (a small product reaches less of the rate: the CPU's measured ladders)
                rate *= device.efficiency(size, attention)
            roofline = max(flops / rate if flops else 0.0, nbytes / memory)
            if attention:
                roofline *= attention_factor
            total += max(roofline, device.op_floor_s) if device.overlap else roofline + device.op_floor_s
        return total + self.no_kernel * device.dispatch_s + self.modules * device.module_s

    @property
    def flops(self) -> int:
        return sum(op[0] for op in self.ops)


@dataclass(frozen=True)
class StepTime:
    device: str
    predicted_step_s: float
    compute_s: float  # every micro-batch's forward and backward (recompute included)
    exposed_comm_s: dict[str, float]  # by mesh dimension
    optimizer_s: float  # clipping and the optimizer step
    comm_s: dict[str, float]  # every collective's own time, by mesh dimension (before overlap)
    tokens_per_s: float
    mfu: float  # model FLOPs (models.flops: 6 x active parameters + attention) per second over the ranks' peak BF16
    device_source: str = ""
    bubble_s: float = 0.0  # pipeline parallelism: the time stages wait in the schedule's fill and drain

    def to_json(self) -> dict:
        return asdict(self)


def gathered_in_bf16(model, bf16_gathers: bool) -> frozenset[int]:
    """The parameters (by index in `model.parameters()`) that FSDP gathers in bf16 when it gathers
    under bf16 mixed precision (`bf16_gathers`): the products', every one not tagged to keep its
    dtype (parallel/mixed_precision.py)."""
    from hyperparallel.fsdp.param import keeps_dtype

    if not bf16_gathers:
        return frozenset()
    return frozenset(j for j, q in enumerate(model.parameters()) if not keeps_dtype(q) and q.dtype != torch.bfloat16)


def predict(*, device: DeviceModel, ops: OpCosts, accumulation: int, collectives: list[Collective],
            optimizer_bytes_moved: int, optimizer_flops: float, optimizer_ops: int, attention_factor: float,
            mx: bool, moe_exposed_s: float, tokens_per_step: int, model_flops_per_token: float,
            world: int, compiled: bool = False) -> StepTime:
    """A step's time from its parts (the module's note says how). `compiled`: the decoder layers
    and the loss's chunks compiled (`training.compile` inductor or dvm). (`ops` as the step runs
    them: under bf16 gathers without the casts of the weights gathered in bf16, the planner's
    `Timeline.without_casts_of`.)"""
    micro = (ops.fused() if compiled else ops).seconds(device, attention_factor, mx)
    compute = accumulation * micro
    # (the compute before each call, on average: the step's spread over its calls)
    between = compute / max(sum(c.calls for c in collectives if c.ranks > 1), 1)
    comm: dict[str, float] = {}
    critical: dict[str, float] = {}
    beside: dict[str, list[Collective]] = {}
    for c in collectives:
        seconds = c.seconds(device, between)
        comm[c.dimension] = comm.get(c.dimension, 0.0) + seconds
        if c.exposure == "simulated" and device.overlap:
            continue  # (moe_exposed_s)
        if c.exposure == "beside" and device.overlap:
            beside.setdefault(c.dimension, []).append(c)
        else:
            critical[c.dimension] = critical.get(c.dimension, 0.0) + seconds
    exposed = dict(critical)
    if moe_exposed_s and device.overlap:
        exposed["ep"] = exposed.get("ep", 0.0) + accumulation * moe_exposed_s
    # the collectives that run beside compute: the first gather and the last reduce always wait,
    # and what exceeds the compute they hide behind
    overlapping = [c for group in beside.values() for c in group]
    if overlapping:
        total = sum(c.seconds(device) for c in overlapping)
        first = max((c.seconds(device) / c.calls for c in overlapping if c.kind == "all_gather"), default=0.0)
        last = sum(max((c.seconds(device) / c.calls for c in overlapping if c.kind == kind), default=0.0)
                   for kind in ("reduce_scatter", "all_reduce"))
        edges = first + last
        # (behind the compute only: the critical path's collectives use the same links)
        waiting = max(min(edges, total), total - compute)
        for dim, group in beside.items():  # shared out in proportion to each dimension's time
            share = sum(c.seconds(device) for c in group) / total if total else 0.0
            exposed[dim] = exposed.get(dim, 0.0) + waiting * share
    optimizer = (optimizer_bytes_moved / device.memory_bytes_per_s + optimizer_flops / device.flops_for("bfloat16")
                 + optimizer_ops * device.op_floor_s)
    step = compute + sum(exposed.values()) + optimizer
    tokens_per_s = tokens_per_step / step if step else math.inf
    mfu = model_flops_per_token * tokens_per_s / (world * device.peak_bf16_flops)
    return StepTime(device.name, step, compute, exposed, optimizer, comm, tokens_per_s, mfu, device.source)

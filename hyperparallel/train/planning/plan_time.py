"""The step-time half of `hyperparallel plan`: one rank's time per optimizer step, predicted from
what the memory plan already has (every operator of one micro-batch's forward and backward, with
its FLOPs and bytes; every collective of the step, with its group and bytes) and a device model
(`device_model.py`). Nothing runs; nothing is launched.

[Note: how a step's time is predicted]
- compute: each operator of the recorded micro-batch takes the longer of its FLOPs at the
  device's matmul rate for its operand dtype (attention's fused kernels: their own rate) and its
  bytes (inputs read, outputs written) at the memory bandwidth, and at least the device's op
  floor (a GPU's kernel); on the CPU, whose ranks dispatch every operator themselves, the floor
  is added instead. Recompute's replays are in the recording. With context parallelism the
  recorded attention is a rank's own chunk against its own chunk; ring and Ulysses attention do
  cp times that work, so attention operators count cp times.
- communication, by collective, ring algorithms: all-gather and reduce-scatter (W-1) steps of a
  slot, all-reduce 2 (W-1) steps of bytes / W, all-to-all (W-1) steps of bytes / W; each step pays
  the link's latency, the bytes its bandwidth. A group whose ranks span machines (the mesh's
  order: dp_replicate, dp_shard, cp, tp, tp innermost) uses the inter-node link.
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

Left out: Python's own time per module (HF's forward code, hooks) beyond the per-operator floor,
stragglers and network contention, the data loader, and torch.compile's fusion (a compiled layer
does fewer, larger operators: the plan is eager's).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hyperparallel.train.planning.device_model import DeviceModel

COLLECTIVE_STEPS = {"all_gather": lambda w: w - 1, "reduce_scatter": lambda w: w - 1,
                    "all_reduce": lambda w: 2 * (w - 1), "all_to_all": lambda w: w - 1}


@dataclass(frozen=True)
class Collective:
    """One kind of collective of a step: `calls` of them per optimizer step, each over `ranks` ranks
    of mesh dimension `dimension`, of `nbytes` (all-gather / reduce-scatter: one rank's slot;
    all-reduce: the tensor; all-to-all: all the rows this rank sends and keeps)."""

    name: str
    dimension: str  # dp_shard (FSDP's group, or DDP's ranks) | dp_replicate | tp | cp | ep
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
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
        return (w - 1) * self.nbytes // w

    def sent(self) -> int:
        return self.calls * self.sent_per_call()

    def seconds(self, device: DeviceModel) -> float:
        if self.ranks <= 1:
            return 0.0
        bandwidth, latency = device.link(self.spans_nodes)
        per_call = COLLECTIVE_STEPS[self.kind](self.ranks) * latency + self.sent_per_call() / bandwidth
        return self.calls * per_call


def spans_nodes(stride: int, size: int, ranks_per_node: int) -> bool:
    """Whether a mesh group of `size` ranks `stride` apart leaves one machine."""
    return size > 1 and stride * size > ranks_per_node


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> int:
    """QK^T and PV of [batch, heads, queries, dim] attention, forward."""
    *lead, queries, dim = q.shape
    keys, v_dim = k.shape[-2], v.shape[-1]
    flops = 2 * math.prod(lead) * queries * keys * (dim + v_dim)
    return flops // 2 if causal else flops


# operators that launch no kernel: metadata, aliases, and allocations that write nothing
_NO_KERNEL = {torch.ops.aten.detach, torch.ops.aten.alias, torch.ops.aten.empty, torch.ops.aten.empty_like,
              torch.ops.aten.empty_strided, torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense}


def op_cost(func, args, kwargs, out) -> tuple[int, int, str, bool] | None:
    """(FLOPs, bytes read and written, the operands' dtype, whether attention) of one operator as
    recorded, or None for one that makes no new data (a view, an alias)."""
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
    if packet in flop_registry:
        flops = flop_registry[packet](*args, **(kwargs or {}), out_val=out)
        return flops, nbytes, dtype, "attention" in name
    if "grouped_mm" in name and len(inputs) >= 2:  # a [M, K] by b [E, K, N] (or the weight grad's [M, K]^T [M, N])
        a, b = inputs[0], inputs[1]
        n = b.shape[-1] if b.dim() == 3 else b.shape[-1]
        return 2 * a.shape[0] * a.shape[1] * n, nbytes, dtype, False
    if "scaled_dot_product" in name and len(inputs) >= 3:  # the CPU's flash attention, forward or backward
        backward = "backward" in name
        q, k, v = inputs[1:4] if backward else inputs[:3]
        causal = bool((kwargs or {}).get("is_causal", False) or any(a is True for a in args))
        flops = _attention_flops(q, k, v, causal)
        return (flops * 5 // 2 if backward else flops), nbytes, dtype, True
    return 0, nbytes, dtype, False


@dataclass
class OpCosts:
    """Every operator of a recorded micro-batch: (FLOPs, bytes, operand dtype, is attention)."""

    ops: list[tuple[int, int, str, bool]] = field(default_factory=list)

    def add(self, flops: int, nbytes: int, dtype: str, attention: bool) -> None:
        self.ops.append((flops, nbytes, dtype, attention))

    def seconds(self, device: DeviceModel, attention_factor: float = 1.0, mx: bool = False) -> float:
        """The operators' time one after another (`attention_factor`: context parallelism's work
        per recorded attention operator; `mx`: products at the device's MX rate)."""
        total = 0.0
        memory = device.memory_bytes_per_s
        for flops, nbytes, dtype, attention in self.ops:
            if attention:
                rate = device.matmul_flops["attention"]
            elif mx:
                rate = device.matmul_flops["mx"]
            else:
                rate = device.flops_for(dtype)
            roofline = max(flops / rate if flops else 0.0, nbytes / memory)
            if attention:
                roofline *= attention_factor
            total += max(roofline, device.op_floor_s) if device.overlap else roofline + device.op_floor_s
        return total

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

    def to_json(self) -> dict:
        return asdict(self)


def predict(*, device: DeviceModel, ops: OpCosts, accumulation: int, collectives: list[Collective],
            optimizer_bytes_moved: int, optimizer_flops: float, optimizer_ops: int, attention_factor: float,
            mx: bool, moe_exposed_s: float, tokens_per_step: int, model_flops_per_token: float,
            world: int) -> StepTime:
    """A step's time from its parts (the module's note says how)."""
    micro = ops.seconds(device, attention_factor, mx)
    compute = accumulation * micro
    comm: dict[str, float] = {}
    critical: dict[str, float] = {}
    beside: dict[str, list[Collective]] = {}
    for c in collectives:
        seconds = c.seconds(device)
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

"""From a cluster's small FX graph to a fused operator: "compiling" is writing its bytecode.

`lower(sub_gm)` walks the cluster's nodes once and emits a Program (microseconds: no code is
generated or compiled). `FusedOp` runs it: each call views every input as [rows, cols] of the
iteration space (broadcast by strides of 0, so nothing is expanded in memory), allocates the
outputs, and calls the VM. Programs are cached by the cluster's signature (its ops, arguments,
dtypes and kinds), so a graph seen again costs a dictionary lookup.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.fx import GraphModule, Node

from hyperparallel.fusion import reference
from hyperparallel.fusion.bytecode import TORCH_DTYPES, DType, Kind, Op, Program
from hyperparallel.fusion.ops import LOWERINGS, Emitter, Reg
from hyperparallel.mx.backends import host_cache

_CACHE: dict[tuple, tuple] = {}
STATS = {"programs_built": 0, "cache_hits": 0, "build_seconds": [], "built_graphs": []}


def _val(node: Node) -> torch.Tensor:
    return node.meta["val"]


def _one(size) -> bool:
    # a symbolic size is never 1: Dynamo specializes sizes 0 and 1
    return type(size) is int and size == 1


def _role(shape: tuple, domain: tuple) -> Kind:
    """How an input of `shape` is read in a space of `domain`: per element, per row, or one value."""
    if all(_one(d) for d in shape):
        return Kind.SCALAR
    padded = (1,) * (len(domain) - len(shape)) + tuple(shape)
    if len(domain) and _one(padded[-1]) and not _one(domain[-1]):
        return Kind.ROW
    return Kind.FULL


def _domain(sub_gm: GraphModule) -> tuple:
    """The cluster's iteration space: what all its values broadcast to."""
    shapes = [tuple(_val(n).shape) for n in sub_gm.graph.nodes if n.op in ("call_function", "placeholder")]
    rank = max(len(s) for s in shapes)
    if not all(type(d) is int for s in shapes for d in s):
        return tuple(torch.broadcast_shapes(*shapes))  # symbolic sizes: torch's rules and guards
    out = [1] * rank
    for s in shapes:  # (the shapes are known to broadcast: they come from a graph that ran)
        for i, d in enumerate(s, rank - len(s)):
            if d != 1:
                out[i] = d
    return tuple(out)


def _signature(sub_gm: GraphModule) -> tuple:
    """What a program depends on: ops, arguments, dtypes and each input's kind, not shapes (the
    row count and width come with each call), except the width a mean divides by."""
    domain = _domain(sub_gm)
    parts = []
    if any(n.target is torch.ops.aten.mean.dim for n in sub_gm.graph.nodes):
        parts.append(("cols", domain[-1]))
    for n in sub_gm.graph.nodes:
        if n.op == "placeholder":
            v = _val(n)
            parts.append(("in", v.dtype, _role(tuple(v.shape), domain)))
        elif n.op == "call_function":
            args = tuple(("node", a.name) if isinstance(a, Node) else a for a in n.args)
            parts.append((n.name, str(n.target), args, tuple(sorted(n.kwargs.items(), key=str)), _val(n).dtype))
        elif n.op == "output":
            parts.append(("out", tuple(a.name for a in n.args[0])))
    return tuple(parts)


def lower(sub_gm: GraphModule) -> tuple[Program, list[Kind], list[Kind], tuple]:
    """The cluster's program, its inputs' and outputs' kinds, and its iteration space."""
    domain = _domain(sub_gm)
    program = Program()
    emitter = Emitter(program)
    env: dict[Node, Reg] = {}
    in_kinds, out_kinds = [], []
    for n in sub_gm.graph.nodes:
        if n.op == "placeholder":
            v = _val(n)
            kind = _role(tuple(v.shape), domain)
            reg = program.register(kind)
            program.emit(Op.LOAD, reg, len(in_kinds))
            program.input_dtypes.append(TORCH_DTYPES.get(v.dtype, DType.FLOAT32))
            in_kinds.append(kind)
            env[n] = Reg(reg)
        elif n.op == "call_function":
            args = [env[a] if isinstance(a, Node) else a for a in n.args]
            kwargs = dict(n.kwargs)
            if n.target is torch.ops.aten.mean.dim:
                kwargs["cols"] = domain[-1]
            env[n] = LOWERINGS[n.target](emitter, *args, **kwargs)
        elif n.op == "output":
            for i, out in enumerate(n.args[0]):
                reg = env[out]
                program.emit(Op.STORE, 0, reg, i)
                program.output_dtypes.append(TORCH_DTYPES[_val(out).dtype])
                out_kinds.append(Kind.ROW if program.register_kinds[reg] == Kind.ROW else Kind.FULL)
    return program, in_kinds, out_kinds, domain


def build(sub_gm: GraphModule) -> FusedOp:
    key = _signature(sub_gm)
    cached = _CACHE.get(key)
    if cached is None:
        t0 = time.perf_counter()
        cached = lower(sub_gm)
        STATS["build_seconds"].append(time.perf_counter() - t0)
        STATS["built_graphs"][:] = STATS["built_graphs"][-63:] + [sub_gm]  # the latest few, for benchmarks
        STATS["programs_built"] += 1
        _CACHE[key] = cached
    else:
        STATS["cache_hits"] += 1
    program, in_kinds, out_kinds, _ = cached
    outputs = [n for n in sub_gm.graph.nodes if n.op == "output"][0].args[0]
    orders = [_memory_order(_val(o)) for o in outputs]
    return FusedOp(program, in_kinds, out_kinds, [_val(o).dtype for o in outputs], orders, sub_gm)


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of t's dimensions in memory, outermost first (what the graph after it may rely on)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d)))


def _empty(shape, dtype: torch.dtype) -> torch.Tensor:
    # Large outputs come from the buffers PyTorch gave back (mx's host cache): a fresh glibc
    # block costs a page fault per 4 KiB, more than the fused work on it.
    return host_cache.empty(tuple(shape), dtype)


def _empty_in_order(shape: tuple, dtype: torch.dtype, order: tuple[int, ...]) -> torch.Tensor:
    if len(order) != len(shape) or order == tuple(range(len(shape))):
        return _empty(shape, dtype)
    out = _empty([shape[d] for d in order], dtype)
    return out.permute([order.index(d) for d in range(len(shape))])


def _rows_view(t: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, int, int]:
    """`t` broadcast to `shape`, as (tensor, row_stride, col_stride) of a [rows, cols] view; a copy
    only when the leading dimensions cannot be walked with one stride."""
    e = t.expand(shape) if tuple(t.shape) != tuple(shape) else t
    if len(shape) == 0:
        return e, 0, 0
    col_stride = e.stride(-1) if shape[-1] != 1 else 0
    lead = [(s, st) for s, st in zip(shape[:-1], e.stride()[:-1], strict=True) if s != 1]
    if not lead:
        return e, 0, col_stride
    row_stride = lead[-1][1]
    for (_, stride), (next_size, next_stride) in zip(lead[:-1], lead[1:], strict=True):
        if stride != next_stride * next_size:
            e = e.contiguous()
            return e, shape[-1], 1 if shape[-1] != 1 else 0
    return e, row_stride, col_stride


class FusedOp(nn.Module):
    """One fused cluster: runs its program on the VM; falls back to the cluster's own ATen graph
    for inputs the VM cannot take (another device, a dtype it does not load, a reduction over rows
    longer than the VM's tile holds)."""

    def __init__(self, program: Program, in_kinds, out_kinds, out_dtypes, out_orders, fallback: GraphModule):
        super().__init__()
        self.program, self.in_kinds, self.out_kinds, self.out_dtypes = program, in_kinds, out_kinds, out_dtypes
        self.out_orders = out_orders  # each output's dimension order in memory, outermost first, as ATen's
        self.fallback = fallback

    def forward(self, *inputs):
        if any(t.device.type != "cpu" or t.dtype not in TORCH_DTYPES for t in inputs):
            return self.fallback(*inputs)
        full = [t.shape for t, k in zip(inputs, self.in_kinds, strict=True) if k == Kind.FULL]
        shape = tuple(torch.broadcast_shapes(*full)) if full else tuple(inputs[0].shape)
        rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        if self.program.has_reduction and cols > _max_reduce_cols():
            return self.fallback(*inputs)
        row_shape = shape[:-1] + (1,) if shape else ()
        views, strides = [], []
        for t, kind in zip(inputs, self.in_kinds, strict=True):
            if kind == Kind.SCALAR:
                views.append(t)
                strides.append((0, 0))
            else:
                v, rs, cs = _rows_view(t, shape if kind == Kind.FULL else row_shape)
                views.append(v)
                strides.append((rs, cs))
        outs, targets, out_strides = [], [], []
        for kind, dtype, order in zip(self.out_kinds, self.out_dtypes, self.out_orders, strict=True):
            out = _empty_in_order(row_shape if kind == Kind.ROW else shape, dtype, order)
            target, rs, cs = _rows_view(out, row_shape if kind == Kind.ROW else shape)
            if kind == Kind.ROW:
                rs, cs = (rs if target is out else 1), 0
            outs.append(out)
            targets.append(target)
            out_strides.append((rs, cs))
        _runner()(self.program, views, targets, rows, cols, strides, out_strides)
        for out, target in zip(outs, targets, strict=True):
            if target is not out and target.data_ptr() != out.data_ptr():  # a layout the VM cannot walk
                out.copy_(target)
        return tuple(outs)


def _max_reduce_cols() -> int:
    """The longest row the native VM reduces in one tile (the reference interpreter: any)."""
    runner = _runner()
    if runner is reference.run:
        return math.inf
    from hyperparallel.fusion import vm

    return vm.MAX_REDUCE_COLS


def _runner():
    """The native VM when built, else the PyTorch reference interpreter (correct, slow)."""
    try:
        from hyperparallel.fusion import vm
    except ImportError:
        return reference.run
    return vm.run if vm.LIB is not None else reference.run

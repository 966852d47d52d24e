"""From a cluster's small FX graph to a fused operator: "compiling" is writing its bytecode.

`lower(sub_gm)` walks the cluster's nodes once and emits a Program (microseconds: no code is
generated or compiled). Programs are cached by the cluster's signature (its ops, arguments,
dtypes and kinds), so a graph seen again costs a dictionary lookup, and one program serves every
shape.

`FusedOp` runs it. The first call with an input layout (shapes, strides, dtypes) makes a call
plan: the iteration space, each tensor's strides over it (0 where it broadcasts), its leading
dimensions folded into at most three row levels every tensor walks with one stride each (so
rotary's cos [1, 1, S, D] against q [B, H, S, D] transposed needs no copy), the output shapes,
and the VM call's ctypes arguments. Later calls with that layout look the plan up, allocate the
outputs (large ones from the host buffer cache) and make one native call.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.fx import GraphModule, Node

from hyperparallel.fusion import reference, vf
from hyperparallel.fusion.bytecode import INPUT_DTYPES, TORCH_DTYPES, DType, Kind, Op, Program
from hyperparallel.fusion.ops import LOWERINGS, Emitter, Reg
from hyperparallel.kernels import host_cache

_CACHE: dict[tuple, tuple] = {}
# programs: built / found in the cache; calls: run on the VM or by the cluster's ATen graph
STATS = {"programs_built": 0, "cache_hits": 0, "build_seconds": [], "built_graphs": [], "fused_calls": 0,
         "aten_calls": 0, "call_plans_built": 0}


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
            program.input_dtypes.append(INPUT_DTYPES.get(v.dtype, DType.FLOAT32))
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
    if vf.active():
        program = vf.apply(program)
    return program, in_kinds, out_kinds, domain


def build(sub_gm: GraphModule) -> FusedOp:
    key = (_signature(sub_gm), vf.active())
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
    # an expand may widen the space past every input's shape: then it is the graph's (static) one
    widens = any(n.target is torch.ops.aten.expand.default for n in sub_gm.graph.nodes)
    static = _domain(sub_gm) if widens else None
    return FusedOp(program, in_kinds, out_kinds, [_val(o).dtype for o in outputs], orders, sub_gm, static)


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The order of t's dimensions in memory, outermost first (what the graph after it may rely on)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -d)))


# glibc serves small blocks from its heap once such a block has been freed: warm, reused memory,
# as the host cache's but without the DLPack round trip (a 0.25M-element fp32 SiLU took 0.150 ms
# so, 0.184 ms from the cache; an allocation 0.9 us, against 3.7 us). Blocks of 32 MiB and more
# glibc always maps fresh, a page fault per 4 KiB; and in a training step, where other
# allocations come and go between, it gives the top of its heap back often enough that blocks of
# a few MiB fault too (the fused loss chunk's 8 MiB gradient of the logits: 1,365 page faults a
# call, 2.6 ms instead of 0.7). Outputs from HOST_CACHE_MIN_BYTES up come from the buffers
# PyTorch gave back (mx's host cache).
HOST_CACHE_MIN_BYTES = 4 << 20


MAX_PLANS = 16  # call plans kept per fused operator (one per input layout seen)
_UNFUSED = "aten"  # a layout the VM cannot take: the cluster's own ATen graph runs


def _strides_in(t: torch.Tensor, shape: tuple) -> tuple[int, ...]:
    """t's element strides when broadcast to `shape` (0 along broadcast and size-1 dimensions)."""
    e = t.expand(shape) if tuple(t.shape) != tuple(shape) else t
    return tuple(0 if size == 1 else stride for size, stride in zip(shape, e.stride(), strict=True))


def _nest_rows(shape: tuple, strides: list[tuple[int, ...]]) -> tuple[tuple[int, int, int], list[tuple]] | None:
    """The leading dimensions of `shape` as at most three row levels (outer, middle, inner) that
    every tensor walks with one stride each: size-1 dimensions dropped, neighbours merged where
    every tensor's strides allow. Returns the levels' sizes and each tensor's (outer, middle,
    inner, column) strides, or None when more than three levels remain."""
    dims = [(size, [s[d] for s in strides]) for d, size in enumerate(shape[:-1]) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, st in dims:
        if merged and all(o == i * size for o, i in zip(merged[-1][1], st, strict=True)):
            merged[-1] = (merged[-1][0] * size, st)  # the outer one folds into this one
        else:
            merged.append((size, st))
    if len(merged) > 3:
        return None
    merged = [(1, [0] * len(strides))] * (3 - len(merged)) + merged
    sizes = tuple(size for size, _ in merged)
    nested = [tuple(merged[level][1][i] for level in range(3)) + (s[-1] if shape else 0,)
              for i, s in enumerate(strides)]
    return sizes, nested


class _CallPlan:
    """A fused operator bound to one input layout (shapes, strides, dtypes): the output shapes and
    the VM call with every argument but the data pointers, built once; a call then allocates the
    outputs (large ones from the buffer cache) and makes one native call."""

    __slots__ = ("outs", "packs", "call")

    def __init__(self, outs, packs, call):
        # per output (large, shape, layout, dtype): a small one made with torch.empty_strided(shape,
        # layout); a large one from the host cache in memory order (shape), then permuted back
        # (layout: the permutation, or None); large None: a slice (layout: buffer, dim, start,
        # length) of a packed buffer
        self.outs = outs
        self.packs = packs  # per packed buffer: (large, shape, dtype), contiguous
        self.call = call


class FusedOp(nn.Module):
    """One fused cluster: runs its program on the VM; falls back to the cluster's own ATen graph
    for inputs the VM cannot take (another device, a dtype it does not load, a reduction over rows
    longer than the VM's tile holds)."""

    def __init__(self, program: Program, in_kinds, out_kinds, out_dtypes, out_orders, fallback: GraphModule,
                 domain: tuple[int, ...] | None = None):
        super().__init__()
        # the iteration space when the graph's shapes are static: an `expand` may make it wider
        # than any input (GQA's repeated keys: [B, KV, 1, S, D] to [B, KV, G, S, D])
        self.domain = domain
        self.program, self.in_kinds, self.out_kinds, self.out_dtypes = program, in_kinds, out_kinds, out_dtypes
        self.out_orders = out_orders  # each output's dimension order in memory, outermost first, as ATen's
        self.fallback = fallback
        self.plans: dict[tuple, _CallPlan | str] = {}  # by input layout
        self.packs: list[tuple[int, tuple[int, ...]]] = []  # (dim, outputs): see pack()

    def pack(self, outputs: list[int], dim: int) -> int | None:
        """Compute `outputs` (FULL, of one dtype) straight into the slices of one buffer along
        `dim`: what `cat([outputs...], dim)` of them would be, returned as one more output (its
        index; None when they cannot be). The cat's pass over them is saved."""
        taken = {i for _, idx in self.packs for i in idx}
        n = len(self.out_kinds)
        if (len(outputs) < 2 or len(set(outputs)) != len(outputs) or any(not 0 <= i < n for i in outputs)
                or taken & set(outputs) or any(self.out_kinds[i] != Kind.FULL for i in outputs)
                or len({self.out_dtypes[i] for i in outputs}) != 1):
            return None
        self.packs.append((dim, tuple(outputs)))
        self.plans.clear()
        return n + len(self.packs) - 1

    def forward(self, *inputs):
        key = tuple((t.shape, t.stride(), t.dtype, t.is_cpu) for t in inputs)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._plan(inputs)
            if len(self.plans) >= MAX_PLANS:
                self.plans.pop(next(iter(self.plans)))  # the oldest layout
            self.plans[key] = plan
        if plan is _UNFUSED:
            STATS["aten_calls"] += 1
            outs = tuple(self.fallback(*inputs))
            return outs + tuple(torch.cat([outs[i] for i in idx], dim) for dim, idx in self.packs)
        bufs = [host_cache.empty(shape, dtype) if large else torch.empty(shape, dtype=dtype)
                for large, shape, dtype in plan.packs]
        outs = []
        for large, shape, layout, dtype in plan.outs:
            if large is None:
                b, dim, start, length = layout
                outs.append(bufs[b].narrow(dim, start, length))
            elif large:
                out = host_cache.empty(shape, dtype)
                outs.append(out if layout is None else out.permute(layout))
            else:
                outs.append(torch.empty_strided(shape, layout, dtype=dtype))
        plan.call(inputs, outs)
        STATS["fused_calls"] += 1
        return tuple(outs) + tuple(bufs)

    # no hooks: what nn.Module's call would add is time (1-2 us a call); a tracer that patches
    # nn.Module.__call__ (FX's) sees forward's own ops instead of a module call
    __call__ = forward

    def _plan(self, inputs) -> _CallPlan | str:
        """The call plan for these inputs' layout, or _UNFUSED."""
        STATS["call_plans_built"] += 1
        if any(t.device.type != "cpu" or INPUT_DTYPES.get(t.dtype) != want
               for t, want in zip(inputs, self.program.input_dtypes, strict=True)):
            return _UNFUSED  # another device, or dtypes the program was not written for
        full = [t.shape for t, k in zip(inputs, self.in_kinds, strict=True) if k == Kind.FULL]
        if self.domain is not None:
            full.append(self.domain)
        shape = tuple(torch.broadcast_shapes(*full)) if full else tuple(inputs[0].shape)
        rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        if self.program.has_reduction and cols > _max_reduce_cols():
            return _UNFUSED
        row_shape = shape[:-1] + (1,) if shape else ()
        strides = [(0,) * len(shape) if kind == Kind.SCALAR else _strides_in(t, shape if kind == Kind.FULL else row_shape)
                   for t, kind in zip(inputs, self.in_kinds, strict=True)]
        outs, packs, packed = [], [], {}
        for b, (dim, idx) in enumerate(self.packs):
            buf_shape = list(shape)
            buf_shape[dim] = shape[dim] * len(idx)
            large = math.prod(buf_shape) * self.out_dtypes[idx[0]].itemsize >= HOST_CACHE_MIN_BYTES
            packs.append((large, tuple(buf_shape), self.out_dtypes[idx[0]]))
            buf = torch.empty(buf_shape, dtype=self.out_dtypes[idx[0]], device="meta")
            for j, i in enumerate(idx):
                packed[i] = (buf.narrow(dim, j * shape[dim], shape[dim]), (b, dim, j * shape[dim], shape[dim]))
        for i, (kind, dtype, order) in enumerate(zip(self.out_kinds, self.out_dtypes, self.out_orders, strict=True)):
            if i in packed:
                laid, where = packed[i]
                outs.append((None, None, where, dtype))
                strides.append(_strides_in(laid, shape))
                continue
            out_shape = row_shape if kind == Kind.ROW else shape
            if len(order) != len(out_shape) or order == tuple(range(len(out_shape))):
                order = tuple(range(len(out_shape)))
                spec = (out_shape, dtype, None)
            else:
                spec = ([out_shape[d] for d in order], dtype, [order.index(d) for d in range(len(out_shape))])
            laid = torch.empty(spec[0], dtype=dtype, device="meta")
            laid = laid if spec[2] is None else laid.permute(spec[2])
            large = math.prod(out_shape) * dtype.itemsize >= HOST_CACHE_MIN_BYTES
            outs.append((True, tuple(spec[0]), spec[2], dtype) if large else (False, tuple(laid.shape), laid.stride(), dtype))
            strides.append(_strides_in(laid, shape if kind == Kind.FULL else row_shape))
        if len(shape) > 2:
            # rows walked in the first output's memory order, as TensorIterator walks them: any
            # order gives the same results, and a transposed output (rotary's q and k, the norms'
            # gradients laid out [B, H, S, D] over a [B, S, H, D] space) is then written row
            # after row instead of 64 KiB apart (rotary's q: 100 us a call, 70 so)
            ref = strides[len(inputs)]
            perm = sorted(range(len(shape) - 1), key=lambda d: -ref[d]) + [len(shape) - 1]
            shape = tuple(shape[d] for d in perm)
            strides = [tuple(st[d] for d in perm) for st in strides]
        nested = _nest_rows(shape, strides)
        if nested is None:  # more than three row levels: the ATen graph (a layout not seen in models)
            return _UNFUSED
        (_, n_mid, n_inner), st = nested
        in_st, out_st = st[:len(inputs)], st[len(inputs):]
        if _runner() is reference.run:
            def call(ins, outs, program=self.program):
                reference.run(program, ins, outs, rows, cols, in_st, out_st, (n_mid, n_inner))
        else:
            from hyperparallel.fusion import vm

            call = vm.Call(self.program, rows, cols, (n_mid, n_inner), in_st, out_st)
        return _CallPlan(outs, packs, call)


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

"""Which ATen ops DVM fuses, and how each becomes bytecode.

Classes (what the partitioner needs to know of an op):
- element-wise: one value out per value in, operands broadcast (add, mul, exp, silu, where, ...);
- cast: a dtype change (_to_copy, prims.convert_element_type), element-wise too;
- reduction: sum / mean / amax / amin over the last dimension with keepdim (norms, softmax);
- composite: _softmax and its backward, lowered to reductions and element-wise ops; rotary's
  rotate_half (found by rotary.py), lowered to ROT_HALF;
- opaque: everything else (matmuls, views, indexing, ...), left to ATen unchanged.

Each lowering takes the emitter and the node's arguments (registers for tensors, Python numbers
as they are) and returns the result register. `fusible(node)` says whether an op with these
arguments can be lowered: dtypes, scalars, reduction dims and keepdim are checked here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.fx import Node

from hyperparallel.fusion.bytecode import TORCH_DTYPES, Kind, Op, Program
from hyperparallel.fusion.rotary import ROTATE_HALF

aten = torch.ops.aten
prims = torch.ops.prims

FLOAT_DTYPES = set(TORCH_DTYPES)


class Emitter:
    """Writes bytecode for one cluster; registers carry their kind (FULL / ROW / SCALAR)."""

    def __init__(self, program: Program):
        self.program = program

    def kind(self, reg: int) -> Kind:
        return self.program.register_kinds[reg]

    def operand(self, value) -> int:
        return value if isinstance(value, Reg) else self.program.constant(float(value))

    def apply(self, op: Op, *operands) -> Reg:
        regs = [v if isinstance(v, Reg) else self.program.constant(float(v)) for v in operands]
        kinds = self.program.register_kinds
        kind = min(kinds[r] for r in regs)  # FULL(0) < ROW(1) < SCALAR(2): the widest wins
        kinds.append(kind)
        dst = len(kinds) - 1
        self.program.code += [op, dst, *regs, *(0,) * (3 - len(regs))]
        return Reg(dst)

    def reduce(self, op: Op, reg: int) -> Reg:
        dst = self.program.register(Kind.ROW)
        self.program.emit(op, dst, reg)
        return Reg(dst)


class Reg(int):
    """A register number (an int that is not a Python scalar argument)."""


def _is_float_tensor(value) -> bool:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in FLOAT_DTYPES


def _is_bool_tensor(value) -> bool:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def _unary(op: Op):
    return lambda e, x: e.apply(op, x)


def _binary(op: Op):
    return lambda e, x, y: e.apply(op, x, y)


def _add(e, x, y, alpha=1):
    return e.apply(Op.ADD, x, y if alpha == 1 else e.apply(Op.MUL, y, alpha))


def _sub(e, x, y, alpha=1):
    return e.apply(Op.SUB, x, y if alpha == 1 else e.apply(Op.MUL, y, alpha))


def _rsub(e, x, y, alpha=1):
    return _sub(e, y, x, alpha)


def _pow(e, x, exponent):
    if isinstance(exponent, (int, float)) and exponent == 2:
        return e.apply(Op.MUL, x, x)
    if isinstance(exponent, (int, float)) and exponent == 0.5:
        return e.apply(Op.SQRT, x)
    return e.apply(Op.POW, x, exponent)


def _gelu(e, x, approximate="none"):
    return e.apply(Op.GELU_TANH if approximate == "tanh" else Op.GELU_ERF, x)


def _cast(e, x, dtype=None, **kwargs):
    if dtype == torch.bfloat16:
        return e.apply(Op.ROUND_BF16, x)
    if dtype == torch.float16:
        return e.apply(Op.ROUND_F16, x)
    return e.apply(Op.COPY, x)


def _convert(e, x, dtype):
    return _cast(e, x, dtype)


def _expand(e, x, sizes, implicit=False):
    """A broadcast to the cluster's space: every value of the VM already lives in that space, so
    a FULL value is itself; a per-row or scalar one becomes FULL (what the expanded tensor is)."""
    if e.kind(x) == Kind.FULL:
        return x
    dst = e.program.register(Kind.FULL)
    e.program.emit(Op.COPY, dst, x)
    return Reg(dst)


def _where(e, cond, x, y):
    return e.apply(Op.WHERE, cond, x, y)


def _sum(e, x, dims, keepdim=False, dtype=None):
    return e.reduce(Op.RSUM, x)


def _mean(e, x, dims, keepdim=False, dtype=None, *, cols: int):
    return e.apply(Op.MUL, e.reduce(Op.RSUM, x), 1.0 / cols)


def _amax(e, x, dims=(), keepdim=False):
    return e.reduce(Op.RMAX, x)


def _amin(e, x, dims=(), keepdim=False):
    return e.reduce(Op.RMIN, x)


def _rotate_half(e, x):
    if e.kind(x) != Kind.FULL:
        x = _expand(e, x, None)
    dst = e.program.register(Kind.FULL)
    e.program.emit(Op.ROT_HALF, dst, x)
    return Reg(dst)


def _softmax(e, x, dim, half_to_float):
    shifted = e.apply(Op.SUB, x, e.reduce(Op.RMAX, x))
    exp = e.apply(Op.EXP, shifted)
    return e.apply(Op.DIV, exp, e.reduce(Op.RSUM, exp))


def _softmax_backward(e, grad, out, dim, input_dtype):
    inner = e.reduce(Op.RSUM, e.apply(Op.MUL, grad, out))
    return e.apply(Op.MUL, out, e.apply(Op.SUB, grad, inner))


def _sigmoid_backward(e, grad, out):
    return e.apply(Op.MUL, grad, e.apply(Op.MUL, out, e.apply(Op.SUB, 1.0, out)))


def _tanh_backward(e, grad, out):
    return e.apply(Op.MUL, grad, e.apply(Op.SUB, 1.0, e.apply(Op.MUL, out, out)))


def _silu_backward(e, grad, x):
    s = e.apply(Op.SIGMOID, x)
    return e.apply(Op.MUL, grad, e.apply(Op.MUL, s, e.apply(Op.ADD, 1.0, e.apply(Op.MUL, x, e.apply(Op.SUB, 1.0, s)))))


def _threshold_backward(e, grad, x, threshold):
    return e.apply(Op.WHERE, e.apply(Op.LE, x, threshold), 0.0, grad)


def _gelu_backward(e, grad, x, approximate="none"):
    if approximate == "tanh":
        k, c = math.sqrt(2 / math.pi), 0.044715
        x2 = e.apply(Op.MUL, x, x)
        inner = e.apply(Op.MUL, e.apply(Op.MUL, x, e.apply(Op.ADD, 1.0, e.apply(Op.MUL, x2, c))), k)
        t = e.apply(Op.TANH, inner)
        dinner = e.apply(Op.MUL, e.apply(Op.ADD, 1.0, e.apply(Op.MUL, x2, 3 * c)), k)
        left = e.apply(Op.MUL, e.apply(Op.ADD, 1.0, t), 0.5)
        right = e.apply(Op.MUL, e.apply(Op.MUL, e.apply(Op.MUL, x, 0.5), e.apply(Op.SUB, 1.0, e.apply(Op.MUL, t, t))),
                        dinner)
        return e.apply(Op.MUL, grad, e.apply(Op.ADD, left, right))
    cdf = e.apply(Op.MUL, e.apply(Op.ADD, 1.0, e.apply(Op.ERF, e.apply(Op.MUL, x, 1 / math.sqrt(2)))), 0.5)
    pdf = e.apply(Op.MUL, e.apply(Op.EXP, e.apply(Op.MUL, e.apply(Op.MUL, x, x), -0.5)), 1 / math.sqrt(2 * math.pi))
    return e.apply(Op.MUL, grad, e.apply(Op.ADD, cdf, e.apply(Op.MUL, x, pdf)))


ELEMENTWISE: dict = {
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: _sub, aten.sub.Scalar: _sub, aten.rsub.Scalar: _rsub, aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: _binary(Op.MUL), aten.mul.Scalar: _binary(Op.MUL),
    aten.div.Tensor: _binary(Op.DIV), aten.div.Scalar: _binary(Op.DIV),
    aten.maximum.default: _binary(Op.MAX), aten.minimum.default: _binary(Op.MIN),
    aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _binary(Op.POW),
    aten.gt.Tensor: _binary(Op.GT), aten.gt.Scalar: _binary(Op.GT),
    aten.ge.Tensor: _binary(Op.GE), aten.ge.Scalar: _binary(Op.GE),
    aten.lt.Tensor: _binary(Op.LT), aten.lt.Scalar: _binary(Op.LT),
    aten.le.Tensor: _binary(Op.LE), aten.le.Scalar: _binary(Op.LE),
    aten.eq.Tensor: _binary(Op.EQ), aten.eq.Scalar: _binary(Op.EQ),
    aten.ne.Tensor: _binary(Op.NE), aten.ne.Scalar: _binary(Op.NE),
    aten.neg.default: _unary(Op.NEG), aten.abs.default: _unary(Op.ABS),
    aten.exp.default: _unary(Op.EXP), aten.log.default: _unary(Op.LOG),
    aten.sqrt.default: _unary(Op.SQRT), aten.rsqrt.default: _unary(Op.RSQRT),
    aten.reciprocal.default: _unary(Op.RECIP), aten.tanh.default: _unary(Op.TANH),
    aten.sigmoid.default: _unary(Op.SIGMOID), aten.relu.default: _unary(Op.RELU),
    aten.erf.default: _unary(Op.ERF), aten.silu.default: _unary(Op.SILU), aten.gelu.default: _gelu,
    aten.sin.default: _unary(Op.SIN), aten.cos.default: _unary(Op.COS),
    aten.log1p.default: _unary(Op.LOG1P), aten.expm1.default: _unary(Op.EXPM1),
    aten.where.self: _where, aten.where.ScalarOther: _where, aten.where.ScalarSelf: _where, aten.where.Scalar: _where,
    aten._to_copy.default: _cast, prims.convert_element_type.default: _convert,
    aten.clone.default: lambda e, x, **kw: e.apply(Op.COPY, x),
    aten.expand.default: _expand,
    aten.sigmoid_backward.default: _sigmoid_backward, aten.tanh_backward.default: _tanh_backward,
    aten.silu_backward.default: _silu_backward, aten.threshold_backward.default: _threshold_backward,
    aten.gelu_backward.default: _gelu_backward,
}
REDUCTIONS: dict = {
    aten.sum.dim_IntList: _sum, aten.mean.dim: _mean, aten.amax.default: _amax, aten.amin.default: _amin,
}
COMPOSITES: dict = {
    aten._softmax.default: _softmax, aten._softmax_backward_data.default: _softmax_backward,
    ROTATE_HALF: _rotate_half,  # (rotary.py finds it in the graph)
}
LOWERINGS: dict[object, Callable] = {**ELEMENTWISE, **REDUCTIONS, **COMPOSITES}
ROW_REDUCING = set(REDUCTIONS) | set(COMPOSITES)  # need whole rows in a tile


def classify(node: Node) -> str:
    """element-wise | cast | reduction | composite | opaque."""
    target = node.target
    if target in (aten._to_copy.default, prims.convert_element_type.default):
        return "cast"
    if target in ELEMENTWISE:
        return "element-wise"
    if target in REDUCTIONS:
        return "reduction"
    if target in COMPOSITES:
        return "composite"
    return "opaque"


def _last_dim_only(node: Node, dims) -> bool:
    ndim = node.args[0].meta["val"].dim()
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return len(dims) == 1 and dims[0] % max(ndim, 1) == ndim - 1


def fusible(node: Node) -> bool:
    """Whether DVM can run this node: a known op on float tensors (or bool masks it makes itself),
    Python-number scalars, and reductions over the last dimension only, keeping it."""
    if node.op != "call_function" or node.target not in LOWERINGS:
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype not in FLOAT_DTYPES | {torch.bool}:
        return False
    if out.numel() == 0:
        return False
    kind = classify(node)
    for arg in node.args:
        if isinstance(arg, Node):
            if not (_is_float_tensor(arg) or _is_bool_tensor(arg)):
                return False
        elif not isinstance(arg, (int, float, bool, torch.dtype, str, list, tuple, type(None))):
            return False
    if kind == "cast":
        extra = {k: v for k, v in node.kwargs.items() if k not in ("dtype",)}
        if any(v is not None and k != "memory_format" for k, v in extra.items()):
            return False  # a device or layout change is not a cast
        if node.target is aten._to_copy.default and out.dtype not in FLOAT_DTYPES:
            return False
    elif node.kwargs and classify(node) != "cast":
        # a clone's memory format is its output's layout, which a fused operator's outputs take
        # from the graph (`_memory_order`): `.contiguous()` of a fused value fuses too
        allowed = {"alpha", "approximate"} | ({"memory_format"} if node.target is aten.clone.default else set())
        if set(node.kwargs) - allowed:
            return False
    if kind == "reduction":
        if node.target in (aten.sum.dim_IntList, aten.mean.dim):
            dims, keepdim = node.args[1], (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
            if node.kwargs.get("dtype") is not None:
                return False
            if node.target is aten.mean.dim and not isinstance(node.args[0].meta["val"].shape[-1], int):
                return False  # a mean divides by the width: it must be known when the program is built
        else:
            dims, keepdim = (node.args[1] if len(node.args) > 1 else ()), (node.args[2] if len(node.args) > 2 else False)
        return bool(keepdim) and _last_dim_only(node, dims)
    if node.target is aten.expand.default and not all(type(d) is int and d >= 0 for d in node.args[1]):
        return False  # the space it widens to must be known when the operator is built (FusedOp.domain)
    if node.target is ROTATE_HALF:
        width = out.shape[-1]
        return out.dim() > 0 and isinstance(width, int) and width % 2 == 0
    if kind == "composite":
        dim = node.args[1] if node.target is aten._softmax.default else node.args[2]
        ndim = out.dim()
        if node.target is aten._softmax.default and node.args[2]:
            return False  # half_to_float: an output dtype the graph does not show as a cast
        return dim % max(ndim, 1) == ndim - 1
    return True

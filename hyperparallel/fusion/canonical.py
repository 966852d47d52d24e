"""Dynamo's graphs speak torch (torch.sigmoid, operator.mul, x.float(), F.silu); DVM's lowerings
speak ATen. For a graph that needs no gradients, rewriting the element-wise nodes we know to their
ATen ops in place is all the "tracing" needed: no make_fx, no AOTAutograd, so compiling costs
about a millisecond. A node we do not know keeps its torch target and runs as it was.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

aten = torch.ops.aten

_UNARY = {
    "sigmoid": aten.sigmoid.default, "tanh": aten.tanh.default, "exp": aten.exp.default, "log": aten.log.default,
    "sqrt": aten.sqrt.default, "rsqrt": aten.rsqrt.default, "neg": aten.neg.default, "abs": aten.abs.default,
    "relu": aten.relu.default, "erf": aten.erf.default, "sin": aten.sin.default, "cos": aten.cos.default,
    "reciprocal": aten.reciprocal.default, "log1p": aten.log1p.default, "expm1": aten.expm1.default,
}
_BINARY = {"add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor, "div": aten.div.Tensor,
           "maximum": aten.maximum.default, "minimum": aten.minimum.default}
_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
              operator.gt: "gt", operator.ge: "ge", operator.lt: "lt", operator.le: "le", operator.eq: "eq",
              operator.ne: "ne"}
_COMPARE = {"gt": aten.gt, "ge": aten.ge, "lt": aten.lt, "le": aten.le, "eq": aten.eq, "ne": aten.ne}
_REFLECTED = {"gt": "lt", "ge": "le", "lt": "gt", "le": "ge", "eq": "eq", "ne": "ne"}  # 5 > x is x < 5
_WHERE = {(True, True): aten.where.self, (True, False): aten.where.ScalarOther,
          (False, True): aten.where.ScalarSelf, (False, False): aten.where.Scalar}
_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}


def _name(node: Node) -> str | None:
    """The op a node calls, by name, whether torch.x, torch.Tensor.x, x.method() or an operator."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        if node.target in _OPERATORS:
            return _OPERATORS[node.target]
        if node.target is operator.neg:
            return "neg"
        if node.target is operator.pow:
            return "pow"
        if node.target in (F.silu, F.gelu, F.relu, F.softmax, torch.softmax, torch.where):
            return {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", F.softmax: "softmax", torch.softmax: "softmax",
                    torch.where: "where"}[node.target]
        name = getattr(node.target, "__name__", None)
        if getattr(node.target, "__module__", None) in ("torch", "torch._C._VariableFunctions", None) or \
                node.target is getattr(torch, name or "", None):
            return name
    return None


def _tensor(value) -> bool:
    return isinstance(value, Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _to_aten(node: Node) -> tuple | None:
    """(ATen op, args, kwargs) for a node we know, else None."""
    name = _name(node)
    args, kwargs = list(node.args), dict(node.kwargs)
    if name is None:
        return None
    if name in _UNARY and len(args) == 1 and not kwargs:
        return _UNARY[name], (args[0],), {}
    if name in _BINARY and len(args) == 2 and not kwargs:
        if not _tensor(args[0]):  # 2.0 * x, 1.0 - x: the lowerings take numbers in any place
            return _BINARY[name], (args[0], args[1]), {}
        return _BINARY[name], tuple(args), {}
    if name in _COMPARE and len(args) == 2 and not kwargs:
        # ATen has a Tensor overload (both tensors) and a Scalar one (a number second)
        if not _tensor(args[0]):
            name, args = _REFLECTED[name], [args[1], args[0]]
        overload = "Tensor" if _tensor(args[1]) else "Scalar"
        return getattr(_COMPARE[name], overload), tuple(args), {}
    if name == "pow" and len(args) == 2 and not kwargs and isinstance(args[1], (int, float)):
        return aten.pow.Tensor_Scalar, tuple(args), {}
    if name == "silu" and len(args) == 1 and not kwargs.get("inplace", False):
        return aten.silu.default, (args[0],), {}
    if name == "gelu" and len(args) == 1 and set(kwargs) <= {"approximate"}:
        return aten.gelu.default, (args[0],), kwargs
    if name in _CASTS and len(args) == 1 and not kwargs:
        return aten._to_copy.default, (args[0],), {"dtype": _CASTS[name]}
    if name == "to" and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return aten._to_copy.default, (args[0],), {"dtype": args[1]}
    if name in ("mean", "sum") and len(args) >= 2:
        dim = args[1]
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if set(kwargs) <= {"keepdim"}:
            op = aten.mean.dim if name == "mean" else aten.sum.dim_IntList
            return op, (args[0], [dim] if isinstance(dim, int) else list(dim), keepdim), {}
    if name == "softmax":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dim, int) and set(kwargs) <= {"dim"}:
            return aten._softmax.default, (args[0], dim, False), {}
    if name == "where" and len(args) == 3 and not kwargs:
        return _WHERE[(_tensor(args[1]), _tensor(args[2]))], tuple(args), {}
    return None


def canonicalize(gm: GraphModule) -> GraphModule:
    """Give every node meta["val"] (Dynamo's example value) and rewrite known ops to ATen in place."""
    for node in gm.graph.nodes:
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
        if node.op not in ("call_function", "call_method") or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        rewritten = _to_aten(node)
        if rewritten is None:
            continue
        node.op, (node.target, node.args, node.kwargs) = "call_function", rewritten
    gm.recompile()
    return gm

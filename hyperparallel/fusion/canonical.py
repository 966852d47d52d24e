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
_REDUCE = {"sum": aten.sum.dim_IntList, "mean": aten.mean.dim, "amax": aten.amax.default, "amin": aten.amin.default}


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
    return _aten_call(_name(node), list(node.args), dict(node.kwargs))


def _aten_call(name: str | None, args: list, kwargs: dict) -> tuple | None:
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
    if name in _REDUCE and (len(args) >= 2 or "dim" in kwargs) and set(kwargs) <= {"dim", "keepdim"}:
        dim = args[1] if len(args) > 1 else kwargs["dim"]
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if isinstance(dim, int) or (isinstance(dim, (list, tuple)) and all(isinstance(d, int) for d in dim)):
            return _REDUCE[name], (args[0], [dim] if isinstance(dim, int) else list(dim), keepdim), {}
    if name == "softmax":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dim, int) and set(kwargs) <= {"dim"}:
            return aten._softmax.default, (args[0], dim, False), {}
    if name == "where" and len(args) == 3 and not kwargs:
        return _WHERE[(_tensor(args[1]), _tensor(args[2]))], tuple(args), {}
    return None


def _same_dtype_cast(node: Node) -> bool:
    """x.float() on a float32 x (x.to(its own dtype), ...): eager returns x itself, no copy."""
    name = _name(node)
    cast = name in _CASTS and len(node.args) == 1 and not node.kwargs
    to = name == "to" and len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs
    if not (cast or to) or not _tensor(node.args[0]):
        return False
    return node.args[0].meta["val"].dtype == (_CASTS[name] if cast else node.args[1])


def _functional(node: Node, fresh: set[Node]) -> bool:
    """x.exp_(), x.mul_(y), ... on a value this graph made with an ATen element-wise op (so no
    input, view or other alias sees the write): rewritten to the out-of-place op, and every later
    use of x to its result."""
    if node.op != "call_method" or not node.target.endswith("_") or node.target.startswith("_"):
        return False
    base = node.args[0] if node.args else None
    if base not in fresh or not isinstance(base.meta.get("val"), torch.Tensor):
        return False
    rewritten = _aten_call(node.target[:-1], list(node.args), dict(node.kwargs))
    if rewritten is None:
        return False
    node.op, (node.target, node.args, node.kwargs) = "call_function", rewritten
    for user in list(base.users):  # uses after the write saw the written value: they read the result now
        if user is not node and _after(user, node):
            user.replace_input_with(base, node)
    return True


def _after(a: Node, b: Node) -> bool:
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


def canonicalize(gm: GraphModule) -> GraphModule:
    """Give every node meta["val"] (Dynamo's example value) and rewrite known ops to ATen in place;
    drop casts to the dtype a value has, and make in-place element-wise ops on values the graph
    made out of place."""
    from hyperparallel.fusion.ops import ELEMENTWISE, REDUCTIONS

    fresh: set[Node] = set()  # values an ATen element-wise op or reduction of this graph made
    for node in list(gm.graph.nodes):
        if "val" not in node.meta and "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]
        if node.op not in ("call_function", "call_method") or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if _same_dtype_cast(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        if _functional(node, fresh):
            fresh.add(node)
            continue
        rewritten = _to_aten(node)
        if rewritten is None:
            continue
        node.op, (node.target, node.args, node.kwargs) = "call_function", rewritten
        if node.target in ELEMENTWISE or node.target in REDUCTIONS:
            fresh.add(node)
    gm.recompile()
    return gm

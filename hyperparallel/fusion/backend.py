"""`torch.compile(model, backend="dvm")`: element-wise work fused into DVM programs, the rest ATen.

Registered under the name `dvm` through the `torch_dynamo_backends` entry point (pyproject.toml),
so it works after install without importing hyperparallel first.

A graph whose inputs need gradients goes through AOTAutograd (forward and backward ATen graphs,
each fused the same way; split by Inductor's min-cut partitioner, which recomputes cheap
element-wise values in the backward instead of saving them). A graph that needs none does not pay for AOTAutograd, nor for any
tracing: Dynamo's own graph is used, its element-wise nodes rewritten to ATen (canonical.py). Either way, `fuse(gm)` finds the clusters (partition.py), replaces each by
one FusedOp (compile.py) and leaves every other node as the ATen op it was.
"""

from __future__ import annotations

import operator
import time

import torch
from torch.fx import GraphModule
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from hyperparallel.fusion import compile as dvm_compile
from hyperparallel.fusion import rotary
from hyperparallel.fusion.canonical import canonicalize
from hyperparallel.fusion.partition import find_clusters

STATS = {"graphs": 0, "clusters": 0, "fused_ops": 0, "backend_seconds": []}


def fuse(gm: GraphModule) -> GraphModule:
    """Replace each fusible cluster of an ATen graph (nodes carrying meta["val"]) by a FusedOp."""
    rotations = rotary.rewrite(gm.graph)
    clusters = find_clusters(gm.graph)
    STATS["graphs"] += 1
    STATS["clusters"] += len(clusters)
    if not clusters:
        if rotations:
            gm.recompile()
        return gm
    prefix = "dvm_fused_"
    fuse_by_partitions(gm, [dict.fromkeys(c.nodes) for c in clusters], prefix=prefix, always_return_tuple=True)
    for name, sub in list(gm.named_children()):
        if name.startswith(prefix) and isinstance(sub, GraphModule):
            setattr(gm, name, dvm_compile.build(sub))
            STATS["fused_ops"] += 1
    _cats_into_fused_outputs(gm)
    _views_as_methods(gm)
    gm.recompile()
    return gm


# ATen ops the graph runs around the fused operators, called as the Tensor methods they are: a
# method call skips OpOverload's Python (about 1 us of 2.6 for a view), and a decoder layer's
# graphs run some 150 views, transposes and getitems a step
_METHODS = {
    torch.ops.aten.view.default: "view",  # (not _unsafe_view: its result is no view for autograd)
    torch.ops.aten.t.default: "t", torch.ops.aten.transpose.int: "transpose",
    torch.ops.aten.unsqueeze.default: "unsqueeze", torch.ops.aten.squeeze.dim: "squeeze",
    torch.ops.aten.permute.default: "permute", torch.ops.aten.expand.default: "expand",
    torch.ops.aten.select.int: "select", torch.ops.aten.detach.default: "detach", torch.ops.aten.mm.default: "mm",
}


def _views_as_methods(gm: GraphModule) -> None:
    for node in gm.graph.nodes:
        method = _METHODS.get(node.target) if node.op == "call_function" and not node.kwargs else None
        if method == "expand" and len(node.args) != 2:
            continue  # (expand's `implicit`, passed by position, is no argument of Tensor.expand)
        if method is not None:
            node.op, node.target = "call_method", method


def _cats_into_fused_outputs(gm: GraphModule) -> None:
    """A cat of outputs of one fused operator that nothing else reads (an MoE expert's gate and up
    gradients, cat into the gate_up projection's) is computed in place: the operator writes
    those outputs into the slices of one buffer (FusedOp.pack), which takes the cat's place."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default:
            continue
        parts = list(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        call = parts[0].args[0] if parts and parts[0].op == "call_function" and parts[0].target is operator.getitem \
            else None
        fused = getattr(gm, call.target, None) if call is not None and call.op == "call_module" else None
        if not isinstance(fused, dvm_compile.FusedOp) or not node.meta["val"].is_contiguous():
            continue  # (the buffer is contiguous, as a cat of contiguous parts is)
        if any(p.op != "call_function" or p.target is not operator.getitem or p.args[0] is not call or len(p.users) != 1
               for p in parts):
            continue
        index = fused.pack([p.args[1] for p in parts], dim % node.meta["val"].dim())
        if index is None:
            continue
        with gm.graph.inserting_before(node):
            whole = gm.graph.call_function(operator.getitem, (call, index))
        whole.meta = dict(node.meta)
        node.replace_all_uses_with(whole)
        gm.graph.erase_node(node)
        for p in parts:
            gm.graph.erase_node(p)


def _compile_aten(gm: GraphModule, example_inputs):
    fused = fuse(gm)
    return fused.forward if hasattr(fused, "forward") else fused


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def dvm(gm: GraphModule, example_inputs):
    """The dynamo backend."""
    t0 = time.perf_counter()
    try:
        if _needs_grad(example_inputs):
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.aot_autograd import make_boxed_func
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            def boxed(g, inputs):
                return make_boxed_func(_compile_aten(g, inputs))

            # Inductor's partitioner: cheap element-wise values are recomputed in the backward graph
            # (where they fuse into its clusters) rather than saved by the forward
            return aot_autograd(fw_compiler=boxed, bw_compiler=boxed,
                                partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)
        return _inference(gm, example_inputs)
    finally:
        STATS["backend_seconds"].append(time.perf_counter() - t0)


def _inference(gm: GraphModule, example_inputs):
    """No gradients: Dynamo's own graph, its element-wise nodes rewritten to ATen (canonical.py)."""
    fused = fuse(canonicalize(gm))
    forward = _only_fused_op(fused) or fused.forward  # (not the GraphModule's call: its wrapper costs microseconds)

    def run(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        with torch.no_grad():
            return forward(*args)

    return run


def _only_fused_op(gm: GraphModule):
    """The FusedOp's own call when the graph is nothing but it (its inputs, in order, in; all its
    outputs, in order, out: a chain compiled on its own), else None."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or len(nodes) != len(placeholders) + len(calls) + len(calls[0].users) + 1:
        return None
    op = getattr(gm, calls[0].target)
    output = nodes[-1].args[0]
    if (not isinstance(op, dvm_compile.FusedOp) or op.packs or list(calls[0].args) != placeholders
            or calls[0].kwargs or not isinstance(output, (tuple, list)) or len(output) != len(op.out_kinds)):
        return None
    for i, out in enumerate(output):
        if not (isinstance(out, torch.fx.Node) and out.target is operator.getitem and out.args == (calls[0], i)):
            return None
    return op.forward

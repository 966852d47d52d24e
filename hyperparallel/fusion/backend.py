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
    gm.recompile()
    return gm


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
    forward = fuse(canonicalize(gm)).forward  # (not the GraphModule's call: its wrapper costs microseconds)

    def run(*args):
        with torch.no_grad():
            return forward(*args)

    return run

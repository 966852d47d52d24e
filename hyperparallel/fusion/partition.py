"""Clusters of fusible ATen nodes: grown greedily, never creating a cycle, within limits.

Nodes are visited in graph order; a fusible node joins the cluster of one of its fusible
producers when both work on the same iteration space (the same full shape; a keepdim reduction
and what follows it count as the same space), when merging makes no cycle (no path leaves the
cluster and comes back into it), and when the cluster stays within the limits (ops, inputs,
outputs). Clusters that meet at a node are merged the same way, and so are siblings: clusters of
one space that read a common input.

Dtypes do not split a cluster: the VM computes every value in float32 registers, loads convert
from each input's dtype, and a cast inside the cluster (bf16 work, a cast, fp32 work) is a
rounding instruction, not a trip through memory. A cluster of a single op is not worth a kernel
of ours over ATen's and is left to ATen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from hyperparallel.fusion.ops import ROW_REDUCING, classify, fusible

_MOVES = {torch.ops.aten.expand.default, torch.ops.aten.clone.default}  # nodes that only move values

# A program's size: its tile's scratch grows with the values alive at once, which these bound
MAX_OPS = 64
MAX_INPUTS = 16
MAX_OUTPUTS = 8


@dataclass
class Cluster:
    nodes: list[Node] = field(default_factory=list)
    domain: tuple | None = None  # the full shape every FULL value has

    @property
    def has_reduction(self) -> bool:
        return any(n.target in ROW_REDUCING for n in self.nodes)

    def inputs(self) -> list[Node]:
        members, seen, out = set(self.nodes), set(), []
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in seen:
                    seen.add(a)
                    out.append(a)
        return out

    def outputs(self) -> list[Node]:
        members = set(self.nodes)
        return [n for n in self.nodes if any(u not in members for u in n.users)]


def _shape(node: Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _domain(node: Node) -> tuple:
    """The iteration space a node works in: its output shape, or for a reduction its input's."""
    if node.target in ROW_REDUCING and classify(node) == "reduction":
        return _shape(node.args[0])
    return _shape(node)


def _fits(domain: tuple, node: Node) -> bool:
    """A node joins a space if its own space is it, or its output is a per-row value of it."""
    own = _domain(node)
    if own == domain:
        return True
    return len(own) == len(domain) and own[:-1] == domain[:-1] and own[-1] == 1 and len(domain) > 0


def _reaches(start: list[Node], targets: set[Node], inside: set[Node]) -> bool:
    """Whether any node of `targets` is reachable upstream from `start` through nodes not in `inside`."""
    stack, seen = list(start), set()
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or n in inside:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _creates_cycle(a: Cluster, b: Cluster) -> bool:
    """Merging a and b makes a cycle if a path from one leaves both and enters the other."""
    members = set(a.nodes) | set(b.nodes)
    outside_inputs = [i for n in members for i in n.all_input_nodes if i not in members]
    # a path X -> (outside) -> Y exists iff some outside input of the union depends on the union
    return any(_reaches(i.all_input_nodes, members, set()) for i in outside_inputs)


def _within_limits(nodes: list[Node]) -> bool:
    c = Cluster(nodes)
    return len(nodes) <= MAX_OPS and len(c.inputs()) <= MAX_INPUTS and len(c.outputs()) <= MAX_OUTPUTS


def find_clusters(graph: Graph, *, min_ops: int = 2) -> list[Cluster]:
    """Clusters of fusible nodes of `graph`, in graph order (every node in at most one)."""
    cluster_of: dict[Node, Cluster] = {}
    clusters: list[Cluster] = []
    for node in graph.nodes:
        if not fusible(node):
            continue
        own = Cluster([node], _domain(node))
        cluster_of[node] = own
        clusters.append(own)
        for producer in node.all_input_nodes:
            target = cluster_of.get(producer)
            current = cluster_of[node]
            if target is None or target is current:
                continue
            if not all(_fits(target.domain, n) for n in current.nodes):
                if all(_fits(current.domain, n) for n in target.nodes):
                    target, current = current, target  # the wider space takes the narrower
                else:
                    continue
            merged = sorted(set(target.nodes) | set(current.nodes), key=_order(graph))
            if not _within_limits(merged) or _creates_cycle(target, current):
                continue
            target.nodes = merged
            for n in current.nodes:
                cluster_of[n] = target
            clusters.remove(current)
    _merge_siblings(clusters, graph)
    # a bool result leaving its cluster has nowhere to go: the VM stores floats only
    kept = []
    for c in clusters:
        if any(n.meta["val"].dtype == torch.bool for n in c.outputs()):
            continue
        if len(c.nodes) < min_ops:
            continue
        if all(n.target in _MOVES for n in c.nodes):
            continue  # only copies (GQA's repeated keys: expand, then clone): ATen's copy is as good
        kept.append(c)
    return kept


def _merge_siblings(clusters: list[Cluster], graph: Graph) -> None:
    """Clusters of one space that read a common input and have no path between them become one:
    the input is read once, and one call does the work of two (an MoE expert's backward computes
    the gate's and the up projection's gradients from the same rows; a norm's backward, the
    gradients of its input and of its weight)."""
    order = _order(graph)
    merged_one = True
    while merged_one:
        merged_one = False
        for i, a in enumerate(clusters):
            inputs_a = set(a.inputs())
            for b in clusters[i + 1:]:
                if a.domain != b.domain or not inputs_a & set(b.inputs()):
                    continue
                nodes = sorted(set(a.nodes) | set(b.nodes), key=order)
                if not _within_limits(nodes) or _creates_cycle(a, b):
                    continue
                a.nodes = nodes
                clusters.remove(b)
                merged_one = True
                break
            if merged_one:
                break


def _order(graph: Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__

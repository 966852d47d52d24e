"""Rotary embeddings' rotate_half, found in an ATen graph and made one fusible op.

Hugging Face's `rotate_half(x)` is `cat((-x[..., h:], x[..., :h]), -1)` (h: half the last
dimension): in an ATen graph two slices, a neg and a cat, and in its backward two slices, a neg,
two `slice_backward`s (each a zero-filled tensor and a copy) and an add. Left to ATen, each writes
a tensor the size of q or k and splits rotary's element-wise work over several fused operators.
`rewrite(graph)` replaces the forward pattern by `hyperparallel::dvm_rotate_half(x)` and the
backward one by `neg(dvm_rotate_half(g))` (the transpose of the rotation is its negative; the two
scattered halves have disjoint supports, so their sum may be taken first, whichever order the
graph adds the gradients in), which
DVM lowers to the VM's ROT_HALF instruction (a tile spans whole rows, as for a reduction), so
rotary's forward and backward are one fused operator each. The op's own implementation is the
same cat, for a cluster that runs its ATen graph.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from hyperparallel.kernels.backends import custom_op

aten = torch.ops.aten
_END = 2 ** 63 - 1


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_half_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


rotate_half = custom_op("dvm_rotate_half", _rotate_half, _rotate_half_fake)
ROTATE_HALF = torch.ops.hyperparallel.dvm_rotate_half.default


def _last_dim(node: Node, dim) -> bool:
    ndim = node.meta["val"].dim()
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _slice_of(node, source: Node | None = None) -> tuple[Node, int, int] | None:
    """(x, start, end) when node is x[..., start:end] along the last dimension, step 1."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.slice.Tensor):
        return None
    x, dim, start, end, step = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = dim or 0, start or 0, _END if end is None else end, 1 if step is None else step
    width = x.meta["val"].shape[-1]
    if not all(isinstance(v, int) for v in (start, end, step, width)):
        return None  # symbolic: not a pattern this rewrite knows
    if not _last_dim(x, dim) or step != 1 or (source is not None and x is not source):
        return None
    return x, start, min(end, width)


def _is(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _half(x: Node) -> int | None:
    width = x.meta["val"].shape[-1]
    return width // 2 if isinstance(width, int) and width % 2 == 0 and width > 0 else None


def _forward_match(cat: Node) -> Node | None:
    """x when `cat` is cat((-x[..., h:], x[..., :h]), -1)."""
    if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2:
        return None
    dim = cat.args[1] if len(cat.args) > 1 else 0
    first, second = cat.args[0]
    if not _last_dim(cat, dim) or not _is(first, aten.neg.default):
        return None
    upper, lower = _slice_of(first.args[0]), _slice_of(second)
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    x, h = upper[0], _half(upper[0])
    width = x.meta["val"].shape[-1]
    return x if h is not None and upper[1:] == (h, width) and lower[1:] == (0, h) else None


def _slice_backward_of(node) -> tuple[Node, int, int] | None:
    """(grad, start, end) when node scatters grad into zeros at [..., start:end] of the last dim."""
    if not _is(node, aten.slice_backward.default):
        return None
    grad, sizes, dim, start, end, step = node.args
    if not all(isinstance(v, int) for v in (start, end, step, sizes[-1])) or step != 1 or not _last_dim(node, dim):
        return None
    return grad, start, min(end, sizes[-1])


def _backward_match(high: Node) -> tuple[Node, Node, Node, Node] | None:
    """(g, low, add, other) when `high` is slice_backward(-g[..., :h], at h:) whose only user is
    `add` = other + high, and `low` = slice_backward(g[..., h:], at :h) is in the graph: then
    low + high is -rotate_half(g), whatever the order the gradients were summed in."""
    part = _slice_backward_of(high)
    if part is None or not _is(part[0], aten.neg.default) or len(high.users) != 1:
        return None
    width, h = high.meta["val"].shape[-1], _half(high)
    lower = _slice_of(part[0].args[0])
    if h is None or part[1:] != (h, width) or lower is None or lower[1:] != (0, h):
        return None
    g = lower[0]
    [add] = high.users
    if not _is(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs or add.args[0] is add.args[1]:
        return None
    other = add.args[0] if add.args[1] is high else add.args[1]
    same = (add.meta["val"].shape, add.meta["val"].dtype)
    if not isinstance(other, Node) or (other.meta["val"].shape, other.meta["val"].dtype) != same:
        return None  # the add broadcast or promoted: not a plain sum of gradients
    for user in g.users:  # low: g[..., h:] scattered back at [..., :h]
        upper = _slice_of(user, g)
        if upper is None or upper[1:] != (h, width):
            continue
        for low in user.users:
            if _slice_backward_of(low) == (user, 0, h) and low.meta["val"].shape == high.meta["val"].shape \
                    and _summed_into(low, other):
                return g, low, add, other
    return None


def _summed_into(low: Node, other: Node, depth: int = 16) -> bool:
    """Whether `other` is `low`, or a sum (adds, each read by the next only) that has `low` as a
    term: then low and high are parts of one tensor's gradient (the x of one rotate_half), not
    the rotations of two tensors that happen to share g."""
    if other is low:
        return True
    if depth == 0 or not _is(other, aten.add.Tensor) or other.kwargs or len(other.args) != 2:
        return False
    return any(isinstance(a, Node) and (a is low or (len(a.users) == 1 and _summed_into(low, a, depth - 1)))
               for a in other.args)


def _erase_dead(nodes: list[Node], graph: Graph) -> None:
    for n in nodes:
        if n.graph is graph and not n.users:
            graph.erase_node(n)


def rewrite(graph: Graph) -> int:
    """Replace rotate_half's forward and backward patterns in `graph`; returns how many."""
    count = 0
    for node in list(graph.nodes):
        if node.graph is not graph:
            continue  # erased
        x = _forward_match(node)
        if x is not None:
            first, second = node.args[0]
            with graph.inserting_before(node):
                rot = graph.call_function(ROTATE_HALF, (x,))
            rot.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(rot)
            graph.erase_node(node)
            _erase_dead([first, first.args[0], second], graph)
            count += 1
            continue
        found = _backward_match(node)
        if found is not None:
            g, low, add, other = found
            with graph.inserting_before(low):
                rot = graph.call_function(ROTATE_HALF, (g,))
                neg = graph.call_function(aten.neg.default, (rot,))
            rot.meta["val"] = neg.meta["val"] = low.meta["val"]
            low.replace_all_uses_with(neg)
            add.replace_all_uses_with(other if other is not low else neg)
            graph.erase_node(add)
            dead = [node, node.args[0], node.args[0].args[0], low, low.args[0]]
            _erase_dead(dead, graph)
            count += 1
    return count

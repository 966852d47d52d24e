"""FusedOp's call plans: one per input layout, reused while the layout holds and remade when it
changes; tensors broadcast over middle dimensions (rotary's cos / sin) or transposed walked as
they lie; a layout the VM cannot walk runs the cluster's ATen graph."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyperparallel.fusion import compile as dvm_compile
from hyperparallel.fusion.backend import fuse
from tests.fusion.test_backend import check, x


def _fused(fn, *example):
    """fn traced to ATen and fused, as a GraphModule that takes any layout (no Dynamo guards)."""
    gm = fuse(make_fx(fn, tracing_mode="fake")(*example))
    ops = [m for m in gm.modules() if isinstance(m, dvm_compile.FusedOp)]
    assert len(ops) == 1, gm.graph
    return gm, ops[0]


def _counts():
    s = dvm_compile.STATS
    return s["call_plans_built"], s["fused_calls"], s["aten_calls"]


def _delta(before):
    return tuple(b - a for a, b in zip(before, _counts(), strict=True))


def chain(t, w):
    return torch.sigmoid(t) * w + t


def test_a_plan_is_made_once_per_layout_and_reused():
    gm, op = _fused(chain, x(6, 40), x(40, seed=1))
    before = _counts()
    with torch.no_grad():
        for seed in range(3):
            t, w = x(6, 40, seed=seed), x(40, seed=9)
            torch.testing.assert_close(gm(t, w), chain(t, w), rtol=1e-6, atol=1e-6)
    assert _delta(before) == (1, 3, 0) and len(op.plans) == 1


@pytest.mark.parametrize("layout", ["another shape", "transposed", "a column slice", "bf16"])
def test_a_new_layout_gets_a_new_plan(layout):
    gm, op = _fused(chain, x(6, 40), x(40, seed=1))
    w = x(40, seed=1)
    with torch.no_grad():
        gm(x(6, 40), w)
        t = {"another shape": x(9, 40), "transposed": x(40, 6).t(), "a column slice": x(6, 80)[:, ::2],
             "bf16": x(6, 40)}[layout]
        if layout == "bf16":  # the same shapes and strides, another dtype: the ATen graph runs it
            before = _counts()
            got = gm(t.bfloat16(), w.bfloat16())
            assert got.dtype == torch.bfloat16 and _delta(before)[0] == 1
            return
        before = _counts()
        got = gm(t, w)
        got_again = gm(t, w)
    torch.testing.assert_close(got, chain(t, w), rtol=1e-6, atol=1e-6)
    assert torch.equal(got, got_again)
    assert _delta(before) == (1, 2, 0) and len(op.plans) == 2


def rotary(q, cos, sin):
    """q [B, S, H, D] seen as [B, H, S, D] (a transpose), cos / sin [1, 1, S, D]: Qwen3's rotary."""
    qt = q.transpose(1, 2)
    half = qt.shape[-1] // 2
    rotated = torch.cat((-qt[..., half:], qt[..., :half]), dim=-1)
    return qt * cos + rotated * sin


def _rotary_inputs():
    angles = x(1, 1, 12, 16, seed=1)
    return x(2, 12, 3, 16), angles.cos(), angles.sin()


def test_broadcast_over_middle_dimensions_is_walked_not_copied():
    q, cos, sin = _rotary_inputs()
    gm, op = _fused(rotary, q, cos, sin)
    before = _counts()
    with torch.no_grad():
        got = gm(q, cos, sin)
    torch.testing.assert_close(got, rotary(q, cos, sin), rtol=1e-6, atol=1e-6)
    assert _delta(before) == (1, 1, 0)
    [plan] = op.plans.values()
    # rows walked in the output's memory order, [B, S, H] (ATen lays the result out as q is):
    # cos is broadcast over B and H, so no single stride walks them; the plan keeps (S, H) as
    # row levels of their own
    assert plan.call.tail[2].value == 12 and plan.call.tail[3].value == 3


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rotary_against_eager(dtype, backward):
    check(rotary, *_rotary_inputs(), dtype=dtype, backward=backward)


def test_more_row_levels_than_the_vm_walks_run_the_aten_graph():
    """[2, 3, 4, 5, 8] with the middle dimensions permuted: four row levels no stride merges."""
    a = x(2, 3, 4, 5, 8)
    gm, op = _fused(chain, a, x(8, seed=1))
    scrambled = x(5, 3, 2, 4, 8).permute(2, 1, 3, 0, 4)
    before = _counts()
    with torch.no_grad():
        got = gm(scrambled, x(8, seed=1))
    torch.testing.assert_close(got, chain(scrambled, x(8, seed=1)), rtol=1e-6, atol=1e-6)
    assert _delta(before) == (1, 0, 1)


def _graph_targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_rotate_half_forward_and_backward_are_one_fused_operator_each():
    # Hugging Face's rotate_half is slice, slice, neg, cat in the forward and slice, slice, neg,
    # slice_backward, slice_backward, add in the backward: rotary.py makes each one ROT_HALF, so
    # nothing of rotary is left to ATen but the transpose (a view)
    from hyperparallel.fusion import backend

    q, cos, sin = _rotary_inputs()
    seen = []
    real = backend.fuse

    def spy(gm):
        out = real(gm)
        seen.append(out)
        return out

    backend.fuse = spy
    try:
        torch._dynamo.reset()
        leaf = q.clone().requires_grad_()
        out = torch.compile(rotary, backend="dvm")(leaf, cos, sin)
        out.backward(torch.ones_like(out))
    finally:
        backend.fuse = real
    aten = torch.ops.aten
    assert len(seen) == 2  # forward and backward
    for gm in seen:
        targets = _graph_targets(gm)
        assert not {aten.cat.default, aten.slice_backward.default, aten.neg.default, aten.slice.Tensor} & set(targets)
        assert sum(isinstance(m, dvm_compile.FusedOp) for m in gm.modules()) == 1
    leaf_ref = q.clone().requires_grad_()
    rotary(leaf_ref, cos, sin).backward(torch.ones_like(out))
    torch.testing.assert_close(leaf.grad, leaf_ref.grad, rtol=1e-6, atol=1e-6)


def test_halves_of_two_tensors_are_no_rotate_half():
    # cat((-a[..., h:], b[..., :h])) with a != b: the forward is not rotate_half, and in the
    # backward the two scattered halves belong to two gradients; both stay as they are
    def f(a, b, c, s):
        half = a.shape[-1] // 2
        return a * c + torch.cat((-a[..., half:], b[..., :half]), dim=-1) * s

    args = [x(2, 4, 8, 16, seed=i) for i in range(4)]
    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in args[:2]]
    out = torch.compile(f, backend="dvm")(*leaves, *args[2:])
    out.backward(torch.ones_like(out))
    refs = [t.clone().requires_grad_() for t in args[:2]]
    f(*refs, *args[2:]).backward(torch.ones_like(out))
    for got, want in zip(leaves, refs, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)

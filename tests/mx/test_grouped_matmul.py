"""mx_grouped_mm as one grouped product against the per-group loop it replaced."""

from __future__ import annotations

import pytest
import torch

from hyperparallel import mx
from hyperparallel.mx.matmul import _matmul, _operand, operand_dtype


def loop_rows_mm(a, b, offsets, out_dtype):
    """The old forward / dgrad form: one library matmul per group, after a host sync."""
    av, bv = _operand(a, out_dtype, None), _operand(b, out_dtype, None)
    out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        out[start:end] = _matmul(av[start:end], bv[g], out_dtype, None)
        start = end
    return out, av, bv


def loop_weight_grad_mm(a, b, offsets, out_dtype):
    """The old weight-gradient form."""
    av, bv = _operand(a, out_dtype, None), _operand(b, out_dtype, None)
    out = torch.zeros(len(offsets), a.shape[0], b.shape[1], dtype=out_dtype)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[g] = _matmul(av[:, start:end], bv[start:end], out_dtype, None)
        start = end
    return out, av, bv


def group_spans(offsets):
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


def assert_matches_loop(out, ref, bound):
    """Equal to the loop up to fp32 accumulation order (new and old were measured bitwise equal
    on these shapes; 1e-5 of |a| @ |b| leaves ~100x fp32 eps) plus one flip of the rounding to
    out's dtype."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 * bound + torch.finfo(out.dtype).eps * ref.double().abs()
    err = (out.double() - ref.double()).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item()}"


# (offsets, what they exercise); each group's size is no multiple of anything in particular
OFFSETS = [
    ([5, 5, 40, 77], "empty group, odd sizes"),
    ([0, 77, 77], "one group holding every row"),
    ([0, 0, 0], "zero rows"),
    ([77], "a single group"),
]
# (the operands' dtype, out dtype, K, N); K, N = 48, 5 is not 16-byte aligned; "extreme": fp32
# operands of block scales near both ends of E8M0
DTYPES = [
    (torch.bfloat16, torch.bfloat16, 64, 24),
    (torch.bfloat16, torch.bfloat16, 48, 5),
    (torch.float32, torch.float32, 64, 24),
    (torch.float32, torch.float32, 48, 5),
    ("extreme", torch.float32, 64, 24),
]


def operands(exact, rows, k, n, experts, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(experts, k, n, generator=g)
    dy = torch.randn(rows, n, generator=g)
    if exact == "extreme":
        # block scales near both ends of E8M0 (see test_matmul)
        x = x * 2.0**120
        x[:, 0] = 1.5 * 2.0**127
        w, dy = w * 2.0**-125, dy * 2.0**-125
    return x, w, dy


@pytest.mark.parametrize("exact, out_dtype, k, n", DTYPES)
@pytest.mark.parametrize("ends, _what", OFFSETS)
def test_rows_form_matches_the_per_group_loop(exact, out_dtype, k, n, ends, _what):
    offsets = torch.tensor(ends)
    x, w, _ = operands(exact, ends[-1], k, n, len(ends), seed=len(ends) + k)
    a, b = mx.quantize(x, 1), mx.quantize(w, 1)
    out = mx.mx_grouped_mm(a, b, offsets, out_dtype)
    ref, av, bv = loop_rows_mm(a, b, offsets, out_dtype)
    bound = torch.zeros(ref.shape, dtype=torch.float64)
    for g, (s, e) in enumerate(group_spans(offsets)):
        bound[s:e] = av[s:e].double().abs() @ bv[g].double().abs()
    assert_matches_loop(out, ref, bound)


@pytest.mark.parametrize("exact, out_dtype, k, n", DTYPES)
@pytest.mark.parametrize("ends, _what", OFFSETS)
def test_weight_grad_form_matches_the_per_group_loop(exact, out_dtype, k, n, ends, _what):
    offsets = torch.tensor(ends)
    x, _, dy = operands(exact, ends[-1], k, n, len(ends), seed=len(ends) + n)
    # (grouped scales have unused rows holding byte 0: they scale no data and keep no operand off bf16)
    a, b = mx.quantize_grouped(x, offsets).t(), mx.quantize_grouped(dy, offsets)
    out = mx.mx_grouped_mm(a, b, offsets, out_dtype)
    ref, av, bv = loop_weight_grad_mm(a, b, offsets, out_dtype)
    bound = torch.stack([av[:, s:e].double().abs() @ bv[s:e].double().abs() for s, e in group_spans(offsets)])
    assert_matches_loop(out, ref, bound)
    for g, (s, e) in enumerate(group_spans(offsets)):
        if s == e:
            assert bool((out[g] == 0).all())  # an empty expert gets a zero gradient


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of torch._grouped_mm, torch.bmm and Tensor.tolist (a host sync per call)."""
    counts = {"grouped_mm": 0, "bmm": 0, "tolist": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch, "_grouped_mm", counting("grouped_mm", torch._grouped_mm))
    monkeypatch.setattr(torch, "bmm", counting("bmm", torch.bmm))
    monkeypatch.setattr(torch.Tensor, "tolist", counting("tolist", torch.Tensor.tolist))
    return counts


def both_forms(out_dtype, k, n):
    ends = [5, 5, 40, 77]
    offsets = torch.tensor(ends)
    x, w, dy = operands(out_dtype, ends[-1], k, n, len(ends), seed=3)
    rows = (mx.quantize(x, 1), mx.quantize(w, 1))
    weight_grad = (mx.quantize_grouped(x, offsets).t(), mx.quantize_grouped(dy, offsets))
    return offsets, out_dtype, [rows, weight_grad]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_supported_dtypes_run_one_grouped_mm_per_call_and_no_tolist(calls, out_dtype):
    offsets, out_dtype, forms = both_forms(out_dtype, 64, 32)
    for a, b in forms:
        before = dict(calls)
        mx.mx_grouped_mm(a, b, offsets, out_dtype)
        assert calls["grouped_mm"] - before["grouped_mm"] == 1
        assert calls["bmm"] == before["bmm"] and calls["tolist"] == before["tolist"]


@pytest.mark.parametrize("backend, out_dtype, k, n", [("reference", torch.float32, 64, 32), (None, torch.bfloat16, 48, 5)])
def test_fp64_and_unaligned_shapes_run_one_padded_bmm_per_call(calls, backend, out_dtype, k, n):
    offsets, out_dtype, forms = both_forms(out_dtype, k, n)
    for a, b in forms:
        assert operand_dtype(out_dtype, backend) == (torch.float64 if backend else torch.bfloat16)
        before = dict(calls)
        mx.mx_grouped_mm(a, b, offsets, out_dtype, backend=backend)
        assert calls["bmm"] - before["bmm"] == 1
        assert calls["grouped_mm"] == before["grouped_mm"] and calls["tolist"] == before["tolist"]


def test_rows_form_compiles_to_one_graph_with_one_grouped_mm_and_no_host_sync():
    # An fp32 product, which torch._grouped_mm's own meta function refuses: the custom op keeps it
    # in the graph. The old loop traced too, with a .tolist().
    offsets = torch.tensor([5, 5, 40, 77])
    x, w, _ = operands(torch.float32, 77, 64, 32, 4, seed=5)
    a, b = mx.quantize(x, 1), mx.quantize(w, 1)
    graphs = []

    def recording(gm, example_inputs):
        calls = [node.target for node in gm.graph.nodes if node.op in ("call_function", "call_method")]
        graphs.append([t if isinstance(t, str) else getattr(t, "__name__", str(t)) for t in calls])
        return gm

    product = lambda a, b, o: mx.mx_grouped_mm(a, b, o, torch.float32)  # noqa: E731
    compiled = torch.compile(product, backend=recording, fullgraph=True)
    out = compiled(a, b, offsets)
    torch.testing.assert_close(out, mx.mx_grouped_mm(a, b, offsets, torch.float32), rtol=1e-5, atol=0)
    (ops,) = graphs
    assert sum("mx_grouped_mm_native" in op for op in ops) == 1, ops
    assert not {"tolist", "item", "mm", "bmm"} & set(ops), ops

"""torch.compile(backend="dvm") against eager: ops, chains, forward and backward, dtypes, shapes;
what the partitioner fuses and what it leaves to ATen; a tiny Qwen3 training step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hyperparallel.fusion import backend as dvm_backend
from hyperparallel.fusion import compile as dvm_compile
from hyperparallel.fusion.backend import dvm, fuse

torch._dynamo.config.cache_size_limit = 512

# fp32: the VM's exp/tanh/erf/... are within a few float32 ulp of libm and fp32 chains round like
# eager, so 1e-5 relative; 1e-5 absolute for values near 0, which a row sum with cancellation
# (the gradient of a broadcast input) reaches in another order than eager's. bf16/fp16: eager rounds after every op, the VM
# only where the graph casts and at the end (as Inductor does), so both are compared with the same
# code run in fp32 on the same inputs: the VM must be as close to it as eager is, give or take one
# unit in the last place of the output dtype.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5)}
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_close_or_closer(got, eager, exact, dtype, label=""):
    if dtype == torch.float32:
        torch.testing.assert_close(got, eager, **TOL[dtype], msg=lambda m: f"{label}{m}")
        return
    got, eager, exact = got.float(), eager.float(), exact.float()
    # beyond eager's own error: 4 units of the element and 2 of the tensor's largest value (a
    # gradient summing terms of opposite sign has an error of its terms' size, not its own)
    slack = 4 * ULP[dtype] * exact.abs() + 2 * ULP[dtype] * exact.abs().max()
    worse = (got - exact).abs() > (eager - exact).abs() + slack
    assert not worse.any(), (f"{label}{int(worse.sum())} elements further from the fp32 result than eager's; "
                             f"max {((got - exact).abs() - (eager - exact).abs()).max().item()}")


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=dvm)


def fused_count() -> int:
    return dvm_backend.STATS["fused_ops"]


def _leaves(args, dtype):
    return [a.detach().to(dtype).requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for a in args]


def _run(fn, args, backward, grad_seed=5):
    """Output and input gradients of fn (the output's gradient: fixed random values)."""
    if not backward:
        with torch.no_grad():
            return fn(*args), []
    out = fn(*args)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(g)
    return out.detach(), [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def check(fn, *args, dtype=torch.float32, backward=False, expect_fused=True):
    before = fused_count()
    rounded = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    got = _run(compiled(fn), _leaves(rounded, dtype), backward)
    eager = _run(fn, _leaves(rounded, dtype), backward)
    exact = _run(fn, _leaves(rounded, torch.float32), backward) if dtype != torch.float32 else eager
    for i, (a, b, c) in enumerate(zip([got[0], *got[1]], [eager[0], *eager[1]], [exact[0], *exact[1]], strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close_or_closer(a, b, c, dtype, label="output: " if i == 0 else f"grad {i - 1}: ")
    if expect_fused:
        assert fused_count() > before, "nothing was fused"


def x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": lambda t: torch.log(t.abs() + 0.1),
    "sqrt": lambda t: torch.sqrt(t.abs()), "rsqrt": lambda t: torch.rsqrt(t.abs() + 0.1),
    "reciprocal": lambda t: torch.reciprocal(t + 3.0), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "relu": torch.relu, "erf": torch.erf, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "sin": torch.sin, "cos": torch.cos,
    "log1p": lambda t: torch.log1p(t.abs()), "expm1": torch.expm1,
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 0.5),
    "maximum": torch.maximum, "minimum": torch.minimum, "pow": lambda a, b: torch.pow(a.abs() + 0.1, b),
    "where_gt": lambda a, b: torch.where(a > b, a, b * 2), "where_le": lambda a, b: torch.where(a <= b, a - b, b),
}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_each_unary_op(name, dtype, backward):
    op = UNARY[name]
    check(lambda t: op(t) * 1.5 + 0.25, x(33, 70), dtype=dtype, backward=backward)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_each_binary_op(name, dtype, backward):
    op = BINARY[name]
    check(lambda a, b: op(a, b) - 0.5, x(17, 130), x(17, 130, seed=1), dtype=dtype, backward=backward)


def gelu_tanh_decomposed(t):
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t.pow(3))))


def gelu_erf_decomposed(t):
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2)))


def rmsnorm(t, w):
    tf = t.float()
    return w * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)


CHAINS = {
    "gelu_tanh_decomposed": (gelu_tanh_decomposed, lambda: (x(64, 96),)),
    "gelu_erf_decomposed": (gelu_erf_decomposed, lambda: (x(64, 96),)),
    "silu_decomposed": (lambda t: t * torch.sigmoid(t), lambda: (x(64, 96),)),
    "swiglu": (lambda a, b: F.silu(a) * b, lambda: (x(64, 96), x(64, 96, seed=1))),
    "rmsnorm": (rmsnorm, lambda: (x(64, 96), x(96, seed=2))),
    "softmax": (lambda t: torch.softmax(t * 2.0, dim=-1), lambda: (x(64, 96),)),
    "softmax_decomposed": (lambda t: (t - t.amax(-1, keepdim=True)).exp() / (t - t.amax(-1, keepdim=True)).exp()
                           .sum(-1, keepdim=True), lambda: (x(64, 96),)),
    "broadcast_row_and_scalar": (lambda t, r: (t - r) * torch.tensor(3.0) + r.exp(), lambda: (x(8, 5, 96), x(8, 5, 1))),
    "odd_shape_3d": (lambda t: torch.tanh(t) * t + 1, lambda: (x(3, 7, 1001),)),
    "one_element": (lambda t: t.exp() + t, lambda: (x(1, 1),)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(CHAINS))
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_chains(name, dtype, backward):
    fn, make = CHAINS[name]
    check(fn, *make(), dtype=dtype, backward=backward)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_cast_chain_to_fp32_and_back(dtype, backward):
    def chain(t):
        y = t.float()
        return (torch.sigmoid(y * 0.5 + 0.1) * y).to(t.dtype)

    check(chain, x(40, 300), dtype=dtype, backward=backward)


def test_cast_chain_keeps_fp32_output_exactly_as_eager_fp32():
    def chain(t):
        return torch.tanh(t.float() * 3) - 1

    check(chain, x(40, 300).bfloat16(), dtype=torch.bfloat16)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_non_contiguous_inputs(backward):
    base = x(96, 64)
    check(lambda t, w: F.silu(t) * w + t, base.t(), x(96, seed=3), backward=backward)
    check(lambda t: torch.sigmoid(t) * 2 - t, base[::2, 1:], backward=backward)


def test_an_opaque_op_splits_the_chain_and_runs_as_aten():
    def fn(a, b):
        h = torch.tanh(a) * 2 + 1
        y = h @ b  # a matmul: opaque, ATen's
        return torch.sigmoid(y) * y - 1

    before = fused_count()
    check(fn, x(16, 32), x(32, 24, seed=1))
    assert fused_count() - before == 2  # the chain before the matmul and the one after


def test_integer_work_is_left_to_aten():
    def fn(a, idx):
        return torch.exp(a) * 2 + (idx * 3).float()

    with torch.no_grad():
        got = compiled(fn)(x(4, 8), torch.arange(32).reshape(4, 8))
    torch.testing.assert_close(got, fn(x(4, 8), torch.arange(32).reshape(4, 8)))


def test_no_cycles_through_an_opaque_op():
    """a -> b directly and a -> matmul -> b: fusing a with b would make b wait for itself."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyperparallel.fusion.partition import find_clusters

    def fn(t, m):
        a = torch.exp(t) + 1
        mid = a @ m
        return torch.tanh(a) * mid

    gm = make_fx(fn, tracing_mode="fake")(x(8, 8), x(8, 8, seed=1))
    for cluster in find_clusters(gm.graph, min_ops=1):
        names = {n.name for n in cluster.nodes}
        assert not ({"exp", "add"} & names and "mul" in names), names
    check(fn, x(8, 8), x(8, 8, seed=1))


def test_mixed_dtypes_stay_one_fused_operator():
    """bf16 work, a cast to fp32, fp32 work, a cast back: one cluster, the casts rounding
    instructions inside it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyperparallel.fusion import partition
    from hyperparallel.fusion.bytecode import WORDS, Op

    def fn(t):
        y = (t * 2 + 1).float()
        return (torch.sigmoid(y) * y).bfloat16() * 3

    gm = make_fx(fn, tracing_mode="fake")(x(8, 8).bfloat16())
    [cluster] = partition.find_clusters(gm.graph)
    assert {n.meta["val"].dtype for n in cluster.nodes} == {torch.bfloat16, torch.float32}
    dvm_compile._CACHE.clear()
    check(fn, x(8, 8), dtype=torch.bfloat16)
    [program] = [p for p, *_ in dvm_compile._CACHE.values()]
    ops = [program.code[i] for i in range(0, len(program.code), WORDS)]
    # .float() is a copy (the registers are float32 already), .bfloat16() a rounding
    assert Op.COPY in ops and ops.count(Op.ROUND_BF16) == 1


def _long_chain(t):
    for i in range(3 * 64):
        t = t * 1.001 + 0.001 * i
    return t


def _many_inputs(*ts):
    total = ts[0].exp()
    for t in ts[1:]:
        total = total + t.exp()
    return total


def _many_outputs(t):
    u = t.exp()  # (a shared producer: the chains after it would otherwise be clusters of their own)
    return tuple(torch.sigmoid(u * (i + 1)) for i in range(12))


@pytest.mark.parametrize("limit", ["MAX_OPS", "MAX_INPUTS", "MAX_OUTPUTS"])
def test_each_cluster_limit_binds(limit):
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyperparallel.fusion import partition

    fn, args, size = {
        "MAX_OPS": (_long_chain, [x(8, 8)], lambda c: len(c.nodes)),
        "MAX_INPUTS": (_many_inputs, [x(8, 8, seed=i) for i in range(24)], lambda c: len(c.inputs())),
        "MAX_OUTPUTS": (_many_outputs, [x(8, 8)], lambda c: len(c.outputs())),
    }[limit]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    clusters = partition.find_clusters(gm.graph)
    bound = getattr(partition, limit)
    assert len(clusters) >= 2 and max(size(c) for c in clusters) == bound  # split, and filled to the limit
    with torch.no_grad():
        got, want = compiled(fn)(*args), fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_programs_are_cached_by_graph_signature():
    dvm_compile._CACHE.clear()
    built = dvm_compile.STATS["programs_built"]
    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.tanh(t) * 3 + t, backend=dvm)
    with torch.no_grad():
        for shape in ((8, 16), (8, 16), (24, 40), (5, 7, 33)):  # the second compile has dynamic shapes
            t = x(*shape)
            torch.testing.assert_close(fn(t), torch.tanh(t) * 3 + t, rtol=1e-5, atol=1e-6)
    assert dvm_compile.STATS["programs_built"] == built + 1  # one program, whatever the shapes


def test_the_native_vm_runs_when_built():
    from hyperparallel.fusion import vm

    assert vm.LIB is not None, "hyperparallel._dvm_native is not built: run make setup"
    assert dvm_compile._runner() is vm.run


def test_backend_is_registered_by_name():
    assert "dvm" in torch._dynamo.list_backends()


def test_tiny_qwen3_training_step_matches_eager():
    from hyperparallel.models import build_model

    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 64}
    eager = build_model("qwen3", config=config, seed=0)
    fused = build_model("qwen3", config=config, seed=0)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    before = fused_count()
    torch._dynamo.reset()
    step = torch.compile(lambda m: m(input_ids=ids, labels=ids).loss, backend=dvm)
    loss = step(fused)
    loss.backward()
    want = eager(input_ids=ids, labels=ids).loss
    want.backward()
    assert fused_count() > before
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(fused.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # the compiled step really ran on the VM, not on its fused operators' ATen graphs
    calls, aten = dvm_compile.STATS["fused_calls"], dvm_compile.STATS["aten_calls"]
    step(fused).backward()
    assert dvm_compile.STATS["fused_calls"] > calls and dvm_compile.STATS["aten_calls"] == aten


def test_comparisons_and_where_with_numbers():
    """x != -100, 0 < x, where(mask, x, 0.0), where(mask, 1.0, x): the Scalar overloads of ATen."""

    def f(x, targets):
        counted = targets != -100
        positive = 0 < x
        kept = torch.where(counted.unsqueeze(1), x.exp(), 0.0)
        return torch.where(positive, 1.0, kept * 2).sum(dim=1), torch.where(counted, targets, 0)

    x = torch.randn(6, 5)
    targets = torch.tensor([3, -100, 1, -100, 0, 4])
    got = torch.compile(f, backend=dvm)(x, targets)
    want = f(x, targets)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    assert torch.equal(got[1], want[1])


def test_a_row_longer_than_the_vm_reduces_runs_as_aten():
    from hyperparallel.fusion import vm

    if vm.LIB is None:
        pytest.skip("the native VM is not built; the reference interpreter reduces rows of any length")
    x = torch.randn(2, vm.MAX_REDUCE_COLS + 1)
    f = lambda x: torch.softmax(x * 2, dim=-1)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, backend=dvm)(x), f(x), rtol=1e-5, atol=0)


def _vm_calls():
    return dvm_compile.STATS["fused_calls"], dvm_compile.STATS["aten_calls"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_fused_loss_chunk_runs_as_one_fused_operator(dtype):
    """Method reductions with keyword dims, in-place exp_ / mul_ on values the graph made, a
    .float() (on fp32 logits: no copy, as eager) and a bool mask: the loss's element-wise work
    fused, on the VM, in float32 whatever the logits' dtype (as the function says)."""
    from hyperparallel.models.loss import _chunk_loss_and_grad

    logits, targets = x(48, 300).to(dtype), torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(1))
    targets[::7] = -100
    inverse = torch.tensor(1 / 41)
    fn = compiled(_chunk_loss_and_grad)
    before, calls = fused_count(), _vm_calls()
    with torch.no_grad():
        loss, grad = fn(logits, targets, inverse, torch.float32)
    want_loss, want_grad = _chunk_loss_and_grad(logits, targets, inverse, torch.float32)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert fused_count() - before == 2  # the [48, 300] work whole, and the per-row loss
    fused_calls, aten_calls = (b - a for a, b in zip(calls, _vm_calls(), strict=True))
    assert fused_calls == 2 and aten_calls == 0


def test_in_place_ops_on_inputs_keep_their_writes():
    def fn(t, u):
        t.mul_(2)  # an input: the caller sees the write
        return torch.sigmoid(u) * t

    t, u = x(8, 8), x(8, 8, seed=1)
    got_t, want_t = t.clone(), t.clone()
    with torch.no_grad():
        got = compiled(fn)(got_t, u)
    want = fn(want_t, u)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_t, want_t)


def _masked(t, mask):
    return torch.where(mask, torch.exp(t), 0.0) * 2


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_bool_mask_from_outside_the_cluster_is_loaded_by_the_vm(dtype, backward):
    t, mask = x(16, 40), x(16, 40, seed=2) > 0
    calls = _vm_calls()
    check(_masked, t, mask, dtype=dtype, backward=backward)
    assert _vm_calls()[0] > calls[0] and _vm_calls()[1] == calls[1]  # on the VM, not the ATen graph


def _fused_graph(fn, *example):
    from torch.fx.experimental.proxy_tensor import make_fx

    return fuse(make_fx(fn, tracing_mode="fake")(*example))


def _fused_ops(gm) -> list:
    return [m for m in gm.modules() if isinstance(m, dvm_compile.FusedOp)]


def test_sibling_clusters_reading_one_input_become_one_fused_operator():
    # two chains from the same input, joined only by an opaque op after both: two clusters by
    # producer and consumer, one once siblings merge (the input read once, one call)
    def f(a, b):
        left = torch.sigmoid(a) * b
        right = torch.tanh(a) + b
        return torch.mm(left, right.t())

    a, b = x(16, 24), x(16, 24, seed=1)
    gm = _fused_graph(f, a, b)
    assert len(_fused_ops(gm)) == 1
    with torch.no_grad():
        torch.testing.assert_close(gm(a, b), f(a, b), rtol=1e-5, atol=1e-5)


def test_siblings_with_a_path_between_them_stay_apart():
    # the second chain reads the first's result through an opaque op: merging would make a cycle
    def f(a):
        left = torch.sigmoid(a) * a
        right = torch.tanh(torch.mm(left, a.t())) + 1.0
        return right * 2.0

    a = x(16, 16)
    gm = _fused_graph(f, a)
    assert len(_fused_ops(gm)) == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(a), f(a), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_cat_of_fused_outputs_is_computed_in_place(dtype):
    # an MoE expert's backward: the gate's and the up projection's gradients, then cat: the fused
    # operator writes both into the halves of one buffer, and no cat runs
    def f(gate, up, grad):
        s = torch.sigmoid(gate)
        d_gate = grad * up * s * (1 + gate * (1 - s))
        d_up = grad * gate * s
        return torch.cat([d_gate, d_up], dim=-1)

    args = [x(32, 40, seed=i).to(dtype) for i in range(3)]
    gm = _fused_graph(f, *args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.cat.default not in targets
    [op] = _fused_ops(gm)
    assert op.packs == [(1, (0, 1))]
    with torch.no_grad():
        got, want = gm(*args), f(*args)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_a_packed_cat_on_the_aten_path_is_still_a_cat():
    def f(gate, up):
        return torch.cat([torch.sigmoid(gate) * up, torch.tanh(gate) * up], dim=-1)

    args = [x(8, 16, seed=i) for i in range(2)]
    gm = _fused_graph(f, *args)
    [op] = _fused_ops(gm)
    before = dvm_compile.STATS["aten_calls"]
    with torch.no_grad():  # float64: a dtype the program was not written for runs the ATen graph
        got = gm(*[a.double() for a in args])
    assert dvm_compile.STATS["aten_calls"] == before + 1
    torch.testing.assert_close(got, f(*[a.double() for a in args]))


def test_contiguous_of_a_fused_value_and_an_expand_fuse():
    # a norm's backward pattern: a per-row value expanded to the row, and .contiguous() of a
    # transposed result, all in one fused operator
    def f(a, b):  # a transposed: the products are laid out as a is, .contiguous() copies them
        r = (a * b).sum(-1, keepdim=True).expand(a.shape)
        return (torch.sigmoid(a) * r).contiguous(), r * b

    a, b = x(8, 12, 16).transpose(0, 1), x(12, 8, 16, seed=1)
    gm = _fused_graph(f, a, b)
    assert len(_fused_ops(gm)) == 1
    leftover = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.clone.default not in leftover and torch.ops.aten.expand.default not in leftover
    with torch.no_grad():
        got, want = gm(a, b), f(a, b)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_chain_compiled_alone_calls_its_fused_operator_directly():
    # the inference path skips the GraphModule around a graph that is nothing but one fused
    # operator (its inputs in, all its outputs out); any other graph runs as the GraphModule
    alone = _fused_graph(lambda a, b: (torch.sigmoid(a) * b + a,), x(8, 16), x(8, 16, seed=1))
    [op] = _fused_ops(alone)
    assert dvm_backend._only_fused_op(alone) == op.forward
    around = _fused_graph(lambda a, b: (torch.mm(torch.sigmoid(a) * b + a, b.t()),), x(8, 16), x(8, 16, seed=1))
    assert dvm_backend._only_fused_op(around) is None

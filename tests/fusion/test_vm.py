"""The native DVM interpreter (hyperparallel.fusion.vm) on hand-written programs, against eager
PyTorch: every opcode, register kinds and broadcasting, dtypes, strides, odd shapes, special
values, reductions, several outputs, thread counts, instruction sets, and the errors it reports.

Tolerances (fp32, vs eager): operations IEEE rounds exactly (+ - * /, comparisons, max/min, the
bf16/fp16 roundings, loads and stores) must match bitwise (sqrt: the correctly rounded value,
which eager's vectorized sqrt misses by an ulp at times); transcendental functions within
1e-5 relative and 1e-6 absolute (both sides are a few float32 ulp from exact: the per-function
bounds against float64 are tested in test_accuracy_in_ulps); row sums within 1e-5 relative of
the row's absolute sum (a different summation order).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hyperparallel.fusion import reference, vm
from hyperparallel.fusion.bytecode import BINARY, REDUCTIONS, TORCH_DTYPES, UNARY, Kind, Op, Program
from hyperparallel.kernels import use_isa
from tests import instruction_sets

pytestmark = pytest.mark.skipif(vm.LIB is None, reason="hyperparallel._dvm_native is not built")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
isa = instruction_sets.isa  # the fixture: each level the processor has


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def strides(t: torch.Tensor, kind: Kind = Kind.FULL) -> tuple[int, int]:
    """(row, col) strides of a tensor seen over the [rows, cols] space."""
    if kind == Kind.SCALAR or t.dim() == 0:
        return (0, 0)
    if t.dim() == 1:  # a weight: one value per column
        return (0, t.stride(0))
    return (t.stride(0), 0 if t.shape[1] == 1 else t.stride(1))


class P:
    """A small program builder: registers by kind, inputs and outputs by dtype."""

    def __init__(self, in_dtypes=(F32,), out_dtypes=(F32,)):
        self.p = Program(input_dtypes=[TORCH_DTYPES[d] for d in in_dtypes],
                         output_dtypes=[TORCH_DTYPES[d] for d in out_dtypes])

    def load(self, i, kind=Kind.FULL):
        r = self.p.register(kind)
        self.p.emit(Op.LOAD, r, i)
        return r

    def op(self, op, *regs, kind=None):
        if kind is None:
            kind = Kind(min(self.p.register_kinds[r] for r in regs)) if op not in REDUCTIONS else Kind.ROW
        r = self.p.register(kind)
        self.p.emit(op, r, *regs)
        return r

    def const(self, v):
        return self.p.constant(v)

    def store(self, reg, i=0):
        self.p.emit(Op.STORE, 0, reg, i)


def run(b: P, inputs, outputs, rows, cols, in_kinds=None, n_threads=0):
    in_kinds = in_kinds or [Kind.FULL] * len(inputs)
    vm.run(b.p, inputs, outputs, rows, cols, [strides(t, k) for t, k in zip(inputs, in_kinds, strict=True)],
           [strides(t) for t in outputs], n_threads)


def unary_program(op, in_dtype=F32, out_dtype=F32):
    b = P((in_dtype,), (out_dtype,))
    b.store(b.op(op, b.load(0)))
    return b


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, signed zeros alike."""
    a, b = a.float(), b.float()
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


SPECIALS = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-30, -1e-30, 1e-40, -1e-40, 3.0, -3.0, 10.0, -10.0, 20.0, -20.0,
            88.0, -88.0, 88.8, -88.8, 100.0, -100.0, 1e4, -1e4, 1e10, -1e10, 3e38, -3e38,
            math.inf, -math.inf, math.nan]

TORCH_UNARY = {
    Op.NEG: torch.neg, Op.ABS: torch.abs, Op.EXP: torch.exp, Op.LOG: torch.log, Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt, Op.RECIP: torch.reciprocal, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid,
    Op.RELU: torch.relu, Op.ERF: torch.erf, Op.SILU: F.silu, Op.GELU_ERF: F.gelu,
    Op.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"), Op.SIN: torch.sin, Op.COS: torch.cos,
    Op.LOG1P: torch.log1p, Op.EXPM1: torch.expm1, Op.ROUND_BF16: lambda x: x.bfloat16().float(),
    Op.ROUND_F16: lambda x: x.half().float(), Op.COPY: lambda x: x.clone(),
}
EXACT_UNARY = {Op.NEG, Op.ABS, Op.SQRT, Op.RSQRT, Op.RECIP, Op.RELU, Op.ROUND_BF16, Op.ROUND_F16, Op.COPY}


def unary_inputs(op, n=5000, seed=0):
    g = gen(seed)
    x = torch.cat([torch.randn(n, generator=g) * 4, torch.randn(n, generator=g) * 30,
                   torch.rand(n, generator=g) * 1e-3, torch.tensor(SPECIALS)])
    if op in (Op.SIN, Op.COS):
        x = torch.cat([x, torch.randn(n, generator=g) * 1e5, torch.randn(100, generator=g) * 1e7])
    return x


def test_every_opcode_is_tested():
    assert set(TORCH_UNARY) == UNARY
    assert set(TORCH_BINARY) == BINARY


@pytest.mark.parametrize("op", sorted(UNARY), ids=lambda o: o.name)
def test_unary_fp32_vs_eager(op, isa):
    x = unary_inputs(op)
    cols = 97  # rows of 97: vector remainders in every row
    x = x[: x.numel() // cols * cols].reshape(-1, cols)
    out = torch.empty_like(x)
    run(unary_program(op), [x], [out], *x.shape)
    ref = TORCH_UNARY[op](x)
    if op == Op.SQRT:  # correctly rounded (eager's vectorized sqrt is not always)
        assert bitwise_equal(out, torch.sqrt(x.double()).float())
        torch.testing.assert_close(out, ref, rtol=2e-7, atol=0, equal_nan=True)
    elif op in EXACT_UNARY:
        assert bitwise_equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("op", sorted(UNARY), ids=lambda o: o.name)
def test_unary_special_values(op, isa):
    """inf, -inf, NaN, zeros, huge and tiny: NaN exactly where eager gives NaN, infinities alike."""
    x = torch.tensor(SPECIALS + [-87.0, -90.0, -104.0, 89.0, 1e-38, 2.0**20, 2.0**21, -2.0**21, 1e30])
    out = torch.empty_like(x)
    run(unary_program(op), [x], [out], 1, x.numel())
    ref = TORCH_UNARY[op](x)
    if op == Op.GELU_ERF:
        # 0.5 x (1 + erf(x / sqrt 2)) is x for x = +inf and 3e38; eager gives NaN and inf there
        big = x > 1e38
        assert torch.equal(out[big], x[big])
        x, out, ref = x[~big], out[~big], ref[~big]
    assert torch.equal(out.isnan(), ref.isnan()), (x[out.isnan() != ref.isnan()], out, ref)
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[out.isinf()], ref[ref.isinf()])
    # sigmoid(-88) = 6e-39: the VM flushes results below 2^-126 to zero there; gelu_tanh(-10) is
    # -4e-8 in eager's float formula, -1e-30 in fact
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_saturation_and_limits():
    x = torch.tensor([[-1e30, -200.0, -89.0, 89.0, 200.0, 1e30, -math.inf, math.inf]])
    out = torch.empty_like(x)
    run(unary_program(Op.EXP), [x], [out], *x.shape)
    assert out.tolist()[0] == [0.0, 0.0, pytest.approx(math.exp(-89.0), rel=1e-6), math.inf, math.inf, math.inf,
                               0.0, math.inf]
    for op, want in ((Op.TANH, [-1, -1, -1, 1, 1, 1, -1, 1]), (Op.ERF, [-1, -1, -1, 1, 1, 1, -1, 1]),
                     (Op.SIGMOID, [0, 0, None, 1, 1, 1, 0, 1])):
        run(unary_program(op), [x], [out], *x.shape)
        assert not out.isnan().any()
        for got, w in zip(out.tolist()[0], want, strict=True):
            if w is not None:
                assert got == w, (op.name, out)


# ---------------------------------------------------------------- accuracy against float64

def exact_f64(op, x64):
    return {
        Op.EXP: torch.exp, Op.EXPM1: torch.expm1, Op.LOG: torch.log, Op.LOG1P: torch.log1p, Op.TANH: torch.tanh,
        Op.SIGMOID: torch.sigmoid, Op.ERF: torch.erf, Op.SIN: torch.sin, Op.COS: torch.cos,
        Op.SILU: lambda x: x * torch.sigmoid(x),
        Op.GELU_ERF: lambda x: 0.5 * x * torch.special.erfc(-x / math.sqrt(2)),
        Op.GELU_TANH: lambda x: x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)),
    }[op](x64)


# op: (input range, max ulp). The ranges leave out where the result underflows (sigmoid and the
# SiLU below -87 flush to 0 what is below 2^-126) and, for the GELUs, where the float32 argument's
# own rounding dominates (x << 0, a tiny result; there eager has large relative errors too).
ULP_BOUNDS = {
    Op.EXP: ((-103.0, 88.7), 1.0), Op.EXPM1: ((-20.0, 88.7), 2.0), Op.LOG: ((1e-38, 3e38), 1.0),
    Op.LOG1P: ((-0.999, 1e30), 2.0), Op.TANH: ((-12.0, 12.0), 2.0), Op.SIGMOID: ((-87.0, 30.0), 3.0),
    Op.ERF: ((-5.0, 5.0), 3.0), Op.SIN: ((-1e5, 1e5), 2.0), Op.COS: ((-1e5, 1e5), 2.0),
    Op.SILU: ((-80.0, 100.0), 3.5), Op.GELU_ERF: ((-1.0, 100.0), 3.0), Op.GELU_TANH: ((-1.0, 100.0), 3.5),
}


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    ref = exact.float().abs()
    ulp = (torch.nextafter(ref, torch.tensor(math.inf)) - ref).double()
    return (got.double() - exact).abs() / ulp


@pytest.mark.parametrize("op", sorted(ULP_BOUNDS), ids=lambda o: o.name)
def test_accuracy_in_ulps(op, isa):
    (lo, hi), bound = ULP_BOUNDS[op]
    g = gen(1)
    n = 200_000
    uniform = lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)
    # and log-spaced magnitudes of both signs, to reach tiny and huge values
    mags = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-30), math.log(max(abs(lo), abs(hi))),
                                                                   generator=g))
    signed = mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = torch.cat([uniform, signed]).float()
    x = x[(x >= lo) & (x <= hi)]
    out = torch.empty_like(x)
    run(unary_program(op), [x], [out], 1, x.numel())
    err = ulp_error(out, exact_f64(op, x.double()))
    worst = int(err.argmax())
    assert err.max() <= bound, f"{op.name}: {err.max().item():.2f} ulp at x={x[worst].item()!r}"


# ---------------------------------------------------------------- binary, where, kinds

TORCH_BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div, Op.MAX: torch.maximum,
    Op.MIN: torch.minimum, Op.POW: torch.pow,
    Op.GT: lambda a, b: (a > b).float(), Op.GE: lambda a, b: (a >= b).float(), Op.LT: lambda a, b: (a < b).float(),
    Op.LE: lambda a, b: (a <= b).float(), Op.EQ: lambda a, b: (a == b).float(), Op.NE: lambda a, b: (a != b).float(),
}
KIND_PAIRS = [(Kind.FULL, Kind.FULL), (Kind.FULL, Kind.ROW), (Kind.ROW, Kind.FULL), (Kind.FULL, Kind.SCALAR),
              (Kind.SCALAR, Kind.FULL), (Kind.ROW, Kind.ROW), (Kind.ROW, Kind.SCALAR), (Kind.SCALAR, Kind.ROW),
              (Kind.SCALAR, Kind.SCALAR)]


def operand(kind, rows, cols, g, special=True):
    shape = {Kind.FULL: (rows, cols), Kind.ROW: (rows, 1), Kind.SCALAR: ()}[kind]
    t = torch.randn(shape, generator=g) * 3
    if special and kind == Kind.FULL:
        t.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
    if kind != Kind.SCALAR:
        t.view(-1)[1::7] = t.view(-1)[::7][: t.view(-1)[1::7].numel()]  # equal pairs for EQ/GE
    return t


@pytest.mark.parametrize("op", sorted(BINARY), ids=lambda o: o.name)
@pytest.mark.parametrize("kinds", KIND_PAIRS, ids=lambda k: f"{k[0].name}-{k[1].name}")
def test_binary_every_kind(op, kinds):
    rows, cols = 13, 45
    g = gen(2)
    a, b = operand(kinds[0], rows, cols, g), operand(kinds[1], rows, cols, g)
    if op == Op.POW:
        a = a.abs() if kinds[1] != Kind.SCALAR else a
        b = b.round() if kinds[0] == Kind.FULL else b  # integral exponents too
    prog = P((F32, F32))
    prog.store(prog.op(op, prog.load(0, kinds[0]), prog.load(1, kinds[1])))
    out = torch.empty(rows, cols)
    run(prog, [a, b], [out], rows, cols, in_kinds=list(kinds))
    ref = TORCH_BINARY[op](a, b).expand(rows, cols)
    if op == Op.POW:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-30, equal_nan=True)
    else:
        assert bitwise_equal(out, ref), (op.name, kinds)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -0.5, -1.0, -2.0, 0.0, 1.0, 1.7, -2.5, 4.0])
def test_pow_scalar_exponents(exponent):
    x = torch.cat([torch.rand(500, generator=gen(3)) * 10, -torch.rand(50, generator=gen(4)),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 2.0])])[None]
    prog = P()
    prog.store(prog.op(Op.POW, prog.load(0), prog.const(exponent)))
    out = torch.empty_like(x)
    run(prog, [x], [out], *x.shape)
    want = torch.tensor([_powf(v, exponent) for v in x[0].tolist()])
    # powf of glibc is within one ulp: 2^-23 relative
    torch.testing.assert_close(out[0], want, rtol=1.2e-7 if exponent == int(exponent) else 2.4e-7, atol=0,
                               equal_nan=True)


def _powf(x: float, y: float) -> float:
    """C's powf on a float32 x (IEEE special cases), rounded to float32."""
    if y == 0:
        return 1.0
    if math.isnan(x) or math.isnan(y):
        return math.nan
    try:
        v = x**y
    except ZeroDivisionError:  # 0 ** negative
        v = math.copysign(math.inf, x) if y == int(y) and int(y) % 2 else math.inf
    except OverflowError:
        v = math.inf
    if isinstance(v, complex):
        return math.nan
    return torch.tensor(v, dtype=torch.float64).float().item()


@pytest.mark.parametrize("kinds", [(Kind.FULL, Kind.FULL, Kind.FULL), (Kind.FULL, Kind.ROW, Kind.SCALAR),
                                   (Kind.ROW, Kind.FULL, Kind.ROW), (Kind.SCALAR, Kind.SCALAR, Kind.FULL),
                                   (Kind.ROW, Kind.ROW, Kind.SCALAR), (Kind.SCALAR, Kind.ROW, Kind.FULL),
                                   (Kind.SCALAR, Kind.SCALAR, Kind.SCALAR)], ids=str)
def test_where_every_kind(kinds):
    rows, cols = 11, 37
    g = gen(5)
    c, x, y = (operand(k, rows, cols, g, special=False) for k in kinds)
    c = (c > 0).float() * torch.where(c > 1, math.nan, 1.0)  # NaN counts as true (!= 0)
    prog = P((F32, F32, F32))
    prog.store(prog.op(Op.WHERE, *(prog.load(i, k) for i, k in enumerate(kinds))))
    out = torch.empty(rows, cols)
    run(prog, [c, x, y], [out], rows, cols, in_kinds=list(kinds))
    assert bitwise_equal(out, torch.where(c != 0, x, y).expand(rows, cols))


def test_comparisons_and_max_min_with_nan():
    a = torch.tensor([[1.0, math.nan, 2.0, math.nan, -0.0, math.inf, -math.inf]])
    b = torch.tensor([[math.nan, 1.0, 2.0, math.nan, 0.0, 1.0, 1.0]])
    for op in (Op.MAX, Op.MIN, Op.GT, Op.GE, Op.LT, Op.LE, Op.EQ, Op.NE):
        prog = P((F32, F32))
        prog.store(prog.op(op, prog.load(0), prog.load(1)))
        out = torch.empty_like(a)
        run(prog, [a, b], [out], *a.shape)
        ref = TORCH_BINARY[op](a, b)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True, msg=op.name)


# ---------------------------------------------------------------- dtypes

def test_loads_of_every_bf16_and_fp16_value(isa):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in (BF16, F16):
        x = bits.view(dtype).reshape(256, 256)
        out = torch.empty(256, 256)
        run(unary_program(Op.COPY, dtype, F32), [x], [out], 256, 256)
        assert bitwise_equal(out, x.float())


def rounding_cases(g) -> torch.Tensor:
    """fp32 values around every rounding decision of bf16 and fp16: random bit patterns of all
    exponents (subnormals included), exact ties, the overflow thresholds, specials."""
    rand = torch.randint(-2**31, 2**31, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(F32)
    # ties: a bf16 / fp16 value plus exactly half of its ulp, and one fp32 ulp either side
    base = torch.randn(20_000, generator=g) * torch.exp2(torch.randint(-30, 20, (20_000,), generator=g).float())
    tie16 = base.bfloat16().float().view(torch.int32) + 0x8000
    half = base.half().float()
    tie_h = half + torch.where(half == 0, 2.0**-25, torch.nextafter(half.half(), torch.tensor(math.inf, dtype=F16))
                               .float().sub(half).abs() / 2)
    edges = torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 3.3895e38, 3.4028e38, 5.96e-8, 2.98e-8, 2.99e-8,
                          6.1e-5, 1e-45, -1e-45, 0.0, -0.0, math.inf, -math.inf, math.nan])
    return torch.cat([rand, tie16.view(F32), tie16.add(1).view(F32), tie16.sub(1).view(F32), tie_h, edges])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_stores_round_like_torch(dtype, isa):
    x = rounding_cases(gen(6))
    x = x[: x.numel() // 64 * 64].reshape(-1, 64)
    out = torch.empty(x.shape, dtype=dtype)
    run(unary_program(Op.COPY, F32, dtype), [x], [out], *x.shape)
    assert bitwise_equal(out, x.to(dtype))
    # the rounding instruction rounds the same way
    out32 = torch.empty_like(x)
    run(unary_program(Op.ROUND_BF16 if dtype == BF16 else Op.ROUND_F16), [x], [out32], *x.shape)
    assert bitwise_equal(out32, x.to(dtype).float())


def test_large_outputs_stream_and_round_alike():
    """Outputs of 16 MiB and more take the non-temporal store path."""
    x = torch.randn(1024 + 3, 4099, generator=gen(7))
    for dtype in (F32, BF16, F16):
        out = torch.empty(x.shape, dtype=dtype)
        run(unary_program(Op.NEG, F32, dtype), [x], [out], *x.shape)
        assert bitwise_equal(out, (-x).to(dtype))
        view = torch.empty(x.shape[0], x.shape[1] + 5, dtype=dtype)[:, 2:-3]  # rows not aligned
        run(unary_program(Op.NEG, F32, dtype), [x], [view], *x.shape)
        assert bitwise_equal(view, (-x).to(dtype))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_low_precision_chain_rounds_once(dtype):
    """bf16/fp16 in and out, fp32 in between: the fp32 result of the chain rounded once."""
    x = (torch.randn(64, 300, generator=gen(8)) * 2).to(dtype)
    w = torch.randn(300, generator=gen(9)).to(dtype)
    prog = P((dtype, dtype), (dtype,))
    xr, wr = prog.load(0), prog.load(1)
    prog.store(prog.op(Op.MUL, prog.op(Op.SILU, xr), wr))
    out = torch.empty_like(x)
    run(prog, [x, w], [out], *x.shape)
    exact = (F.silu(x.double()) * w.double()).to(dtype)
    # within one unit of the correctly rounded result (the fp32 work is a few fp32 ulp off)
    ulp = (torch.nextafter(exact.abs(), torch.tensor(math.inf, dtype=dtype)) - exact.abs()).float()
    assert ((out.float() - exact.float()).abs() <= ulp).all()


def test_cast_chain_bf16_fp32_bf16():
    """bf16 -> fp32 math -> an explicit fp16 rounding -> bf16: ROUND_F16 where the graph casts."""
    x = (torch.randn(33, 129, generator=gen(10)) * 3).to(BF16)
    prog = P((BF16,), (BF16, F32))
    xr = prog.load(0)
    y = prog.op(Op.ADD, prog.op(Op.MUL, prog.op(Op.SIGMOID, xr), xr), prog.const(1.0))
    y16 = prog.op(Op.ROUND_F16, y)
    prog.store(y16, 0)
    prog.store(y16, 1)
    out, out32 = torch.empty_like(x), torch.empty(x.shape)
    run(prog, [x], [out, out32], *x.shape)
    ref16 = (torch.sigmoid(x.float()) * x.float() + 1.0).half()
    torch.testing.assert_close(out32, ref16.float(), rtol=1e-3, atol=0)  # at most one fp16 ulp apart
    assert bitwise_equal(out, out32.to(BF16))


# ---------------------------------------------------------------- broadcasting and strides

def test_broadcast_weights_rows_and_scalars():
    rows, cols = 37, 301
    g = gen(11)
    x = torch.randn(rows, cols, generator=g)
    w = torch.randn(cols, generator=g)  # per column
    r = torch.randn(rows, 1, generator=g)  # per row
    s = torch.tensor(1.5)  # scalar
    prog = P((F32,) * 6)
    xr, wr, rr, sr = prog.load(0), prog.load(1), prog.load(2, Kind.ROW), prog.load(3, Kind.SCALAR)
    rf, sf = prog.load(4), prog.load(5)  # the same per-row value and scalar into FULL registers
    y = prog.op(Op.MUL, prog.op(Op.ADD, prog.op(Op.MUL, xr, wr), rr), sr)
    prog.store(prog.op(Op.SUB, prog.op(Op.ADD, y, rf), sf))
    out = torch.empty(rows, cols)
    run(prog, [x, w, r, s, r, s], [out], rows, cols,
        in_kinds=[Kind.FULL, Kind.FULL, Kind.ROW, Kind.SCALAR, Kind.FULL, Kind.SCALAR])
    ref = ((x * w + r) * s + r) - s
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_strided_inputs_and_outputs():
    """A transposed view, every other column, a sliced window: read and written in place."""
    g = gen(12)
    base = torch.randn(300, 200, generator=g)
    xt = base.t()  # [200, 300], row stride 1, col stride 200
    cols2 = torch.randn(200, 600, generator=g)[:, ::2]  # col stride 2
    out_t = torch.zeros(300, 200).t()  # written through a transposed view
    prog = P((F32, F32), (F32, BF16))
    y = prog.op(Op.MUL, prog.op(Op.TANH, prog.load(0)), prog.load(1))
    prog.store(y, 0)
    prog.store(y, 1)
    out_b = torch.zeros(200, 310, dtype=BF16)[:, 5:305]
    run(prog, [xt, cols2], [out_t, out_b], 200, 300)
    ref = torch.tanh(xt) * cols2
    torch.testing.assert_close(out_t, ref, rtol=1e-5, atol=1e-6)
    assert bitwise_equal(out_b, out_t.to(BF16))


def _levels(t: torch.Tensor, shape) -> tuple[int, int, int, int]:
    """(outer, middle, inner, col) strides of t broadcast to a 4-D `shape`."""
    e = t.expand(shape)
    return tuple(0 if n == 1 else st for n, st in zip(shape, e.stride(), strict=True))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_nested_rows_walk_broadcast_middle_dimensions_and_transposes(dtype, isa):
    """q [B, S, H, D] seen as [B, H, S, D], cos [1, 1, S, D], a per-row norm [B, H, S, 1]: three
    row levels; against eager and the reference interpreter, with a ROW output and a bf16 one."""
    g = gen(21)
    B, H, S, D = 3, 4, 37, 24
    q = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2)
    cos = torch.randn(1, 1, S, D, generator=g)
    norm = torch.randn(B, H, S, 1, generator=g).to(dtype)
    shape = (B, H, S, D)
    prog = P((dtype, F32, dtype), (F32, BF16, F32))
    y = prog.op(Op.ADD, prog.op(Op.MUL, prog.load(0), prog.load(1)), prog.load(2, Kind.ROW))
    prog.store(y, 0)
    prog.store(prog.op(Op.TANH, y), 1)
    prog.store(prog.op(Op.RSUM, y), 2)
    in_st = [_levels(q, shape), _levels(cos, shape), _levels(norm, shape)[:3] + (0,)]
    outs = [torch.empty(B, H, D, S).transpose(2, 3), torch.empty(shape, dtype=BF16), torch.empty(B, H, S, 1)]
    want = [torch.empty_like(o) for o in outs]
    out_st = [_levels(outs[0], shape), _levels(outs[1], shape), _levels(outs[2], shape)[:3] + (0,)]
    vm.run(prog.p, [q, cos, norm], outs, B * H * S, D, in_st, out_st, row_dims=(H, S))
    reference.run(prog.p, [q, cos, norm], want, B * H * S, D, in_st, out_st, row_dims=(H, S))
    eager = q.float() * cos + norm.float()
    torch.testing.assert_close(outs[0], eager, rtol=1e-6, atol=1e-6)
    assert bitwise_equal(outs[0], want[0])  # (a product and a sum: exact, so equal bitwise)
    torch.testing.assert_close(outs[1].float(), eager.tanh(), rtol=2**-8, atol=1e-6)  # (one bf16 rounding)
    torch.testing.assert_close(outs[2], eager.sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)


def test_results_computed_in_their_output_match_stored_ones():
    """Direct stores (a result only a STORE reads, into an fp32 output) against the VM with them
    off: bitwise equal, on a space whose tiles are and are not contiguous in the output."""
    g = gen(22)
    for rows, cols, out in [(64, 300, torch.empty(64, 300)), (64, 300, torch.empty(64, 310)[:, 3:303])]:
        a, b = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
        prog = P((F32, F32), (F32,))
        prog.store(prog.op(Op.MUL, prog.op(Op.SILU, prog.load(0)), prog.load(1)))
        run(prog, [a, b], [out], rows, cols)
        old = vm.LIB.hp_dvm_tune(32)
        try:
            off = torch.empty(rows, cols)
            run(prog, [a, b], [off], rows, cols)
        finally:
            vm.LIB.hp_dvm_tune(old)
        assert bitwise_equal(out, off)
        torch.testing.assert_close(out, F.silu(a) * b, rtol=1e-5, atol=1e-6)


def test_row_levels_that_do_not_divide_the_rows_are_refused():
    prog = unary_program(Op.NEG)
    x, out = torch.randn(10, 4), torch.empty(10, 4)
    with pytest.raises(vm.VMError, match="negative size"):
        vm.run(prog.p, [x], [out], 10, 4, [(4, 1)], [(4, 1)], row_dims=(3, 1))


def test_bf16_strided_load_and_fp16_strided_store():
    x = torch.randn(50, 70, generator=gen(13)).to(BF16).t()
    out = torch.empty(50, 70, dtype=F16).t()
    run(unary_program(Op.ABS, BF16, F16), [x], [out], 70, 50)
    assert bitwise_equal(out, x.abs().half())


@pytest.mark.parametrize("shape", [(1, 1), (1, 100_000), (3, 5), (17, 2049), (2049, 3), (5, 4097), (1000, 1)])
def test_odd_shapes(shape):
    rows, cols = shape
    g = gen(14)
    x, b = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    prog = P((F32, F32))
    prog.store(prog.op(Op.MUL, prog.op(Op.SILU, prog.load(0)), prog.load(1)))
    out = torch.empty(rows, cols)
    run(prog, [x, b], [out], rows, cols)
    torch.testing.assert_close(out, F.silu(x) * b, rtol=1e-5, atol=1e-6)


def test_empty_space_writes_nothing():
    x = torch.empty(0, 5)
    run(unary_program(Op.EXP), [x], [torch.empty(0, 5)], 0, 5)


# ---------------------------------------------------------------- reductions

def rmsnorm_program(dtype, cols, eps=1e-6):
    prog = P((dtype, dtype), (dtype,))
    x, w = prog.load(0), prog.load(1)
    mean = prog.op(Op.MUL, prog.op(Op.RSUM, prog.op(Op.MUL, x, x)), prog.const(1.0 / cols))
    r = prog.op(Op.RSQRT, prog.op(Op.ADD, mean, prog.const(eps)))
    prog.store(prog.op(Op.MUL, prog.op(Op.MUL, x, r), w))
    return prog


def softmax_program(dtype):
    prog = P((dtype,), (dtype,))
    x = prog.load(0)
    e = prog.op(Op.EXP, prog.op(Op.SUB, x, prog.op(Op.RMAX, x)))
    prog.store(prog.op(Op.DIV, e, prog.op(Op.RSUM, e)))
    return prog


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(64, 4096), (7, 1), (3, 100_000), (129, 33), (1, 5000)])
def test_rmsnorm(dtype, shape):
    rows, cols = shape
    g = gen(15)
    x, w = torch.randn(rows, cols, generator=g).to(dtype), torch.randn(cols, generator=g).to(dtype)
    out = torch.empty_like(x)
    run(rmsnorm_program(dtype, cols), [x, w], [out], rows, cols)
    xf = x.float()
    ref = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6) * w.float()
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # the fp32 result rounded once: within one bf16 ulp of it
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(32, 1000), (5, 1), (2, 70_000), (300, 7)])
def test_softmax(dtype, shape):
    x = (torch.randn(shape, generator=gen(16)) * 5).to(dtype)
    x[0, 0] = 80.0  # exp(80 - max) without overflow thanks to the max
    out = torch.empty_like(x)
    run(softmax_program(dtype), [x], [out], *shape)
    ref = torch.softmax(x.float(), -1)
    if dtype == F32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-7)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-7)


@pytest.mark.parametrize("cols", [1, 3, 16, 17, 1000, 4097])
def test_reductions_with_nan_and_inf(cols):
    rows = 6
    x = torch.randn(rows, cols, generator=gen(17)) * 100
    x[1, -1] = math.nan
    x[2, 0] = math.inf
    x[3, cols // 2] = -math.inf
    x[4, :] = -math.inf
    prog = P((F32,), (F32, F32, F32))
    xr = prog.load(0)
    for i, op in enumerate((Op.RSUM, Op.RMAX, Op.RMIN)):
        prog.store(prog.op(op, xr), i)
    outs = [torch.empty(rows, 1) for _ in range(3)]  # per-row outputs: col stride 0
    run(prog, [x], outs, rows, cols)
    s, mx, mn = outs
    torch.testing.assert_close(mx, x.amax(-1, keepdim=True), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(mn, x.amin(-1, keepdim=True), rtol=0, atol=0, equal_nan=True)
    ref = x.double().sum(-1, keepdim=True)
    finite = ref.isfinite()
    torch.testing.assert_close(s[~finite], ref[~finite].float(), rtol=0, atol=0, equal_nan=True)
    scale = x.double().abs().sum(-1, keepdim=True)[finite]
    assert ((s.double()[finite] - ref[finite]).abs() <= 1e-6 * scale).all()


def test_reduction_of_per_row_and_scalar_values():
    """A ROW or SCALAR operand is a value repeated along the row: sum = cols * value."""
    rows, cols = 9, 40
    r = torch.randn(rows, 1, generator=gen(18))
    prog = P((F32, F32), (F32, F32))
    rr, sr = prog.load(0, Kind.ROW), prog.load(1, Kind.SCALAR)
    prog.store(prog.op(Op.RSUM, rr), 0)
    prog.store(prog.op(Op.RMAX, sr), 1)
    o0, o1 = torch.empty(rows, 1), torch.empty(rows, 1)
    run(prog, [r, torch.tensor(2.5)], [o0, o1], rows, cols, in_kinds=[Kind.ROW, Kind.SCALAR])
    torch.testing.assert_close(o0, r * cols)
    assert (o1 == 2.5).all()


# ---------------------------------------------------------------- programs as a whole

def test_nan_and_inf_flow_through_a_chain():
    x = torch.tensor([[math.nan, math.inf, -math.inf, 1.0, 0.0, -2.0, 1e38]])
    prog = P()
    xr = prog.load(0)
    y = prog.op(Op.ADD, prog.op(Op.MUL, prog.op(Op.EXP, xr), prog.const(2.0)), prog.op(Op.TANH, xr))
    prog.store(prog.op(Op.DIV, y, prog.op(Op.ABS, xr)))
    out = torch.empty_like(x)
    run(prog, [x], [out], *x.shape)
    ref = (torch.exp(x) * 2.0 + torch.tanh(x)) / x.abs()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0, equal_nan=True)


def test_several_outputs_of_each_kind():
    rows, cols = 21, 130
    x = torch.randn(rows, cols, generator=gen(19))
    prog = P((F32,), (F32, BF16, F32, F16, F32))
    xr = prog.load(0)
    sq = prog.op(Op.MUL, xr, xr)
    total = prog.op(Op.RSUM, sq)
    prog.store(sq, 0)
    prog.store(prog.op(Op.SIGMOID, xr), 1)
    prog.store(total, 2)  # per row, into a [rows, 1] output
    prog.store(total, 3)  # per row, repeated along a full fp16 output
    prog.store(prog.const(7.0), 4)  # a scalar into a full output
    outs = [torch.empty(rows, cols), torch.empty(rows, cols, dtype=BF16), torch.empty(rows, 1),
            torch.empty(rows, cols, dtype=F16), torch.empty(rows, cols)]
    run(prog, [x], outs, rows, cols)
    assert bitwise_equal(outs[0], x * x)
    torch.testing.assert_close(outs[1].float(), torch.sigmoid(x).to(BF16).float(), rtol=2**-8, atol=0)
    torch.testing.assert_close(outs[2], (x * x).sum(-1, keepdim=True), rtol=1e-5, atol=0)
    assert bitwise_equal(outs[3], outs[2].expand(rows, cols).half())
    assert (outs[4] == 7.0).all()


def test_registers_written_twice_and_reused_buffers():
    """In-place instructions (dst = an operand) and a register redefined after its buffer could
    have been lent to another."""
    x = torch.randn(10, 300, generator=gen(20))
    prog = P()
    a = prog.load(0)
    b = prog.op(Op.EXP, a)
    prog.p.emit(Op.ADD, a, a, b)  # a = a + exp(a)
    c = prog.op(Op.NEG, b)
    prog.p.emit(Op.MUL, b, c, a)  # b = -exp(x) * (x + exp(x))
    prog.store(b)
    out = torch.empty_like(x)
    run(prog, [x], [out], *x.shape)
    torch.testing.assert_close(out, -torch.exp(x) * (x + torch.exp(x)), rtol=1e-6, atol=1e-6)


def test_output_aliasing_its_input():
    x = torch.randn(300, 1000, generator=gen(21))
    want = torch.empty_like(x)
    run(unary_program(Op.SILU), [x], [want], *x.shape)
    run(unary_program(Op.SILU), [x], [x], *x.shape)  # x = silu(x), in place
    assert torch.equal(x, want)


def test_threads_give_bitwise_equal_results():
    """Any number of threads (8 on fewer cores, where a thread done with its part of the tiles
    may take chunks of another's, as the timing falls), with each thread given its own part of
    the tiles or all tiles handed out in turn (tune flag 128)."""
    rows, cols = 513, 3001
    g = gen(22)
    x, w = torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g)
    programs = [(softmax_program(F32), [x]), (rmsnorm_program(F32, cols), [x, w]),
                (unary_program(Op.GELU_TANH), [x])]
    old = vm.LIB.hp_dvm_tune(-1)
    for prog, inputs in programs:
        outs = []
        try:
            for threads, flags in ((1, old), (2, old), (3, old), (8, old), (2, old | 128), (8, old | 128)):
                vm.LIB.hp_dvm_tune(flags)
                out = torch.empty(rows, cols)
                run(prog, inputs, [out], rows, cols, n_threads=threads)
                outs.append(out)
        finally:
            vm.LIB.hp_dvm_tune(old)
        for out in outs[1:]:
            assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))


def test_instruction_sets_agree():
    x = torch.randn(40, 515, generator=gen(23)) * 5
    results = []
    for level in (0, 1, 2):
        use_isa(level)
        out = torch.empty_like(x)
        try:
            run(softmax_program(F32), [x], [out], *x.shape)
        finally:
            use_isa("avx512")
        results.append(out)
    for out in results[1:]:
        torch.testing.assert_close(out, results[0], rtol=1e-6, atol=1e-9)


def test_tile_size_does_not_change_elementwise_results():
    """Tiles of one or many rows, rows split into several tiles: the same values (and weights, kept
    from tile to tile while the columns stay, reloaded when they change)."""
    g = gen(24)
    x, w = torch.randn(77, 1500, generator=g), torch.randn(1500, generator=g).to(BF16)
    prog = P((F32, BF16))
    prog.store(prog.op(Op.MUL, prog.op(Op.SIGMOID, prog.load(0)), prog.load(1)))
    outs = []
    old = vm.tile_elems()
    try:
        for tile in (16, 1000, 2048, 1 << 16):
            vm.tile_elems(tile)
            out = torch.empty_like(x)
            run(prog, [x, w], [out], *x.shape)
            outs.append(out)
    finally:
        vm.tile_elems(old if old > 0 else -1)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], torch.sigmoid(x) * w.float(), rtol=1e-5, atol=1e-6)


def _row_sums_in_lanes(terms: torch.Tensor) -> torch.Tensor:
    """Row sums of fp32 `terms` [rows, n] in the VM's documented order (csrc/dvm_kernels.h,
    ROW_SUM_OF): 16 lanes, four vectors a step added (a + b) + (c + d), then 16-element steps,
    the tail into the first lanes, the lanes pairwise, halves first. fp32 element-wise additions
    are exact IEEE roundings, so this reproduces the order's bits."""
    rows, n = terms.shape
    acc = torch.zeros(rows, 16)
    j = 0
    while j + 64 <= n:
        t = terms[:, j:j + 64]
        acc = acc + ((t[:, 0:16] + t[:, 16:32]) + (t[:, 32:48] + t[:, 48:64]))
        j += 64
    while j + 16 <= n:
        acc = acc + terms[:, j:j + 16]
        j += 16
    acc[:, :n - j] += terms[:, j:]
    for w in (8, 4, 2, 1):
        acc = acc[:, :w] + acc[:, w:2 * w]
    return acc


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 64, 65, 100, 256, 1000])
def test_row_sums_add_in_one_order_under_every_isa(cols, isa):
    """RSUM and the fused sum of a product (SUM_MUL) add in one fixed order, whatever the
    instruction set: bitwise the lanes-then-pairs order of _row_sums_in_lanes."""
    rows = 9
    g = gen(cols)
    x, y = torch.randn(rows, cols, generator=g) * 10, torch.randn(rows, cols, generator=g)
    prog = P((F32, F32), (F32, F32))
    xr, yr = prog.load(0), prog.load(1)
    prog.store(prog.op(Op.RSUM, xr), 0)
    prog.store(prog.op(Op.RSUM, prog.op(Op.MUL, xr, yr)), 1)  # fused into one pass: SUM_MUL
    outs = [torch.empty(rows, 1), torch.empty(rows, 1)]
    run(prog, [x, y], outs, rows, cols)
    assert bitwise_equal(outs[0], _row_sums_in_lanes(x))
    assert bitwise_equal(outs[1], _row_sums_in_lanes(x * y))


def test_fused_instruction_pairs_round_alike():
    """The VM runs `t = a * b; d = t * c`, `t = u(a); d = t * b` and `t = a * b; RSUM t` as one
    pass when nothing else reads t: the values round as the two instructions would (row sums
    within reordering)."""
    rows, cols = 23, 777
    g = gen(26)
    x, w, r = torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g), torch.randn(rows, 1, generator=g)
    n_full = 7
    prog = P((F32, F32, F32), (F32,) * (n_full + 1))
    xr, wr, rr = prog.load(0), prog.load(1), prog.load(2, Kind.ROW)
    prog.store(prog.op(Op.MUL, prog.op(Op.MUL, xr, rr), wr), 0)  # FULL * ROW, then * FULL
    prog.store(prog.op(Op.MUL, wr, prog.op(Op.MUL, rr, prog.const(3.0))), 1)  # ROW * SCALAR is no FULL pair
    prog.store(prog.op(Op.MUL, prog.const(0.5), prog.op(Op.MUL, xr, prog.const(2.0))), 2)
    prog.store(prog.op(Op.MUL, prog.op(Op.SILU, xr), wr), 3)  # unary, then * FULL
    prog.store(prog.op(Op.MUL, xr, prog.op(Op.SIGMOID, xr)), 4)  # x * sigmoid(x)
    prog.store(prog.op(Op.MUL, prog.op(Op.TANH, xr), rr), 5)  # unary, then * ROW
    prog.store(prog.op(Op.MUL, prog.op(Op.SIN, xr), prog.const(2.0)), 6)  # sin and cos are never fused
    prog.store(prog.op(Op.RSUM, prog.op(Op.MUL, xr, xr)), n_full)
    results = []
    old = vm.LIB.hp_dvm_tune(-1)
    try:
        for flags in (old & ~16, old | 16):  # fused, then not
            vm.LIB.hp_dvm_tune(flags)
            outs = [torch.empty(rows, cols) for _ in range(n_full)] + [torch.empty(rows, 1)]
            run(prog, [x, w, r], outs, rows, cols, in_kinds=[Kind.FULL, Kind.FULL, Kind.ROW])
            results.append(outs)
    finally:
        vm.LIB.hp_dvm_tune(old)
    for fused, plain in zip(results[0][:n_full], results[1][:n_full], strict=True):
        assert torch.equal(fused, plain)
    assert bitwise_equal(results[0][0], x * r * w)
    torch.testing.assert_close(results[0][3], F.silu(x) * w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][n_full], (x * x).sum(-1, keepdim=True), rtol=1e-5, atol=0)


def test_widening_copy_then_mul_is_not_fused():
    """`t = COPY r` that widens a per-row r to FULL, then `d = t * x` (expand(sum) * y of a
    decomposed softmax's backward, all loads first): no UNARY_MUL, which would read r's one value
    per row as a full tile, past its buffer. A row sum and a per-row load, t on either side."""
    rows, cols = 19, 203  # several rows, rows of 203: vector remainders
    g = gen(27)
    dy, y = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g).softmax(-1)
    r = torch.randn(rows, 1, generator=g)
    prog = P((F32, F32, F32), (F32, F32))
    dyl, yl, rl = prog.load(0), prog.load(1), prog.load(2, Kind.ROW)
    s = prog.op(Op.RSUM, prog.op(Op.MUL, dyl, yl))  # sum(dy * y), per row
    ydy = prog.op(Op.MUL, yl, dyl)
    prog.store(prog.op(Op.SUB, ydy, prog.op(Op.MUL, prog.op(Op.COPY, s, kind=Kind.FULL), yl)), 0)  # t first
    prog.store(prog.op(Op.MUL, dyl, prog.op(Op.COPY, rl, kind=Kind.FULL)), 1)  # dy * expand(r), t second
    in_strides = [strides(dy), strides(y), strides(r)]
    results = []
    old = vm.LIB.hp_dvm_tune(-1)
    try:
        for flags in (old & ~16, old | 16):  # fused, then not
            vm.LIB.hp_dvm_tune(flags)
            outs = [torch.empty(rows, cols), torch.empty(rows, cols)]
            vm.run(prog.p, [dy, y, r], outs, rows, cols, in_strides, [strides(o) for o in outs])
            results.append(outs)
    finally:
        vm.LIB.hp_dvm_tune(old)
    refs = [torch.empty(rows, cols), torch.empty(rows, cols)]
    reference.run(prog.p, [dy, y, r], refs, rows, cols, in_strides, [strides(o) for o in refs])
    assert bitwise_equal(results[0][1], refs[1]) and bitwise_equal(results[0][1], dy * r)
    torch.testing.assert_close(results[0][0], refs[0], rtol=1e-5, atol=1e-5)  # row sums: another order
    for fused, plain in zip(*results, strict=True):
        assert torch.equal(fused, plain)


# ---------------------------------------------------------------- errors

def expect_error(prog: Program, inputs, outputs, rows, cols, in_strides, out_strides, code, instruction):
    with pytest.raises(vm.VMError) as info:
        vm.run(prog, inputs, outputs, rows, cols, in_strides, out_strides)
    assert info.value.code == code and info.value.instruction == instruction, str(info.value)
    return info.value


def test_errors_name_the_instruction():
    x, out = torch.randn(4, 8), torch.zeros(4, 8)
    full = [(8, 1)]

    bad_op = Program(input_dtypes=[TORCH_DTYPES[F32]], output_dtypes=[TORCH_DTYPES[F32]])
    r = bad_op.register(Kind.FULL)
    bad_op.emit(Op.LOAD, r, 0)
    bad_op.code += [99, r, r, 0, 0]
    err = expect_error(bad_op, [x], [out], 4, 8, full, full, 1, 1)
    assert "instruction 1 (opcode 99" in str(err)

    b = P()
    r = b.load(0)
    b.p.emit(Op.EXP, 5, r)
    expect_error(b.p, [x], [out], 4, 8, full, full, 2, 1)  # register out of range

    b = P()
    r = b.load(0)
    row = b.p.register(Kind.ROW)
    b.p.emit(Op.EXP, row, r)  # FULL -> ROW
    expect_error(b.p, [x], [out], 4, 8, full, full, 3, 1)

    b = P()
    b.store(b.p.register(Kind.FULL))
    expect_error(b.p, [x], [out], 4, 8, full, full, 4, 0)  # read before written

    b = P()
    b.store(b.load(1))
    expect_error(b.p, [x], [out], 4, 8, full, full, 5, 0)  # no input 1

    b = P()
    b.load(0, Kind.ROW)
    expect_error(b.p, [x], [out], 4, 8, full, full, 7, 0)  # a ROW load of a full tensor

    b = P()
    b.store(b.load(0))
    expect_error(b.p, [x], [out], 4, 8, full, [(8, 0)], 7, 1)  # 8 values into one element per row

    n = vm.MAX_REDUCE_COLS + 1
    b = P()
    b.store(b.op(Op.RSUM, b.load(0)))
    expect_error(b.p, [torch.ones(1)], [torch.empty(1, 1)], 1, n, [(0, 0)], [(0, 0)], 8, -1)

    with pytest.raises(ValueError, match="input 0"):
        vm.run(unary_program(Op.EXP).p, [x.half()], [out], 4, 8, full, full)
    with pytest.raises(ValueError, match="2 inputs|1 input"):
        vm.run(unary_program(Op.EXP).p, [x, x], [out], 4, 8, full * 2, full)
    assert torch.equal(out, torch.zeros(4, 8))  # nothing was written


@pytest.mark.parametrize("shape", [(3, 8), (5, 2), (7, 130)])
def test_rotate_half_along_the_row(shape, isa):
    rows, cols = shape
    t = torch.randn(rows, cols, generator=gen(3))
    b = P()
    b.store(b.op(Op.EXP, b.op(Op.ROT_HALF, b.op(Op.MUL, b.load(0), b.load(0)))))  # in a chain: whole-row tiles
    out = torch.empty(rows, cols)
    vm.run(b.p, [t], [out], rows, cols, [(cols, 1)], [(cols, 1)])
    sq = t * t
    want = torch.exp(torch.cat((-sq[:, cols // 2:], sq[:, :cols // 2]), dim=1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    ref = torch.empty(rows, cols)
    reference.run(b.p, [t], [ref], rows, cols, [(cols, 1)], [(cols, 1)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    if cols > 2:  # an odd row: no half to rotate by
        expect_error(b.p, [t[:, :cols - 1]], [out[:, :cols - 1]], rows, cols - 1, [(cols, 1)], [(cols, 1)], 9, 3)
    same = P()  # into the register it reads: refused (it reads other columns than it writes)
    r = same.load(0)
    same.p.emit(Op.ROT_HALF, r, r)
    same.store(r)
    expect_error(same.p, [t], [out], rows, cols, [(cols, 1)], [(cols, 1)], 2, 1)


def test_native_arrays_are_built_once_per_program():
    b = unary_program(Op.EXP)
    x, out = torch.randn(2, 3), torch.empty(2, 3)
    run(b, [x], [out], 2, 3)
    native = b.p._native
    run(b, [x], [out], 2, 3)
    assert b.p._native is native
    # a program that grew gets new arrays
    r = b.p.register(Kind.FULL)
    b.p.emit(Op.NEG, r, 1)
    b.store(r)
    run(b, [x], [out], 2, 3)
    assert b.p._native is not native
    torch.testing.assert_close(out, -torch.exp(x))


def test_matches_the_reference_interpreter():
    """The VM and the PyTorch reference interpreter (fusion/reference.py) run the same program."""
    from hyperparallel.fusion import reference

    rows, cols = 19, 203
    g = gen(25)
    x = torch.randn(rows, cols, generator=g).abs() + 0.1
    w, r = torch.randn(cols, generator=g), torch.randn(rows, 1, generator=g)
    prog = P((F32, F32, F32), (F32, BF16, F32))
    xr, wr, rr = prog.load(0), prog.load(1), prog.load(2, Kind.ROW)
    acc = xr
    for op in sorted(UNARY - {Op.ROUND_BF16, Op.ROUND_F16}):
        acc = prog.op(Op.ADD, acc, prog.op(Op.MUL, prog.op(op, xr), prog.const(0.01)))
    for op in sorted(BINARY):
        acc = prog.op(Op.ADD, acc, prog.op(Op.MUL, prog.op(op, xr, wr if op != Op.POW else rr), prog.const(0.01)))
    acc = prog.op(Op.WHERE, prog.op(Op.GT, wr, prog.const(0.0)), acc, prog.op(Op.ROUND_BF16, acc))
    prog.store(acc, 0)
    prog.store(prog.op(Op.MUL, acc, rr), 1)
    prog.store(prog.op(Op.RSUM, acc), 2)
    in_strides = [strides(x), strides(w), strides(r)]
    outs = [torch.empty(rows, cols), torch.empty(rows, cols, dtype=BF16), torch.empty(rows, 1)]
    refs = [torch.empty_like(o) for o in outs]
    vm.run(prog.p, [x, w, r], outs, rows, cols, in_strides, [strides(o) for o in outs])
    reference.run(prog.p, [x, w, r], refs, rows, cols, in_strides, [strides(o) for o in refs])
    torch.testing.assert_close(outs[0], refs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1].float(), refs[1].float(), rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(outs[2], refs[2], rtol=1e-5, atol=1e-5)

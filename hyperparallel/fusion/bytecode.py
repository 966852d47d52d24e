"""DVM bytecode: the program a fused operator is, and the contract with the C VM (csrc/dvm_vm.c).

A program runs over a logical 2-D space of `rows` x `cols`. Every tensor it reads or writes is
seen as [rows, cols] through two element strides (row_stride, col_stride); a stride of 0
broadcasts (a weight of [cols] has row_stride 0; a per-row value [rows, 1] has col_stride 0; a
scalar has both 0). The VM walks the space tile by tile (a tile: some rows x some columns, small
enough for L1; with a row reduction in the program, a tile spans whole rows), parallel over tiles
with OpenMP. Registers live only inside a tile: intermediates never touch memory.

Registers hold float32 and have a kind, fixed for the whole program:
- FULL: a value per element of the tile;
- ROW: a value per row of the tile (what a row reduction gives);
- SCALAR: one value (a constant).
An operation's result has the widest kind of its operands (FULL > ROW > SCALAR) and operands
broadcast to it. Loads convert from the tensor's dtype to float32, stores convert back (round to
nearest even for bf16 and fp16, as PyTorch does).

An instruction is 5 int32 words: opcode, dst, a, b, c (unused words are 0).

    LOAD    dst, input index            FULL (or ROW if the input has col_stride 0 and the
                                        program marks dst ROW, or SCALAR if both strides are 0
                                        and dst is SCALAR)
    CONST   dst, immediate index        SCALAR
    STORE   src=a, output index=b       writes register a (broadcast to FULL if needed) to the
                                        output; a ROW register may be stored to an output whose
                                        col_stride is 0
    unary   dst, a
    binary  dst, a, b
    WHERE   dst, cond=a, x=b, y=c       cond != 0 ? x : y
    RSUM/RMAX/RMIN dst(ROW), a(FULL)    over the whole row (all `cols` columns)
    ROT_HALF dst(FULL), a(FULL)         rotary's rotate_half along the row (cols even, h =
                                        cols / 2): dst[j] = -a[j + h] for j < h, a[j - h] else
    VF      index=d, n_args=a           a precompiled vector function of the VF table
                                        (vf_table.txt, vf_spec.py): its outputs, then its
    ARG     r0, r1, r2, r3              inputs, four registers per ARG instruction after it
                                        (unused words 0). Outputs are FULL registers; an input
                                        is FULL where the table says F, ROW or SCALAR where U.
                                        Same results as its ops one by one, bit for bit.

Numerics: every operation computes in float32 on float32 registers and does not round in
between, except ROUND_BF16 / ROUND_F16, which round a float32 value to bf16 / fp16 and back (what
an explicit cast in the graph does). So a bf16 or fp16 chain differs from eager (which rounds
after every op) by at most that rounding of intermediates; fp32 chains match eager within fp32
rounding of the transcendental functions (documented per op in docs/fusion.md).

How the VM (csrc/dvm_vm.c) reads the points above that leave room, and its limits:
- Kinds: a result's register has exactly the widest kind of its operands; only CONST and COPY
  may write a wider register (the value broadcast). A LOAD into FULL takes any strides (0 too);
  into ROW it needs col_stride 0, into SCALAR both 0 (a stride of a size-1 dimension counts as 0).
- Registers may be written more than once; reading one before any write is an error.
- RSUM/RMAX/RMIN write a ROW register. A FULL operand makes tiles span whole rows, so `cols` is at
  most 2^20 (vm.MAX_REDUCE_COLS); a ROW or SCALAR operand is a value repeated along the row (sum:
  cols times it, max/min: itself). RMAX/RMIN propagate NaN (torch.amax); RSUM adds in a vectorized
  order, not left to right (within fp32 rounding of eager's own order).
- STORE: a FULL value may not meet a broadcast (stride 0) dimension of the output of size > 1
  (several values, one element); a ROW value not a broadcast row dimension. ROW and SCALAR values
  are written once into the output's broadcast dimensions and repeated along the others.
- Immediates are doubles, rounded to float32 where a CONST reads them.
- Comparisons give 1.0 / 0.0 (NaN compares false, except NE); WHERE takes NaN as true (!= 0);
  MAX/MIN return NaN if either operand is (torch.maximum); RELU keeps NaN; POW is powf (exponents
  2, 3, 0.5, -0.5, 1, 0, -1, -2 of a SCALAR register run as exact vector code with powf's results).
- SIGMOID, SILU, TANH and the GELUs use e^-|x|, flushed to 0 below 2^-126: sigmoid(x < -87.3) is 0
  (eager: the subnormal value or 0). SILU(-inf) and GELU(-inf) are NaN, as eager's formulas give;
  GELU_ERF(+inf) is +inf (eager: NaN). GELU_TANH is computed as x * sigmoid(2u), the same function
  without 1 + tanh's cancellation for negative x (eager's float formula has large relative errors
  there). SQRT is correctly rounded (eager's vectorized sqrt can be an ulp off).
- Max error against the exact function, in float32 ulps, over every float32 input (csrc/dvm_math.h;
  tests/fusion/test_vm.py samples it): EXP 1, EXPM1 1.5, LOG 0.9, LOG1P 1.5, TANH 1.5, SIGMOID 2.4,
  ERF 2.9, SIN/COS 1.6, SILU 3.4, GELU_ERF 2.7 and GELU_TANH 3.4 (x >= -1; below, the rounding of
  the float32 argument dominates a tiny result). The other operations are IEEE exact.
- A bool input (DType.BOOL, one byte, inputs only) loads as 1.0 / 0.0. bf16 / fp16 loads are exact; stores and ROUND_* round to nearest even, overflow to inf, keep
  NaN NaN (quiet, sign kept; the payload may change).
- Memory: every element a tensor's strides address over the space must lie inside it; an output
  may overlap an input only element for element (same strides), and a LOAD after a STORE to the
  same memory within one program sees the stored value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

WORDS = 5  # int32 words per instruction


class Op(IntEnum):
    LOAD = 0
    CONST = 1
    STORE = 2
    # unary
    NEG = 10
    ABS = 11
    EXP = 12
    LOG = 13
    SQRT = 14
    RSQRT = 15
    RECIP = 16
    TANH = 17
    SIGMOID = 18
    RELU = 19
    ERF = 20
    SILU = 21
    GELU_ERF = 22
    GELU_TANH = 23
    SIN = 24
    COS = 25
    LOG1P = 26
    EXPM1 = 27
    ROUND_BF16 = 28
    ROUND_F16 = 29
    COPY = 30
    # binary
    ADD = 40
    SUB = 41
    MUL = 42
    DIV = 43
    MAX = 44
    MIN = 45
    POW = 46
    GT = 47
    GE = 48
    LT = 49
    LE = 50
    EQ = 51
    NE = 52
    # ternary
    WHERE = 60
    # row reductions
    RSUM = 70
    RMAX = 71
    RMIN = 72
    # a precompiled vector function and its argument words (vf.py)
    VF = 80
    ARG = 81
    # along the row
    ROT_HALF = 90


class Kind(IntEnum):
    FULL = 0
    ROW = 1
    SCALAR = 2


class DType(IntEnum):
    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    BOOL = 3  # inputs only: a mask, loaded as 1.0 / 0.0


TORCH_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}
INPUT_DTYPES = {**TORCH_DTYPES, torch.bool: DType.BOOL}  # what a LOAD reads

UNARY = {Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.RECIP, Op.TANH, Op.SIGMOID, Op.RELU, Op.ERF, Op.SILU,
         Op.GELU_ERF, Op.GELU_TANH, Op.SIN, Op.COS, Op.LOG1P, Op.EXPM1, Op.ROUND_BF16, Op.ROUND_F16, Op.COPY}
BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.POW, Op.GT, Op.GE, Op.LT, Op.LE, Op.EQ, Op.NE}
REDUCTIONS = {Op.RSUM, Op.RMAX, Op.RMIN}
WHOLE_ROWS = REDUCTIONS | {Op.ROT_HALF}  # a tile holds whole rows for these


def nested_strides(strides, row_dims: tuple[int, int]) -> tuple[int, int, int, int]:
    """A tensor's (outer, middle, inner row, column) strides over rows nested as
    [rows / (n_mid * n_inner), n_mid, n_inner]; given (row, column), rows at one stride."""
    if len(strides) == 4:
        return tuple(strides)
    n_mid, n_inner = row_dims
    row, col = strides
    return row * n_inner * n_mid, row * n_inner, row, col


@dataclass
class Program:
    """A fused operator: its code, constants, register kinds, and what it reads and writes."""

    code: list[int] = field(default_factory=list)  # WORDS int32 per instruction
    immediates: list[float] = field(default_factory=list)
    register_kinds: list[Kind] = field(default_factory=list)
    input_dtypes: list[DType] = field(default_factory=list)
    output_dtypes: list[DType] = field(default_factory=list)

    @property
    def has_reduction(self) -> bool:
        """Whether a tile must hold whole rows (a row reduction, or a rotation along the row)."""
        return any(self.code[i] in WHOLE_ROWS for i in range(0, len(self.code), WORDS))

    def register(self, kind: Kind) -> int:
        self.register_kinds.append(kind)
        return len(self.register_kinds) - 1

    def emit(self, op: Op, dst: int = 0, a: int = 0, b: int = 0, c: int = 0) -> None:
        self.code += [int(op), dst, a, b, c]

    def constant(self, value: float) -> int:
        """A SCALAR register holding `value`."""
        self.immediates.append(float(value))
        reg = self.register(Kind.SCALAR)
        self.emit(Op.CONST, reg, len(self.immediates) - 1)
        return reg

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

Numerics: every operation computes in float32 on float32 registers and does not round in
between, except ROUND_BF16 / ROUND_F16, which round a float32 value to bf16 / fp16 and back (what
an explicit cast in the graph does). So a bf16 or fp16 chain differs from eager (which rounds
after every op) by at most that rounding of intermediates; fp32 chains match eager within fp32
rounding of the transcendental functions (documented per op in docs/fusion.md).
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


class Kind(IntEnum):
    FULL = 0
    ROW = 1
    SCALAR = 2


class DType(IntEnum):
    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2


TORCH_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}

UNARY = {Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.RECIP, Op.TANH, Op.SIGMOID, Op.RELU, Op.ERF, Op.SILU,
         Op.GELU_ERF, Op.GELU_TANH, Op.SIN, Op.COS, Op.LOG1P, Op.EXPM1, Op.ROUND_BF16, Op.ROUND_F16, Op.COPY}
BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.POW, Op.GT, Op.GE, Op.LT, Op.LE, Op.EQ, Op.NE}
REDUCTIONS = {Op.RSUM, Op.RMAX, Op.RMIN}


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
        return any(self.code[i] in REDUCTIONS for i in range(0, len(self.code), WORDS))

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

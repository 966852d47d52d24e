"""The DVM bytecode run by PyTorch ops, one instruction at a time on whole [rows, cols] tensors:
the executable spec the native VM is tested against (slow; never used for speed)."""

from __future__ import annotations

import torch

from hyperparallel.fusion import vf
from hyperparallel.fusion.bytecode import WORDS, DType, Kind, Op, Program, nested_strides

_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}
_UNARY = {
    Op.NEG: torch.neg, Op.ABS: torch.abs, Op.EXP: torch.exp, Op.LOG: torch.log, Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt, Op.RECIP: torch.reciprocal, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid,
    Op.RELU: torch.relu, Op.ERF: torch.erf, Op.SILU: torch.nn.functional.silu,
    Op.GELU_ERF: torch.nn.functional.gelu, Op.GELU_TANH: lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    Op.SIN: torch.sin, Op.COS: torch.cos, Op.LOG1P: torch.log1p, Op.EXPM1: torch.expm1,
    Op.ROUND_BF16: lambda x: x.bfloat16().float(), Op.ROUND_F16: lambda x: x.half().float(), Op.COPY: torch.clone,
}
_BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div, Op.MAX: torch.maximum,
    Op.MIN: torch.minimum, Op.POW: torch.pow,
    Op.GT: lambda a, b: (a > b).float(), Op.GE: lambda a, b: (a >= b).float(), Op.LT: lambda a, b: (a < b).float(),
    Op.LE: lambda a, b: (a <= b).float(), Op.EQ: lambda a, b: (a == b).float(), Op.NE: lambda a, b: (a != b).float(),
}
_REDUCE = {Op.RSUM: lambda x: x.sum(-1, keepdim=True), Op.RMAX: lambda x: x.amax(-1, keepdim=True),
           Op.RMIN: lambda x: x.amin(-1, keepdim=True)}


def _view(t: torch.Tensor, rows: int, cols: int, strides, row_dims) -> torch.Tensor:
    """t as [rows / (n_mid * n_inner), n_mid, n_inner, cols] through strides (row, col) or
    (outer, middle, inner, col); reshape it to [rows, cols] to read it."""
    n_mid, n_inner = row_dims
    shape = (rows // (n_mid * n_inner), n_mid, n_inner, cols)
    return torch.as_strided(t, shape, nested_strides(strides, row_dims), t.storage_offset())


def _vf(regs: dict, index: int, args: list[int]) -> None:
    """A VF: its table entry's ops one by one (the VM runs them in registers, bit for bit the same)."""
    spec = vf.specs()[index]
    n_out = len(spec.outputs)
    values = [regs[r] for r in args[n_out:]]
    for name, operands in spec.ops:
        op, xs = Op[name], [values[v] for v in operands]
        values.append(_UNARY[op](*xs) if op in _UNARY else _BINARY[op](*xs) if op in _BINARY
                      else torch.where(xs[0] != 0, xs[1], xs[2]))
    for reg, v in zip(args[:n_out], spec.outputs, strict=True):
        regs[reg] = values[v]


def run(program: Program, inputs, outputs, rows: int, cols: int, input_strides, output_strides, row_dims=(1, 1)) -> None:
    regs: dict[int, torch.Tensor] = {}
    code = program.code
    for i in range(0, len(code), WORDS):
        op, dst, a, b, c = (Op(code[i]), *code[i + 1:i + WORDS])
        kind = program.register_kinds[dst] if op not in (Op.STORE, Op.ARG, Op.VF) else None
        if op == Op.ARG:
            continue  # read with its VF
        if op == Op.VF:
            n_words = (a + 3) // 4
            _vf(regs, dst, [r for j in range(n_words) for r in code[i + WORDS * (j + 1) + 1:i + WORDS * (j + 2)]][:a])
        elif op == Op.LOAD:
            t = _view(inputs[a], rows, cols, input_strides[a], row_dims).reshape(rows, cols).float()
            regs[dst] = t[:1, :1] if kind == Kind.SCALAR else (t[:, :1] if kind == Kind.ROW else t)
        elif op == Op.CONST:
            regs[dst] = torch.full((1, 1), program.immediates[a], dtype=torch.float32)
        elif op == Op.STORE:
            strides = tuple(output_strides[b])
            per_row = strides[-1] == 0  # one value per row
            out = _view(outputs[b], rows, 1 if per_row else cols, strides, row_dims)
            value = regs[a].expand(rows, cols)[:, :1] if per_row else regs[a].expand(rows, cols)
            out.copy_(value.reshape(out.shape).to(out.dtype))
        elif op in _UNARY:
            regs[dst] = _UNARY[op](regs[a])
        elif op in _BINARY:
            regs[dst] = _BINARY[op](regs[a], regs[b])
        elif op == Op.WHERE:
            regs[dst] = torch.where(regs[a] != 0, regs[b], regs[c])
        elif op in _REDUCE:
            regs[dst] = _REDUCE[op](regs[a].expand(rows, cols))
        elif op == Op.ROT_HALF:
            x = regs[a].expand(rows, cols)
            regs[dst] = torch.cat((-x[:, cols // 2:], x[:, :cols // 2]), dim=1)
        else:
            raise ValueError(f"DVM reference: unknown opcode {op}")

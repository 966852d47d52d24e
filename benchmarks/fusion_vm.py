"""Timing sanity check of the DVM interpreter (hyperparallel.fusion.vm) on 16M-element chains.

Hand-written programs (no partitioner) against eager PyTorch (the single fused op where PyTorch
has one, and the chain of ops a graph decomposes into) and against torch.compile / Inductor.
Not a test: prints a table of best-of-N milliseconds and ratios. Two settings: each call
allocates its output (torch.empty, as eager, Inductor's generated code and a backend do; on a
fresh 64 MB buffer the page faults alone cost as much as the kernel), and "into": the output
preallocated and reused (Inductor compiles `out.copy_(f(x))` into one kernel writing `out`).

    .venv/bin/python benchmarks/fusion_vm.py [--rows 4096 --cols 4096 --reps 10 --no-inductor]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hyperparallel import kernels
from hyperparallel.fusion import vm
from hyperparallel.fusion.bytecode import TORCH_DTYPES, Kind, Op, Program


def unary_program(dtype, op):
    p = Program(input_dtypes=[TORCH_DTYPES[dtype]], output_dtypes=[TORCH_DTYPES[dtype]])
    x = p.register(Kind.FULL)
    p.emit(Op.LOAD, x, 0)
    y = p.register(Kind.FULL)
    p.emit(op, y, x)
    p.emit(Op.STORE, 0, y, 0)
    return p


def swiglu_program(dtype):
    p = Program(input_dtypes=[TORCH_DTYPES[dtype]] * 2, output_dtypes=[TORCH_DTYPES[dtype]])
    a, b, s, y = (p.register(Kind.FULL) for _ in range(4))
    p.emit(Op.LOAD, a, 0)
    p.emit(Op.LOAD, b, 1)
    p.emit(Op.SILU, s, a)
    p.emit(Op.MUL, y, s, b)
    p.emit(Op.STORE, 0, y, 0)
    return p


def rmsnorm_program(dtype, cols, eps=1e-6):
    p = Program(input_dtypes=[TORCH_DTYPES[dtype]] * 2, output_dtypes=[TORCH_DTYPES[dtype]])
    x, w, sq, y, z = (p.register(Kind.FULL) for _ in range(5))
    s, m, r = (p.register(Kind.ROW) for _ in range(3))
    p.emit(Op.LOAD, x, 0)
    p.emit(Op.LOAD, w, 1)
    p.emit(Op.MUL, sq, x, x)
    p.emit(Op.RSUM, s, sq)
    p.emit(Op.MUL, m, s, p.constant(1.0 / cols))
    p.emit(Op.ADD, m, m, p.constant(eps))
    p.emit(Op.RSQRT, r, m)
    p.emit(Op.MUL, y, x, r)
    p.emit(Op.MUL, z, y, w)
    p.emit(Op.STORE, 0, z, 0)
    return p


def cast_program():
    """bf16 -> fp32: sigmoid(x) * x + 1 -> bf16 (explicit casts: loads and stores convert)."""
    p = Program(input_dtypes=[TORCH_DTYPES[torch.bfloat16]], output_dtypes=[TORCH_DTYPES[torch.bfloat16]])
    x, s, t, u = (p.register(Kind.FULL) for _ in range(4))
    p.emit(Op.LOAD, x, 0)
    p.emit(Op.SIGMOID, s, x)
    p.emit(Op.MUL, t, s, x)
    p.emit(Op.ADD, u, t, p.constant(1.0))
    p.emit(Op.STORE, 0, u, 0)
    return p


def best_ms(fns, reps):
    """Best-of-`reps` milliseconds of each function, calls interleaved (the machine's noise hits all
    of them alike); None stays None."""
    live = [f for f in fns if f is not None]
    for f in live:
        f()
        f()
    best = [float("inf")] * len(live)
    for _ in range(reps):
        for i, f in enumerate(live):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    it = iter(best)
    return [next(it) * 1e3 if f is not None else float("nan") for f in fns]


def dvm_calls(program, inputs, strides, rows, cols, dtype):
    def alloc():
        out = torch.empty(rows, cols, dtype=dtype)
        vm.run(program, inputs, [out], rows, cols, strides, [(cols, 1)])
        return out

    out = torch.empty(rows, cols, dtype=dtype)

    def into():
        vm.run(program, inputs, [out], rows, cols, strides, [(cols, 1)])

    return alloc, into


def inductor_calls(fn, args, rows, cols, dtype, enabled):
    if not enabled:
        return None, None
    out = torch.empty(rows, cols, dtype=dtype)
    alloc = torch.compile(fn)
    into = torch.compile(lambda out, *a: out.copy_(fn(*a)))
    return (lambda: alloc(*args)), (lambda: into(out, *args))


def rms_chain(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def gelu_chain(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def cast_chain(x):
    y = x.float()
    return (torch.sigmoid(y) * y + 1.0).to(torch.bfloat16)


def cases(rows, cols, inductor):
    """(name, eager single op or None, eager chain, inductor (alloc, into), dvm (alloc, into))"""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, cols, dtype=dtype)
        b = torch.randn(rows, cols, dtype=dtype)
        w = torch.randn(cols, dtype=dtype)
        full = [(cols, 1)]
        tag = "fp32" if dtype == torch.float32 else "bf16"
        yield (f"silu {tag}", lambda x=x: F.silu(x), lambda x=x: x * torch.sigmoid(x),
               inductor_calls(F.silu, (x,), rows, cols, dtype, inductor),
               dvm_calls(unary_program(dtype, Op.SILU), [x], full, rows, cols, dtype))
        yield (f"gelu-tanh {tag}", lambda x=x: F.gelu(x, approximate="tanh"), lambda x=x: gelu_chain(x),
               inductor_calls(lambda x: F.gelu(x, approximate="tanh"), (x,), rows, cols, dtype, inductor),
               dvm_calls(unary_program(dtype, Op.GELU_TANH), [x], full, rows, cols, dtype))
        yield (f"swiglu {tag}", None, lambda x=x, b=b: F.silu(x) * b,
               inductor_calls(lambda x, b: F.silu(x) * b, (x, b), rows, cols, dtype, inductor),
               dvm_calls(swiglu_program(dtype), [x, b], full * 2, rows, cols, dtype))
        yield (f"rmsnorm {tag}", lambda x=x, w=w: F.rms_norm(x, (cols,), w, 1e-6), lambda x=x, w=w: rms_chain(x, w),
               inductor_calls(rms_chain, (x, w), rows, cols, dtype, inductor),
               dvm_calls(rmsnorm_program(dtype, cols), [x, w], [(cols, 1), (0, 1)], rows, cols, dtype))
    x = torch.randn(rows, cols, dtype=torch.bfloat16)
    yield ("cast chain bf16", None, lambda x=x: cast_chain(x),
           inductor_calls(cast_chain, (x,), rows, cols, torch.bfloat16, inductor),
           dvm_calls(cast_program(), [x], [(cols, 1)], rows, cols, torch.bfloat16))


def main():
    torch._dynamo.config.recompile_limit = 64  # one compiled lambda per case
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()
    print(f"{args.rows} x {args.cols}, {torch.get_num_threads()} threads, DVM isa {kernels.isa()}, "
          f"tiles {vm.tile_elems() or 'sized for L1'}; best of {args.reps}, ms")
    print(f"{'':17}|{'output allocated per call':^57}|{'into a preallocated output':^32}")
    print(f"{'case':17}|{'eager op':>9}{'eager chain':>12}{'inductor':>9}{'dvm':>7}{'/inductor':>10}{'/chain':>8} |"
          f"{'inductor':>9}{'dvm':>7}{'/inductor':>10}{'':>5}")
    for name, single, chain, (ind, ind_into), (dvm, dvm_into) in cases(args.rows, args.cols, not args.no_inductor):
        t_single, t_chain, t_ind, t_dvm = best_ms([single, chain, ind, dvm], args.reps)
        t_ind_into, t_dvm_into = best_ms([ind_into, dvm_into], args.reps)
        print(f"{name:17}|{t_single:9.2f}{t_chain:12.2f}{t_ind:9.2f}{t_dvm:7.2f}{t_dvm / t_ind:10.2f}"
              f"{t_dvm / t_chain:8.2f} |{t_ind_into:9.2f}{t_dvm_into:7.2f}{t_dvm_into / t_ind_into:10.2f}", flush=True)


if __name__ == "__main__":
    main()

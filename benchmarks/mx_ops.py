"""MX operators side by side with what a user would otherwise run, in one process.

    python benchmarks/mx_ops.py                 # 8192x4096 bf16, the acceptance shape
    python benchmarks/mx_ops.py --m 1024 --k 1024 --n 1024   # a quick run (make demo)

Prints a table of median times and ratios and writes JSON (--json PATH). Each ratio compares
runs interleaved one by one, so that drift of the machine falls on both sides alike, and each
timed call starts from caches that hold none of the other contender's unwritten data.

Every contender runs under the same allocator setting (--allocator):
  cached   glibc keeps freed large blocks for reuse (mallopt), as jemalloc/tcmalloc would: fresh
           tensors then cost no page faults (the default: the strongest setting for the others)
  thp      PyTorch's own THP_MEM_ALLOC_ENABLE=1: 2 MiB pages for large tensors
  default  glibc as it comes: every large tensor is a fresh mmap, ~8k page faults per 32 MiB
hyperparallel's CPU outputs come from its own buffer cache (hyperparallel.kernels.host_cache),
so the setting changes what the other contenders cost, not what the MX operators cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _allocator_from_argv() -> str:
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--allocator="):
            return arg.split("=", 1)[1]
        if arg == "--allocator" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return "cached"


ALLOCATOR = _allocator_from_argv()
if ALLOCATOR == "thp":
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read once, at torch's first large allocation
elif ALLOCATOR == "cached":
    import ctypes

    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: serve blocks up to 1 GiB from the heap
    _libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap mapped

import torch  # noqa: E402

from hyperparallel import kernels, mx  # noqa: E402

_SETTLE = None


def settle_caches() -> None:
    """Read 64 MiB (twice this machine's L3): the caches then hold no dirty lines of the
    previous contender, whose write-backs would otherwise land in the next one's time (a
    quantizer that follows torchao's to_mx measured 1.4 ms slower for it)."""
    global _SETTLE
    if _SETTLE is None:
        _SETTLE = torch.ones(8 << 20, dtype=torch.int64)
    _SETTLE.sum()


def paired_seconds(fn_a, fn_b, warmup: int, repeat: int) -> tuple[float, float]:
    """Median times of two functions run alternately, each from settled caches."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    times_a, times_b = [], []
    for _ in range(repeat):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            settle_caches()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times_a), statistics.median(times_b)


def torchao_to_mx():
    try:
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except ImportError:
        return None
    return to_mx


def run(m: int, k: int, n: int, repeat: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(k, n, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rows = []


    def row(name, seconds, baseline_name=None, baseline=None, target=None):
        entry = {"op": name, "ms": seconds * 1e3}
        if baseline is not None:
            entry.update(vs=baseline_name, ratio=seconds / baseline, target=target)
        rows.append(entry)
        return seconds

    to_mx = torchao_to_mx()
    if to_mx is not None:
        t_floor, t_ao = paired_seconds(
            lambda: mx.quantize(x, scale_mode="floor"), lambda: to_mx(x, torch.float8_e4m3fn, 32), 2, max(3, repeat // 2)
        )
        row("torchao to_mx (floor)", t_ao)
        row("quantize (floor) vs torchao to_mx", t_floor, "torchao", t_ao, "<= 0.05 (20x faster)")
    t_quant, t_copy = paired_seconds(lambda: mx.quantize(x), lambda: y.copy_(x), 3, repeat)
    row("y.copy_(x) (preallocated y)", t_copy)
    row("quantize (rceil) vs copy_", t_quant, "copy_", t_copy, "<= 3.0")
    t_quant2, t_clone = paired_seconds(lambda: mx.quantize(x), lambda: x.clone(), 3, repeat)
    row("x.clone() (allocates, like quantize)", t_clone)
    row("quantize (rceil) vs clone", t_quant2, "clone", t_clone)
    t_dual, t_quant3 = paired_seconds(lambda: mx.quantize_dual(x), lambda: mx.quantize(x), 3, repeat)
    row("quantize_dual vs quantize", t_dual, "quantize", t_quant3, "<= 1.6")

    def mx_path():
        return mx.mx_mm(mx.quantize(x, 1), mx.quantize(w, 0))

    t_mx, t_bf16 = paired_seconds(mx_path, lambda: torch.mm(x, w), 1, max(3, repeat // 4))
    row(f"bf16 torch.mm {m}x{k}x{n}", t_bf16)
    row("quantize a, b + mx_mm vs bf16 mm", t_mx, "torch.mm", t_bf16, "<= 1.10")
    return rows


def print_table(rows, header):
    print(header)
    print(f"| {'op':<36} | {'ms':>9} | {'ratio':>7} | {'target (8192x4096)':<22} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|{'-' * 24}|")
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
        print(f"| {r['op']:<36} | {r['ms']:>9.3f} | {ratio:>7} | {r.get('target') or '':<22} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--isa", choices=["best", *kernels.LEVELS], default="best",
                        help="CPU kernels: the best for this processor, or those of a lower level (avx2: the "
                             "portable C compiled for x86-64-v3; generic: for baseline x86-64)")
    parser.add_argument("--allocator", choices=["cached", "thp", "default"], default="cached",
                        help="process allocator setting for every contender (see the module docstring)")
    args = parser.parse_args(argv)
    kernels.use_isa("avx512" if args.isa == "best" else args.isa)
    rows = run(args.m, args.k, args.n, args.repeat)
    header = (
        f"MX ops, bf16 input {args.m}x{args.k} (mm N={args.n}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, cpu kernels: {kernels.isa()}, "
        f"allocator: {ALLOCATOR}"
    )
    print_table(rows, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

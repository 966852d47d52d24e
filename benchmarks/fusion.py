"""DVM vs eager (decomposed and native ops) vs Inductor on element-wise chains, side by side.

    python benchmarks/fusion.py                 # 16M elements (4096 x 4096), fp32 and bf16
    python benchmarks/fusion.py --rows 1024     # smaller

For each chain: runtime of the decomposed eager code (what a model's Python says), of eager with
native fused ops where PyTorch has them (F.silu, F.gelu, F.rms_norm), of torch.compile with
Inductor and with dvm; and each backend's compile time, measured the same way for both: the time
spent inside the backend callable (Dynamo's tracing excluded), with Inductor's and our caches off.
Also the time to build one fused operator's bytecode (DVM's "compile": the median of 200 builds
of the chain's largest cluster), and dvm once more with its output buffer cache off (outputs from
the allocator as it comes, as Inductor's are): the kernels alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def silu(x):
    return x * torch.sigmoid(x)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def swiglu(a, b):
    return a * torch.sigmoid(a) * b


def rmsnorm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def cast_chain(x):
    y = x.float()
    return (torch.tanh(y * 0.5 + 0.1) * y).to(x.dtype)


NATIVE = {
    "SiLU": lambda x: F.silu(x),
    "GELU-tanh": lambda x: F.gelu(x, approximate="tanh"),
    "SwiGLU": lambda a, b: F.silu(a) * b,
    "RMSNorm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6) if hasattr(F, "rms_norm") else rmsnorm(x, w),
    "cast chain": cast_chain,  # no native op: the same code
}
CHAINS = {"SiLU": silu, "GELU-tanh": gelu_tanh, "SwiGLU": swiglu, "RMSNorm": rmsnorm, "cast chain": cast_chain}


def inputs(name: str, rows: int, cols: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    if name == "SwiGLU":
        return x, torch.randn(rows, cols, generator=g).to(dtype)
    if name == "RMSNorm":
        return x, torch.randn(cols, generator=g).to(dtype)
    return (x,)


def median_ms(fn, args, repeat: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def build_seconds(sub_gm, repeat: int = 200) -> float:
    """Median time to write one fused operator's bytecode from its cluster graph."""
    from hyperparallel.fusion import compile as dvm_compile

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dvm_compile.lower(sub_gm)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_backend(backend, seconds: list):
    def wrapper(gm, example_inputs):
        t0 = time.perf_counter()
        out = backend(gm, example_inputs)
        seconds.append(time.perf_counter() - t0)
        return out

    return wrapper


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-bench-"))
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from hyperparallel.fusion import compile as dvm_compile
    from hyperparallel.fusion.backend import dvm
    from hyperparallel.mx.backends import host_cache

    cache_limit = host_cache.limit()

    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    torch._dynamo.config.cache_size_limit = 256

    results = {}
    print(f"Element-wise chains, {args.rows} x {args.cols} = {args.rows * args.cols / 2**20:.0f}M elements, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeat}")
    print("| chain | dtype | eager decomposed | eager native | Inductor | dvm | dvm / Inductor | dvm, no buffer cache "
          "| its / Inductor | dvm vs decomposed | compile: Inductor | compile: dvm | Inductor / dvm | bytecode build |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, chain in CHAINS.items():
            xs = inputs(name, args.rows, args.cols, dtype)
            torch._dynamo.reset()
            inductor_seconds, dvm_seconds = [], []
            inductor = torch.compile(chain, backend=timed_backend(compile_fx, inductor_seconds))
            dvm_compile._CACHE.clear()
            dvm_compile.STATS["built_graphs"].clear()
            fused = torch.compile(chain, backend=timed_backend(dvm, dvm_seconds))
            with torch.no_grad():
                want = chain(*xs)
                for label, fn in (("Inductor", inductor), ("dvm", fused)):
                    got = fn(*xs)
                    err = (got.float() - want.float()).abs().max().item()
                    limit = 1e-5 if dtype == torch.float32 else 2e-2 * max(1.0, want.float().abs().max().item())
                    if err > limit:
                        raise SystemExit(f"{label} differs from eager on {name} {dtype_name}: {err}")
                t = {label: median_ms(fn, xs, args.repeat) for label, fn in
                     (("eager decomposed", chain), ("eager native", NATIVE[name]), ("Inductor", inductor), ("dvm", fused))}
            built = list(dvm_compile.STATS["built_graphs"])
            build_us = 1e6 * max(build_seconds(sub) for sub in built) if built else float("nan")
            host_cache.set_limit(0)  # the same dvm kernels on freshly allocated outputs, as Inductor's
            t["dvm, no buffer cache"] = median_ms(fused, xs, args.repeat)
            host_cache.set_limit(cache_limit)
            ci, cd = 1e3 * sum(inductor_seconds), 1e3 * sum(dvm_seconds)
            results[f"{name}/{dtype_name}"] = {**t, "compile_inductor_ms": ci, "compile_dvm_ms": cd,
                                                "bytecode_build_us": build_us}
            print(f"| {name} | {dtype_name} | {t['eager decomposed']:.2f} ms | {t['eager native']:.2f} ms | "
                  f"{t['Inductor']:.2f} ms | {t['dvm']:.2f} ms | {t['dvm'] / t['Inductor']:.2f} | "
                  f"{t['dvm, no buffer cache']:.2f} ms | {t['dvm, no buffer cache'] / t['Inductor']:.2f} | "
                  f"{t['eager decomposed'] / t['dvm']:.2f}x faster | {ci:.0f} ms | {cd:.1f} ms | {ci / cd:.0f}x | "
                  f"{build_us:.0f} us |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

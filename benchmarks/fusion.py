"""DVM (with VFs and per-op) vs eager (decomposed and native ops) vs Inductor on element-wise chains,
side by side, and the compile time of the trainer's decoder layers.

    python benchmarks/fusion.py                          # 0.25M, 0.5M, 1M and 16M elements
    python benchmarks/fusion.py --sizes 4096x256 --chains GELU-tanh,SiLU-mul --no-layer

For each chain (hyperparallel/fusion/vf_chains.py) and size: runtime of the decomposed eager code
(what a model's Python says), of eager with native fused ops where PyTorch has them (F.silu,
F.gelu, F.rms_norm, softmax), of torch.compile with Inductor, with dvm's per-op VM
(HYPERPARALLEL_DVM_VF=0: a pass over the tile per op) and with dvm (VFs: one pass for the ops a
VF covers), each under two memory regimes, every contender under both:
- "allocator": outputs from the allocator as it comes (glibc's defaults; dvm's host buffer
  cache off), so a large fresh output costs its page faults;
- "reused": freed memory kept for the next output: dvm's host buffer cache on, and glibc told
  not to give freed memory back (mallopt: blocks below its 32 MiB mmap ceiling reused from the
  heap, no trimming). Blocks of 32 MiB and more (the 16M-element fp32 and bf16 tensors) are
  mmapped by glibc whatever it is told: there only dvm can reuse memory.
Then each backend's compile time, measured the same way for both: the time spent inside the
backend callable (Dynamo's tracing excluded), with Inductor's and our caches off, and the time to
build one fused operator's bytecode (DVM's "compile": the median of 200 builds of the chain's
largest cluster). Last, the default config's model (configs/default.yaml) with its decoder layers
compiled each way: the first training step's extra time over a later one (tracing, AOTAutograd,
the backend), and the backend's own part (Inductor's code generation and C++ compilation; dvm's
clustering and bytecode), forward and backward.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the chains of the VF table (hyperparallel/fusion/vf_chains.py) timed here, forward
BENCH_CHAINS = ["SiLU", "SiLU-mul", "SwiGLU", "GELU-tanh", "GELU-erf", "RMSNorm", "softmax", "rotary", "cast chain"]


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


def keep_freed_memory() -> None:
    """glibc keeps freed blocks for the next allocation (no mmap below its 32 MiB ceiling, no trim)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, (1 << 31) - 1)):
        raise SystemExit("mallopt refused the settings")


def parse_size(text: str) -> tuple[int, int]:
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def chains_table(args) -> dict:
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from hyperparallel.fusion import compile as dvm_compile
    from hyperparallel.fusion import vf
    from hyperparallel.fusion.backend import dvm
    from hyperparallel.fusion.vf_chains import BY_NAME
    from hyperparallel.kernels import host_cache

    cache_limit = host_cache.limit()
    inductor_config.fx_graph_cache = False
    inductor_config.autotune_local_cache = False
    torch._dynamo.config.cache_size_limit = 256
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cases = []  # (chain, dtype name, rows, cols, inputs, {contender: fn})
    compile_rows = {}
    for rows, cols in sizes:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for name in args.chains.split(","):
                chain = BY_NAME[name]
                xs = chain.make(rows, cols, dtype, torch.Generator().manual_seed(0))
                inductor_seconds, dvm_seconds = [], []
                # static shapes: each size its own graphs (as the trainer's fixed shapes have)
                inductor = torch.compile(chain.fn, backend=timed_backend(compile_fx, inductor_seconds), dynamic=False)
                dvm_compile._CACHE.clear()
                dvm_compile.STATS["built_graphs"].clear()
                fused = torch.compile(lambda *a, f=chain.fn: f(*a), backend=timed_backend(dvm, dvm_seconds),
                                      dynamic=False)
                per_op = torch.compile(lambda *a, f=chain.fn: f(*a), backend=dvm, dynamic=False)
                with torch.no_grad():
                    want = chain.fn(*xs)
                    with vf.lowering_with(True):
                        got = fused(*xs)
                    built = list(dvm_compile.STATS["built_graphs"])
                    with vf.lowering_with(False):
                        if not torch.equal(per_op(*xs), got):
                            raise SystemExit(f"dvm with and without VFs differ on {name} {dtype_name}")
                    for label, out in (("Inductor", inductor(*xs)), ("dvm", got)):
                        err = (out.float() - want.float()).abs().max().item()
                        limit = 1e-5 if dtype == torch.float32 else 2e-2 * max(1.0, want.float().abs().max().item())
                        if err > limit:
                            raise SystemExit(f"{label} differs from eager on {name} {dtype_name}: {err}")
                if (name, dtype_name) not in compile_rows:
                    build_us = 1e6 * max(build_seconds(sub) for sub in built) if built else float("nan")
                    compile_rows[(name, dtype_name)] = (1e3 * sum(inductor_seconds), 1e3 * sum(dvm_seconds), build_us)
                fns = {"eager decomposed": chain.fn, "eager native": chain.native or chain.fn, "Inductor": inductor,
                       "dvm per-op": per_op, "dvm": fused}
                cases.append((name, dtype_name, rows, cols, xs, fns))

    results = {}
    print(f"Element-wise chains, torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeat} runs at 16M elements, more at smaller sizes (the same total work)")
    print("| chain | dtype | elements | memory | eager decomposed | eager native | Inductor | dvm per-op | dvm "
          "| VFs: dvm / per-op | dvm / Inductor | dvm / eager native |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for memory in ("allocator", "reused"):
        if memory == "allocator":
            host_cache.set_limit(0)
        else:
            keep_freed_memory()
            host_cache.set_limit(cache_limit)
        for name, dtype_name, rows, cols, xs, fns in cases:
            repeat = min(2000, max(args.repeat, args.repeat * (1 << 24) // (rows * cols)))
            with torch.no_grad():
                t = {}
                for label, fn in fns.items():  # (a compiled graph keeps the program it was lowered to)
                    t[label] = median_ms(fn, xs, repeat)
            results[f"{name}/{dtype_name}/{rows}x{cols}/{memory}"] = t
            print(f"| {name} | {dtype_name} | {rows * cols / 2**20:.2f}M | {memory} | {t['eager decomposed']:.3f} ms | "
                  f"{t['eager native']:.3f} ms | {t['Inductor']:.3f} ms | {t['dvm per-op']:.3f} ms | {t['dvm']:.3f} ms | "
                  f"{t['dvm'] / t['dvm per-op']:.2f} | {t['dvm'] / t['Inductor']:.2f} | "
                  f"{t['dvm'] / t['eager native']:.2f} |")
    rows0, cols0 = sizes[0]
    print(f"\nCompile time, {rows0} x {cols0} (the time inside the backend callable; Inductor's first compile in "
          "the process includes its start-up)")
    print("| chain | dtype | compile: Inductor | compile: dvm | Inductor / dvm | bytecode build |")
    print("|---|---|---|---|---|---|")
    for (name, dtype_name), (ci, cd, build_us) in compile_rows.items():
        results[f"{name}/{dtype_name}/compile"] = {"compile_inductor_ms": ci, "compile_dvm_ms": cd,
                                                    "bytecode_build_us": build_us}
        print(f"| {name} | {dtype_name} | {ci:.0f} ms | {cd:.1f} ms | {ci / cd:.0f}x | {build_us:.0f} us |")
    return results


def layer_compile_table() -> dict:
    """The default config's model, decoder layers compiled with Inductor and with dvm: one training
    step's extra time the first time, and the backend's own part of it."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from hyperparallel.fusion import backend as dvm_backend
    from hyperparallel.models import build_model, install_fused_loss
    from hyperparallel.models.compile import compile_layers
    from hyperparallel.models.kernels import use_kernels
    from hyperparallel.models.loss import fused_loss
    from hyperparallel.train.build import inline_model_config
    from hyperparallel.train.config import load_config

    cfg = load_config(None)
    ids = torch.randint(0, 4096, (cfg.training.micro_batch, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
    own: list[float] = []  # the backend's own seconds, forward and backward graphs

    def inner(gm, example_inputs, **kwargs):
        t0 = time.perf_counter()
        try:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        finally:
            own.append(time.perf_counter() - t0)

    real_fuse = dvm_backend.fuse

    def timed_fuse(gm):
        t0 = time.perf_counter()
        try:
            return real_fuse(gm)
        finally:
            own.append(time.perf_counter() - t0)

    backends = {"Inductor": lambda gm, ex: compile_fx(gm, ex, inner_compile=inner), "dvm": "dvm"}
    out = {}
    print("\nCompiling the decoder layers of configs/default.yaml's model (Qwen3-MoE, 4 layers, micro-batch "
          f"{cfg.training.micro_batch} x {cfg.data.seq_len}), one training step, forward and backward")
    print("| backend | first step | a later step | compile overhead | the backend's own part |")
    print("|---|---|---|---|---|")
    for label, backend in backends.items():
        torch._dynamo.reset()
        model = build_model(cfg.model.family, config=inline_model_config(cfg, 4096), dtype=torch.float32,
                            attn_implementation=cfg.model.attention(), seed=0)
        use_kernels(model, mega_gate=True, mega_mhc=True)
        install_fused_loss(model, None)
        compile_layers(model, "dvm" if backend == "dvm" else "none")
        if backend != "dvm":
            for layer in model.model.layers:
                layer.forward = torch.compile(layer.forward, backend=backend)
        own.clear()
        dvm_backend.fuse = timed_fuse
        try:
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                with fused_loss(model):
                    model(input_ids=ids, labels=ids).loss.backward()
                times.append(time.perf_counter() - t0)
        finally:
            dvm_backend.fuse = real_fuse
        later = statistics.median(times[1:])
        overhead, mine = times[0] - later, sum(own)
        out[label] = {"first_s": times[0], "later_s": later, "overhead_s": overhead, "own_s": mine}
        print(f"| {label} | {times[0]:.2f} s | {later:.3f} s | {overhead:.2f} s | {1e3 * mine:.0f} ms |")
    i, d = out["Inductor"], out["dvm"]
    print(f"Inductor / dvm: compile overhead {i['overhead_s'] / d['overhead_s']:.0f}x, the backends' own part "
          f"{i['own_s'] / d['own_s']:.0f}x")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024x256,2048x256,4096x256,4096x4096",
                        help="rows x cols, comma-separated (the trainer's: 1024 x 256 and 2048 x 256; 1M; 16M)")
    parser.add_argument("--chains", default=",".join(BENCH_CHAINS), help="of hyperparallel/fusion/vf_chains.py")
    parser.add_argument("--repeat", type=int, default=10, help="runs at 16M elements (more at smaller sizes)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-layer", dest="layer", action="store_false", help="skip the decoder layers' compile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-bench-"))
    results = {"chains": chains_table(args)}
    if args.layer:
        results["layer"] = layer_compile_table()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

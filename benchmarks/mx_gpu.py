"""MXFP8 on a GPU: quantize both operands + `mx.mx_mm` against a bf16 torch.mm, per GEMM path,
and the MoE experts of the seed shape, forward and backward, MXFP8 against bf16.

    python benchmarks/mx_gpu.py                        # on CUDA: the table, K = N = 4096
    python benchmarks/mx_gpu.py --json out.json        # the figures as JSON too
    python benchmarks/mx_gpu.py --device cpu --small   # a smoke run of this script's code, no GPU

Each GEMM path is forced through HYPERPARALLEL_MX_GEMM (`hyperparallel.mx.gemm_path`); a path
that cannot run on this device is listed with the reason (scaled_mm needs Blackwell's MX tensor
cores). Times are CUDA events around each call (the median of --repeat after --warmup calls);
on the CPU, perf_counter after the same calls. "quant+mm" quantizes the activation [M, K] and
the weight [N, K] (both along K) and multiplies; "mm" is the product of operands quantized
beforehand, as a cached weight copy and a quantized activation would be; "grads mm" the same
product in the operand layout of MXLinear's input- and weight-grad products. TFLOP/s count 2 M N K.
The MoE case is benchmarks/lowp.py's `moe_case` built on the device: the same weights and
inputs through GroupedExperts in bf16 and with the MXFP8 recipe. scripts/gpu_check.sh runs this
on a lent H200 (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hyperparallel import mx
from hyperparallel.errors import BackendError
from hyperparallel.mx import gemm_path

HERE = Path(__file__).resolve().parent


def lowp_benchmark():
    """benchmarks/lowp.py as a module (its `moe_case` builds the experts)."""
    spec = importlib.util.spec_from_file_location("hp_benchmarks_lowp", HERE / "lowp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Timer:
    """Median milliseconds of calls: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, warmup: int, repeat: int):
        self.device, self.warmup, self.repeat = device, warmup, repeat

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stamp(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        self._sync()
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.device.type == "cuda":
            end.synchronize()
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def median_ms(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self._sync()
        times = []
        for _ in range(self.repeat):
            start = self.stamp()
            fn()
            end = self.stamp()
            times.append(self.elapsed_ms(start, end))
        return statistics.median(times)

    def median_fwd_bwd_ms(self, forward) -> tuple[float, float]:
        """Median forward and backward milliseconds of `forward()` and a backward of ones."""
        def once():
            t0 = self.stamp()
            out = forward()
            t1 = self.stamp()
            out.backward(torch.ones_like(out))
            t2 = self.stamp()
            return t0, t1, t2

        for _ in range(self.warmup):
            once()
        self._sync()
        stamps = [once() for _ in range(self.repeat)]
        fwd = [self.elapsed_ms(a, b) for a, b, _ in stamps]
        bwd = [self.elapsed_ms(b, c) for _, b, c in stamps]
        return statistics.median(fwd), statistics.median(bwd)


def gemm_rows(device, sizes, paths, timer: Timer) -> list[dict]:
    rows = []
    for M, K, N in sizes:
        g = torch.Generator(device=device).manual_seed(M)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=g)  # an nn.Linear's [out, in]
        flops = 2.0 * M * N * K
        bf16_ms = timer.median_ms(lambda x=x, w=w: torch.mm(x, w.t()))
        a, b = mx.quantize(x, 1), mx.quantize(w, 1).t()
        # the same product in the layout of MXLinear's input- and weight-grad products: a a
        # transposed view of a copy blocked down its rows, b N-contiguous
        a_grads, b_grads = mx.quantize(x.t().contiguous(), 0).t(), mx.quantize(w.t().contiguous(), 0)
        for path in paths:
            row = {"M": M, "K": K, "N": N, "path": path, "bf16_ms": bf16_ms, "bf16_tflops": flops / bf16_ms / 1e9}
            try:
                with gemm_path.forcing(path):
                    mx.mx_mm(a, b)  # raises here if the path cannot serve this product

                    def quant_mm(x=x, w=w):
                        return mx.mx_mm(mx.quantize(x, 1), mx.quantize(w, 1).t())

                    row["quant_mm_ms"] = timer.median_ms(quant_mm)
                    row["mm_ms"] = timer.median_ms(lambda a=a, b=b: mx.mx_mm(a, b))
                    row["grads_mm_ms"] = timer.median_ms(lambda a=a_grads, b=b_grads: mx.mx_mm(a, b))
            except BackendError as error:
                row["skipped"] = str(error)
            if "skipped" not in row:
                row["quant_mm_tflops"] = flops / row["quant_mm_ms"] / 1e9
                row["mm_tflops"] = flops / row["mm_ms"] / 1e9
                row["quant_mm_vs_bf16"] = row["quant_mm_ms"] / bf16_ms
                row["mm_vs_bf16"] = row["mm_ms"] / bf16_ms
                row["grads_mm_vs_bf16"] = row["grads_mm_ms"] / bf16_ms
            rows.append(row)
        del x, w, a, b, a_grads, b_grads
    return rows


def moe_row(device, tokens, hidden, intermediate, experts, top_k, timer: Timer) -> dict:
    with torch.device(device):
        bf16, mxfp8, params = lowp_benchmark().moe_case(tokens, hidden, intermediate, experts, top_k)
    times = {}
    for label, fn in (("bf16", bf16), ("mxfp8", mxfp8)):
        times[label] = timer.median_fwd_bwd_ms(fn)
    row = {"tokens": tokens, "hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k,
           "gemm_path": gemm_path.plan(mx.quantize(torch.zeros(32, 32, device=device, dtype=torch.bfloat16), 1),
                                       mx.quantize(torch.zeros(32, 32, device=device, dtype=torch.bfloat16), 0),
                                       torch.bfloat16)[0]}
    for label, (f, b) in times.items():
        row[f"{label}_fwd_ms"], row[f"{label}_bwd_ms"] = f, b
    row["fwd_ratio"] = row["mxfp8_fwd_ms"] / row["bf16_fwd_ms"]
    row["bwd_ratio"] = row["mxfp8_bwd_ms"] / row["bf16_bwd_ms"]
    row["step_ratio"] = (row["mxfp8_fwd_ms"] + row["mxfp8_bwd_ms"]) / (row["bf16_fwd_ms"] + row["bf16_bwd_ms"])
    # the experts' products: two grouped GEMMs forward (gate_up: 2I wide, down), twice that backward
    flops = 2.0 * tokens * top_k * hidden * (2 * intermediate + intermediate)
    row["bf16_fwd_tflops"] = flops / row["bf16_fwd_ms"] / 1e9
    row["mxfp8_fwd_tflops"] = flops / row["mxfp8_fwd_ms"] / 1e9
    del params
    return row


def print_tables(result: dict) -> None:
    print(f"MXFP8 on {result['device_name']}, torch {result['torch']}, triton {result['triton']}, "
          f"warmup {result['warmup']}, median of {result['repeat']}")
    print(f"| {'M':>6} | {'K':>5} | {'N':>5} | {'path':<10} | {'bf16 ms':>8} | {'bf16 TF/s':>9} | "
          f"{'quant+mm ms':>11} | {'x bf16':>6} | {'TF/s':>6} | {'mm ms':>7} | {'x bf16':>6} | {'TF/s':>6} | "
          f"{'grads mm ms':>11} | {'x bf16':>6} |")
    print("|" + "|".join("-" * (w + 2) for w in (6, 5, 5, 10, 8, 9, 11, 6, 6, 7, 6, 6, 11, 6)) + "|")
    for r in result["gemm"]:
        head = f"| {r['M']:>6} | {r['K']:>5} | {r['N']:>5} | {r['path']:<10} | {r['bf16_ms']:>8.3f} | {r['bf16_tflops']:>9.1f} |"
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
        else:
            print(f"{head} {r['quant_mm_ms']:>11.3f} | {r['quant_mm_vs_bf16']:>6.2f} | {r['quant_mm_tflops']:>6.1f} | "
                  f"{r['mm_ms']:>7.3f} | {r['mm_vs_bf16']:>6.2f} | {r['mm_tflops']:>6.1f} | "
                  f"{r['grads_mm_ms']:>11.3f} | {r['grads_mm_vs_bf16']:>6.2f} |")
    m = result.get("moe")
    if m:
        print(f"\nMoE experts {m['experts']}x top{m['top_k']}, {m['tokens']} tokens, hidden {m['hidden']}, "
              f"intermediate {m['intermediate']} (MX GEMM path for plain products here: {m['gemm_path']})")
        print(f"| {'':<6} | {'fwd ms':>8} | {'bwd ms':>8} | {'fwd TF/s':>8} |")
        print(f"|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
        for label in ("bf16", "mxfp8"):
            print(f"| {label:<6} | {m[f'{label}_fwd_ms']:>8.2f} | {m[f'{label}_bwd_ms']:>8.2f} | "
                  f"{m[f'{label}_fwd_tflops']:>8.1f} |")
        print(f"| {'ratio':<6} | {m['fwd_ratio']:>8.2f} | {m['bwd_ratio']:>8.2f} | step {m['step_ratio']:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of the code)")
    parser.add_argument("--small", action="store_true", help="tiny shapes: checks the code, measures nothing")
    parser.add_argument("--m", default="2048,8192,16384", help="the activation rows M (K = N = --kn)")
    parser.add_argument("--kn", type=int, default=4096)
    parser.add_argument("--paths", default=",".join(gemm_path.PATHS), help="the GEMM paths to force")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE experts case")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures there as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --small for a smoke run)", file=sys.stderr)
        return 2
    if args.small:
        sizes = [(m, 256, 256) for m in (64, 128)]
        moe = (128, 64, 96, 4, 2)
        args.warmup, args.repeat = min(args.warmup, 1), min(args.repeat, 3)
    else:
        sizes = [(int(m), args.kn, args.kn) for m in args.m.split(",")]
        moe = (4096, 2048, 9216, 8, 2)  # the seed shape (benchmarks/lowp.py's defaults at 4096 tokens)
    timer = Timer(device, args.warmup, args.repeat)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton_version,
        "warmup": args.warmup, "repeat": args.repeat, "small": args.small,
        "gemm": gemm_rows(device, sizes, [p for p in args.paths.split(",") if p], timer),
    }
    if not args.no_moe:
        result["moe"] = moe_row(device, *moe, timer)
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

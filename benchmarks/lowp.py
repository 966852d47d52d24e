"""MXFP8 modules vs their bf16 originals: forward and backward time, saved activation bytes.

    python benchmarks/lowp.py                   # MoE of the seed shape (hidden 2048, intermediate
                                                # 9216, 8 experts top-2) on --tokens, and a Linear stack
    python benchmarks/lowp.py --tokens 256 --repeat 2      # quicker

Both sides run the same weights on the same inputs in one process, alternated. Saved bytes are
what autograd keeps between forward and backward (torch.autograd.graph.saved_tensors_hooks):
first everything it saves, parameters included (a bf16 module saves its weights, which cost no
extra memory; an MX module saves FP8 copies of them, which do), then without the parameters. On a CPU the MX products are emulated (exact
dequantization, then a bf16 or fp32 matmul), so MXFP8 cannot be faster here: the time rows say
what emulation costs; on a GPU with MX tensor cores the same script is the speed check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from hyperparallel.lowp import LowPrecisionConfig, convert
from hyperparallel.lowp.memory import saved_activation_bytes
from hyperparallel.moe import GroupedExperts


def timed(fn_forward, repeat: int) -> tuple[float, float]:
    """Median forward and backward seconds."""
    fwd, bwd = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn_forward()
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def moe_case(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int):
    torch.manual_seed(0)
    bf16 = GroupedExperts(experts, hidden, intermediate, nn.SiLU(), dtype=torch.bfloat16)
    bf16.reset_parameters(0.02)
    wrapper = nn.Module()
    wrapper.experts = GroupedExperts(experts, hidden, intermediate, nn.SiLU(), dtype=torch.bfloat16)
    wrapper.experts.load_state_dict(bf16.state_dict())
    convert(wrapper, LowPrecisionConfig(enabled=True))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(tokens, experts)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights.to(torch.bfloat16)
    params = [*bf16.parameters(), *wrapper.parameters()]
    return (lambda: bf16(x, index, weights)), (lambda: wrapper.experts(x, index, weights)), params


def linear_case(tokens: int, width: int, layers: int):
    torch.manual_seed(0)
    bf16 = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    mx = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    mx.load_state_dict(bf16.state_dict())
    convert(mx, LowPrecisionConfig(enabled=True))
    x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
    return (lambda: bf16(x)), (lambda: mx(x)), [*bf16.parameters(), *mx.parameters()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens through the MoE (the seed used 4096)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=9216)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--linear-tokens", type=int, default=2048)
    parser.add_argument("--linear-width", type=int, default=2048)
    parser.add_argument("--linear-layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cases = {
        f"MoE {args.experts}x top{args.top_k} {args.tokens} tok {args.hidden}/{args.intermediate}":
            moe_case(args.tokens, args.hidden, args.intermediate, args.experts, args.top_k),
        f"Linear x{args.linear_layers} {args.linear_tokens} tok {args.linear_width}":
            linear_case(args.linear_tokens, args.linear_width, args.linear_layers),
    }
    rows = []
    for name, (bf16, mx, params) in cases.items():
        timed(bf16, 1), timed(mx, 1)  # warm-up
        times = {"bf16": ([], []), "mxfp8": ([], [])}
        for _ in range(args.repeat):  # alternate, so drift of the machine falls on both
            for label, fn in (("bf16", bf16), ("mxfp8", mx)):
                f, b = timed(fn, 1)
                times[label][0].append(f)
                times[label][1].append(b)
        med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in times.items()}
        saved = {"bf16": saved_activation_bytes(bf16), "mxfp8": saved_activation_bytes(mx)}
        extra = {"bf16": saved_activation_bytes(bf16, params), "mxfp8": saved_activation_bytes(mx, params)}
        rows.append({"case": name, "fwd_ms": {k: v[0] * 1e3 for k, v in med.items()},
                     "bwd_ms": {k: v[1] * 1e3 for k, v in med.items()}, "saved_bytes": saved,
                     "saved_bytes_without_params": extra})
    print(f"MXFP8 modules vs bf16, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu (MX products emulated)'}")
    print(f"| {'case':<34} | {'fwd ms bf16':>11} | {'mx':>7} | {'bwd ms bf16':>11} | {'mx':>7} | "
          f"{'saved MiB bf16':>14} | {'mx':>6} | {'ratio':>5} | {'w/o params bf16':>15} | {'mx':>6} | {'ratio':>5} |")
    print(f"|{'-' * 36}|{'-' * 13}|{'-' * 9}|{'-' * 13}|{'-' * 9}|{'-' * 16}|{'-' * 8}|{'-' * 7}|{'-' * 17}|{'-' * 8}"
          f"|{'-' * 7}|")
    for r in rows:
        f, b, s, e = r["fwd_ms"], r["bwd_ms"], r["saved_bytes"], r["saved_bytes_without_params"]
        r["saved_ratio"] = s["mxfp8"] / s["bf16"]
        r["saved_ratio_without_params"] = e["mxfp8"] / e["bf16"]
        print(f"| {r['case']:<34} | {f['bf16']:>11.1f} | {f['mxfp8']:>7.1f} | {b['bf16']:>11.1f} | {b['mxfp8']:>7.1f} | "
              f"{s['bf16'] / 2**20:>14.1f} | {s['mxfp8'] / 2**20:>6.1f} | {r['saved_ratio']:>5.3f} | "
              f"{e['bf16'] / 2**20:>15.1f} | {e['mxfp8'] / 2**20:>6.1f} | {r['saved_ratio_without_params']:>5.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

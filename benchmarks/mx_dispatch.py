"""MX dispatch (`moe.dispatch: mx`) against the compute-dtype dispatch, with MXFP8 experts: what it
changes (the first projection's weight gradient, hyperparallel.moe.exchange's [Note: MX
dispatch]) and what it saves (dispatch bytes), side by side in one run.

    python benchmarks/mx_dispatch.py                 # SQNR and bytes: one layer on 2 gloo ranks (a minute)
    python benchmarks/mx_dispatch.py --train 200     # + 200-step loss curves of the tiny Qwen3-MoE at ep=2
    python benchmarks/mx_dispatch.py --json out.json

1. One MoE layer (--hidden, --intermediate, --experts, --top-k; --tokens per rank) in bf16 on 2
   gloo ranks with expert parallelism (ep=2), forward and backward with a fixed output gradient,
   three ways: bf16 experts (high precision, the reference), MXFP8 experts with the rows
   dispatched in bf16 ("compute"), and with the rows dispatched as MX data ("mx"). For each
   expert weight gradient, the SQNR of one against another over every expert (both ranks), and
   whether the outputs and input gradients of compute and mx are equal to the bit. Two inputs:
   Gaussian tokens, and tokens whose channels have log-normal gains (sigma 0.5) with 8 outlier
   channels --outlier-gain times larger (as RMSNorm'd hidden states with a learned gain can
   have): an outlier shares its row-wise blocks with small values, which MX rows keep with fewer
   bits (FP8 subnormals) than blocks along the tokens do.
2. The bytes each exchange sent (hyperparallel.traffic, both ranks summed): compute vs mx.
3. --train N: `hyperparallel train configs/qwen3_moe.yaml --nproc 2` with parallel.ep=2 and bf16
   autocast for N steps, three runs (bf16; MXFP8, dispatch compute; MXFP8, dispatch mx), each
   step's loss (logging.every=1); the largest and final differences between the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hyperparallel import traffic
from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe
from hyperparallel.moe import GroupedExperts
from hyperparallel.moe.dispatch import ExpertParallel
from hyperparallel.parallel.expert_parallel import keep_local_experts

WAYS = ("bf16", "compute", "mx")  # bf16 experts; MXFP8 experts with each dispatch
INPUTS = ("gaussian", "outlier channels")
PAIRS = (("compute", "mx"), ("bf16", "compute"), ("bf16", "mx"))  # (reference, other)
OUTLIERS = 8
REPO = Path(__file__).resolve().parents[1]


def make_tokens(kind: str, tokens: int, hidden: int, outlier_gain: float, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(tokens, hidden, generator=g)
    if kind == "outlier channels":
        gain = torch.exp(0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(7)))
        gain[:OUTLIERS] *= outlier_gain
        x = x * gain
    return x.bfloat16()


def local_experts(args: argparse.Namespace, mx: bool) -> GroupedExperts:
    """This rank's experts (the same weights in every way: seeded)."""
    torch.manual_seed(0)
    experts = GroupedExperts(args.experts, args.hidden, args.intermediate, nn.SiLU(), dtype=torch.bfloat16)
    experts.reset_parameters(std=0.02)
    keep_local_experts(experts, dist.get_world_size(), dist.get_rank())
    if mx:
        experts.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    return experts


def one_way(way: str, args: argparse.Namespace, batch: tuple) -> dict:
    tokens, indices, weights, grad = batch
    ep = ExpertParallel(dist.group.WORLD, args.experts, dispatch="mx" if way == "mx" else "compute")
    experts = local_experts(args, mx=way != "bf16")
    x = tokens.clone().requires_grad_()
    with traffic.counting() as counted:
        out = ep(experts, x, indices, weights)
        out.backward(grad)
    return {"out": out.detach(), "dx": x.grad, "gate_up": experts.gate_up_proj.grad, "down": experts.down_proj.grad,
            "bytes": dict(counted.named)}


def layer_worker(rank: int, world: int, port: int, args: argparse.Namespace, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for kind in INPUTS:
        g = torch.Generator().manual_seed(100 + rank)
        tokens = make_tokens(kind, args.tokens, args.hidden, args.outlier_gain, g)
        indices = torch.rand(args.tokens, args.experts, generator=g).topk(args.top_k, dim=-1).indices
        weights = torch.rand(args.tokens, args.top_k, generator=g)
        grad = torch.randn(args.tokens, args.hidden, generator=g).bfloat16()
        runs = {way: one_way(way, args, (tokens, indices, weights, grad)) for way in WAYS}
        # per (pair, gradient): the signal and the noise, summed over both ranks' experts
        sums = torch.tensor([[runs[a][key].double().pow(2).sum(), (runs[a][key].double() - runs[b][key].double())
                              .pow(2).sum()] for a, b in PAIRS for key in ("gate_up", "down")], dtype=torch.float64)
        dist.all_reduce(sums)
        same = torch.tensor([torch.equal(runs["compute"][key], runs["mx"][key]) for key in ("out", "dx", "down")],
                            dtype=torch.int32)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        sent = torch.tensor([[runs[way]["bytes"].get(("ep", name), 0) for name in EXCHANGES] for way in WAYS[1:]],
                            dtype=torch.int64)
        dist.all_reduce(sent)
        results[kind] = {"sums": sums.tolist(), "equal": same.tolist(), "sent": sent.tolist()}
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


EXCHANGES = ("dispatch", "combine", "dispatch grad", "combine grad", "counts")


def sqnr_db(signal: float, noise: float) -> float:
    import math

    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layer_case(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "layer.pt")
        mp.spawn(layer_worker, args=(2, free_port(), args, out_file), nprocs=2)
        raw = torch.load(out_file)
    report = {}
    for kind, res in raw.items():
        sums = iter(res["sums"])
        sqnr = {f"{a} vs {b}": {key: sqnr_db(*next(sums)) for key in ("gate_up", "down")} for a, b in PAIRS}
        sent = {way: dict(zip(EXCHANGES, row, strict=True)) for way, row in zip(WAYS[1:], res["sent"], strict=True)}
        report[kind] = {"sqnr_db": sqnr, "bit_equal": dict(zip(("out", "dx", "down"), map(bool, res["equal"]),
                                                               strict=True)), "bytes": sent}
    return report


def print_layer(report: dict, args: argparse.Namespace) -> None:
    print(f"One MoE layer, bf16, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, expert intermediate "
          f"{args.intermediate}, {args.tokens} tokens per rank, ep=2 on 2 gloo ranks, torch {torch.__version__}")
    print("| input | gradient | MXFP8 mx vs compute dispatch | MXFP8 compute vs bf16 experts | MXFP8 mx vs bf16 experts |")
    print("|---|---|---|---|---|")
    for kind, res in report.items():
        for key in ("gate_up", "down"):
            cells = [res["sqnr_db"][f"{a} vs {b}"][key] for a, b in PAIRS]
            print(f"| {kind} | {key}_proj | " + " | ".join(f"{c:.1f} dB" for c in cells) + " |")
    for kind, res in report.items():
        print(f"{kind}: mx dispatch bit-equal to compute's: {res['bit_equal']}")
    bytes_ = report[INPUTS[0]]["bytes"]
    print("\nBytes sent by both ranks, forward + backward (hyperparallel.traffic)")
    print("| exchange | compute (bf16) | mx | mx / compute |")
    print("|---|---|---|---|")
    totals = {way: 0 for way in bytes_}
    for name in EXCHANGES:
        c, m = bytes_["compute"][name], bytes_["mx"][name]
        totals["compute"] += c
        totals["mx"] += m
        print(f"| {name} | {c} | {m} | {m / c:.3f}x |")
    forward = {way: bytes_[way]["dispatch"] + bytes_[way]["combine"] for way in bytes_}
    print(f"| dispatch + combine | {forward['compute']} | {forward['mx']} | {forward['mx'] / forward['compute']:.3f}x |")
    print(f"| all | {totals['compute']} | {totals['mx']} | {totals['mx'] / totals['compute']:.3f}x |")


def train_run(name: str, overrides: list[str], steps: int, root: Path) -> list[float]:
    run_dir = root / name
    command = [sys.executable, "-m", "hyperparallel", "train", str(REPO / "configs" / "qwen3_moe.yaml"), "--nproc", "2",
               "--set", "parallel.dp_shard=2", "--set", "parallel.ep=2", "--set", "training.micro_batch=8",
               "--set", f"training.steps={steps}", "--set", "training.mixed_precision=bf16",
               "--set", "logging.every=1", "--set", "logging.progress=false", "--set", f"logging.run_dir={run_dir}",
               "--set", "checkpoint.every=0", "--set", f"checkpoint.dir={root / 'checkpoints' / name}",
               "--set", "training.eval_every=0"]
    for item in overrides:
        command += ["--set", item]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "HYPERPARALLEL_CACHE": str(root / "cache")})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def train_case(steps: int) -> dict:
    runs = {"bf16": [], "compute": ["low_precision.enabled=true", "moe.dispatch=compute"],
            "mx": ["low_precision.enabled=true", "moe.dispatch=mx"]}
    with tempfile.TemporaryDirectory() as tmp:
        losses = {name: train_run(name, overrides, steps, Path(tmp)) for name, overrides in runs.items()}
    report = {"losses": losses}
    for a, b in PAIRS:
        diffs = [abs(x - y) for x, y in zip(losses[a], losses[b], strict=True)]
        report[f"{a} vs {b}"] = {"max_abs": max(diffs), "final_abs": diffs[-1],
                                 "last10_mean_abs": abs(sum(losses[a][-10:]) - sum(losses[b][-10:])) / 10}
    return report


def print_train(report: dict, steps: int) -> None:
    print(f"\nTiny Qwen3-MoE (configs/qwen3_moe.yaml), ep=2 on 2 gloo ranks, bf16 autocast, {steps} steps")
    print("| runs | max |loss difference| | at the last step | last 10 steps' means |")
    print("|---|---|---|---|")
    for a, b in PAIRS:
        r = report[f"{a} vs {b}"]
        print(f"| {b} vs {a} | {r['max_abs']:.4f} | {r['final_abs']:.4f} | {r['last10_mean_abs']:.4f} |")
    finals = ", ".join(f"{name} {sum(v[-10:]) / 10:.4f}" for name, v in report["losses"].items())
    print(f"mean loss of the last 10 steps: {finals}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="per rank")
    parser.add_argument("--outlier-gain", type=float, default=30.0, help="of the outlier channels (8 of them)")
    parser.add_argument("--train", type=int, default=0, help="steps of the loss-curve runs (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {"layer": layer_case(args)}
    print_layer(report["layer"], args)
    if args.train:
        report["train"] = train_case(args.train)
        print_train(report["train"], args.train)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

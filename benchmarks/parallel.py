"""Parallel layouts at 2 ranks, side by side in one run: per-rank memory and tokens/s.

    python benchmarks/parallel.py                    # seq 1024 and 8192, 3 timed steps each
    python benchmarks/parallel.py --seqs 1024 --steps 2 --json parallel.json

The same model (a Qwen3 of --hidden / --layers / --heads, fp32) and the same global batch (two
sequences of each length) trained by the trainer's own build and step (`build_trained_model`,
`TrainStep`: AdamW, fused loss, clipping) on two gloo ranks, one thread each, in four layouts:

- dp_shard=2: FSDP, each rank trains one sequence;
- tp=2 (sequence parallel): heads, MLP columns and vocabulary split, each rank runs both
  sequences (one micro-batch at a time) with its half of every weight;
- cp=2 ring and cp=2 ulysses: each rank holds half of every sequence (load-balanced chunks)
  and FSDP shards the weights over the two.

Every layout runs micro-batches of one sequence (tp and cp accumulate two). The layouts are
built side by side and stepped in turn, so that drift of the machine falls on each alike.

Memory per rank, by a dispatch mode that follows every tensor storage an operator makes and
frees (`hyperparallel plan`'s recorder idea; the CPU allocator's own slack aside), in one
recorded step after the timed ones:
- peak: the most tensor bytes alive at once in the step (model state included);
- model state: parameters and optimizer state, alive between steps;
- activations: the most bytes alive at once during a micro-batch's forward and backward above
  what was alive when it began: saved activations and their gradients, and FSDP's gathered
  layers and new gradients (small beside them at these sequence lengths). What context
  parallelism divides; the goal: cp's at 8k <= 0.6x dp_shard's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyperparallel.train import data
from hyperparallel.train.build import build_optimization, build_trained_model
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime
from hyperparallel.train.step import TrainStep

LAYOUTS = {
    "dp_shard=2": {"dp_shard": 2},
    "tp=2 (sp)": {"tp": 2, "sequence_parallel": True},
    "cp=2 ring": {"cp": 2, "cp_mode": "ring"},
    "cp=2 ulysses": {"cp": 2, "cp_mode": "ulysses"},
}
VOCAB = 4096


def layouts(args) -> dict:
    """--layouts (labels, comma-separated), dp_shard=2 always first: the ratios are to it."""
    wanted = args.layouts or list(LAYOUTS)
    unknown = [w for w in wanted if w not in LAYOUTS]
    if unknown:
        sys.exit(f"error: --layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    return {label: LAYOUTS[label] for label in LAYOUTS if label == "dp_shard=2" or label in wanted}


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages made while it is on, as operators make them and autograd frees
    them; `peak`: the most at once above what was alive at the last `mark()`."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.base = 0, 0, 0
        self.highest = 0  # the most bytes made here alive at once
        self._seen: set[int] = set()

    def mark(self) -> None:
        self.base = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._seen or key in inputs:  # a view, or an op returning its input
                    continue
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live - self.base)
                self.highest = max(self.highest, self.live)
                weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def layout_config(args, seq: int, parallel: dict) -> TrainConfig:
    model = {"vocab_size": VOCAB, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
             "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.heads // 2,
             "head_dim": args.hidden // args.heads, "max_position_embeddings": max(args.seqs), "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    return TrainConfig.model_validate({
        "model": {"family": "qwen3", "config": model},
        "data": {"seq_len": seq, "packing": True},
        "training": {"global_batch": 2, "micro_batch": 1, "steps": args.steps + 2, "compile": "none",
                     "max_grad_norm": 1.0},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "parallel": parallel})


def state_bytes(model, optimizer) -> int:
    tensors = {id(t): t for t in model.parameters()}
    tensors |= {id(p.grad): p.grad for p in model.parameters() if p.grad is not None}
    tensors |= {id(t): t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rank_worker(rank: int, world: int, out_dir: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    rt = Runtime(rank, world, torch.device("cpu"))
    results = {}
    for seq in args.seqs:
        runs = {}
        for label, parallel in layouts(args).items():
            cfg = layout_config(args, seq, parallel)
            torch.manual_seed(0)
            built = build_trained_model(cfg, rt, VOCAB)
            optimizer, scheduler = build_optimization(cfg, built.model)
            replica, replicas = built.mesh.dp_rank, built.mesh.dp_size
            sequences = torch.randint(0, VOCAB, (2 * (args.steps + 2), seq), generator=torch.Generator().manual_seed(1))
            batches = data.Batches(data.TensorRows(sequences), data.InOrder(len(sequences)), 2, 1, replica, replicas)
            step = TrainStep(built, optimizer, scheduler, accumulation=cfg.grad_accumulation(world),
                             device=rt.device, autocast_bf16=False, max_grad_norm=1.0)
            runs[label] = {"built": built, "optimizer": optimizer, "step": step, "batches": batches, "times": []}
        for i in range(args.steps + 2):  # the first step is a warm-up; the last is recorded for memory
            for run in runs.values():
                dist.barrier()
                if i == args.steps + 1:
                    before = state_bytes(run["built"].model, run["optimizer"])
                    live = LiveBytes()
                    hook = run["built"].model.register_forward_pre_hook(lambda *_, live=live: live.mark())  # each micro-batch
                    with live:
                        run["step"](run["batches"].micro_batches(i))
                    hook.remove()
                    run["memory"] = {"state": before, "activations": live.peak, "peak": before + live.highest}
                    continue
                t0 = time.perf_counter()
                run["step"](run["batches"].micro_batches(i))
                dist.barrier()
                if i:
                    run["times"].append(time.perf_counter() - t0)
        results[seq] = {label: {"step_s": statistics.median(run["times"]), **run["memory"]}
                        for label, run in runs.items()}
        del runs
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_worker, args=(2, out_dir, args), nprocs=2)
        per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    table = {}
    for seq in args.seqs:
        rows = {}
        for label in layouts(args):
            r = [p[seq][label] for p in per_rank]
            step_s = max(x["step_s"] for x in r)
            rows[label] = {"tokens_per_s": 2 * seq / step_s, "step_s": step_s,
                           "state_MiB": max(x["state"] for x in r) / 2**20,
                           "activations_MiB": max(x["activations"] for x in r) / 2**20,
                           "peak_MiB": max(x["peak"] for x in r) / 2**20}
        table[seq] = rows
    return table


def print_table(args, table: dict) -> None:
    print(f"Qwen3 hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {VOCAB}, fp32, AdamW; "
          f"2 gloo ranks of 1 thread; global batch 2 sequences; torch {torch.__version__}")
    print("| seq | layout | tokens/s | vs dp_shard=2 | peak MiB/rank | model state MiB/rank | activations MiB/rank "
          "| vs dp_shard=2 |")
    print("|-----|--------|----------|---------------|---------------|----------------------|----------------------"
          "|---------------|")
    for seq, rows in table.items():
        base = rows["dp_shard=2"]
        for label, row in rows.items():
            print(f"| {seq} | {label} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                  f"{row['peak_MiB']:.1f} | {row['state_MiB']:.1f} | {row['activations_MiB']:.1f} | "
                  f"{row['activations_MiB'] / base['activations_MiB']:.2f}x |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=None,
                        help=f"a subset of {', '.join(LAYOUTS)} (dp_shard=2 always runs)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    table = run(args)
    print_table(args, table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pipeline schedules' step time against the same work without a pipeline, beside each schedule's
theoretical bubble.

    python benchmarks/pipeline.py                 # pp=2 on 2 ranks, then pp=4 on 4
    python benchmarks/pipeline.py --worlds 2 --steps 3 --json pipeline.json

On `world` gloo ranks, the same model (a Qwen3 of --hidden / --layers, fp32, untied head) and
global batch (--batch sequences of --seq tokens, micro-batches of one sequence) trained by the
trainer's own build and step (`build_trained_model`, `TrainStep`: AdamW, fused loss, clipping):

- dp_shard=world: no pipeline, FSDP over the ranks, each reading batch / world sequences: the
  same work with no rank waiting on another's stage;
- pp=world with 1f1b, gpipe, and interleaved_1f1b (2 stages a rank): each rank runs its stage
  over all batch sequences, micro-batch by micro-batch.

The layouts are built side by side and stepped in turn (drift of the machine falls on each
alike); each row is the median of --steps timed steps after two warm-up steps. "over dp" is the
step time over dp_shard's, less 1: what the pipeline costs beyond the same work spread without
one. The theoretical bubble is the schedule's idle share of a step with p stages and m
micro-batches: (p - 1) / (m + p - 1) for 1f1b and gpipe, (p - 1) / (v m + p - 1) with v stages
a rank for interleaved_1f1b. On a CPU with fewer cores than ranks (pp=4 here: 4 ranks on 2 cores)
a rank's bubble is another rank's core time, so the measured cost there is not the bubble.
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
import torch.multiprocessing as mp

from hyperparallel.train import data
from hyperparallel.train.build import build_optimization, build_trained_model
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime, joined
from hyperparallel.train.step import TrainStep

VOCAB = 4096


def layouts(world: int) -> dict[str, dict]:
    return {f"dp_shard={world} (no pipeline)": {"dp_shard": world},
            f"pp={world} 1f1b": {"pp": world, "pp_schedule": "1f1b"},
            f"pp={world} gpipe": {"pp": world, "pp_schedule": "gpipe"},
            f"pp={world} interleaved_1f1b, 2 a rank": {"pp": world, "pp_schedule": "interleaved_1f1b",
                                                       "pp_virtual_stages": 2}}


def bubble(parallel: dict, micro_batches: int) -> float | None:
    p = parallel.get("pp", 1)
    if p == 1:
        return None
    v = parallel.get("pp_virtual_stages", 1)
    return (p - 1) / (v * micro_batches + p - 1)


def config(args, parallel: dict) -> TrainConfig:
    hf = {"vocab_size": VOCAB, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
          "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 32, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": args.seq, "tie_word_embeddings": False}
    return TrainConfig.model_validate({
        "model": {"family": "qwen3", "config": hf}, "data": {"seq_len": args.seq},
        "training": {"global_batch": args.batch, "micro_batch": 1, "steps": 100, "max_grad_norm": 1.0,
                     "compile": "none"},
        "optimizer": {"name": "adamw", "lr": 1e-4}, "parallel": parallel})


def run(rank: int, world: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port + world), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    g = torch.Generator().manual_seed(0)
    rows = data.TensorRows(torch.randint(1, VOCAB, (args.batch * (args.steps + 2), args.seq), generator=g), 0, True)
    with joined(600, torch.device("cpu")):
        rt = Runtime(rank, world, torch.device("cpu"))
        trainers = {}
        for name, parallel in layouts(world).items():
            torch.manual_seed(0)
            cfg = config(args, parallel)
            built = build_trained_model(cfg, rt, VOCAB)
            optimizer, scheduler = build_optimization(cfg, built.model)
            accumulation = cfg.grad_accumulation(world)
            step = TrainStep(built, optimizer, scheduler, accumulation=accumulation, device=rt.device,
                             autocast_bf16=False, max_grad_norm=1.0)
            batches = data.Batches(rows, data.InOrder(len(rows)), args.batch, 1, built.mesh.dp_rank,
                                   built.mesh.dp_size)
            trainers[name] = (step, batches, accumulation)
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for i in range(args.steps + 2):
            for name, (step, batches, _) in trainers.items():
                torch.distributed.barrier()
                start = time.perf_counter()
                step(batches.micro_batches(i))
                torch.distributed.barrier()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        if rank == 0:
            result = {name: {"ms": 1e3 * statistics.median(t), "micro_batches": trainers[name][2]}
                      for name, t in times.items()}
            Path(out).write_text(json.dumps(result))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,4", help="ranks (= pp) to run, comma-separated")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences a step (micro-batches of one)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--port", type=int, default=29610)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = {}
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(run, args=(world, args, out), nprocs=world)
            results[world] = json.loads(Path(out).read_text())
    cores = os.cpu_count()
    print(f"Pipeline schedules: Qwen3 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, fp32; "
          f"{args.batch} sequences of {args.seq} a step, micro-batches of 1; {cores} cores, torch "
          f"{torch.__version__}, gloo; median of {args.steps} steps")
    print("| ranks | layout | micro-batches a rank | ms/step | over dp | theoretical bubble |")
    print("|---|---|---|---|---|---|")
    for world, rows in results.items():
        reference = next(r["ms"] for name, r in rows.items() if name.startswith("dp_shard"))
        for name, r in rows.items():
            parallel = layouts(world)[name]
            b = bubble(parallel, r["micro_batches"])
            over = f"{r['ms'] / reference - 1:+.2f}" if b is not None else ""
            print(f"| {world} | {name} | {r['micro_batches']} | {r['ms']:.1f} | {over} | "
                  f"{'' if b is None else f'{b:.2f}'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

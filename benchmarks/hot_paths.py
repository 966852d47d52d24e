"""The Python cost of the per-step hot paths: one call of each on many small parameters.

    python benchmarks/hot_paths.py                    # 2 gloo ranks of 1 thread, 200 parameters of 7 rows
    python benchmarks/hot_paths.py --layers 200 --ranks 4

The parameters are --layers linears of --cols inputs and --rows outputs (weight and bias: 2 x
--layers parameters; --rows divides by no rank count, so shards are uneven) in one FSDP group.
At these sizes the collectives move a few KiB and the arithmetic is negligible, so what is timed
is the Python and the operator calls around them, which grow with parameters x ranks:

- all-gather: the group's unshard and reshard (copy-in, all-gather, copy-out into the full
  parameters, free);
- reduce-scatter: the group's gradients in, the reduce-scatter, each shard's `.grad` out;
- clip: `fsdp.clip_grad_norm_` over the shards' gradients (norm, all-reduce, scaling);
- Muon step: `hyperparallel.optim.Muon` on the sharded matrices (momentum, the owner plan, two
  all-to-alls, Newton-Schulz on tiny matrices, the updates);
- TP gradient sum: `sync_partial_grads` on the unsharded model with every parameter marked
  partial over a tp group of all ranks, half of them as replicated key/value weights.

Per call, over --repeats calls (after --warmup), each figure the slowest rank's: the median and the
fastest wall time, and the median CPU time of the calling thread (Python and the operators it
runs, not the time it waits for a collective or for a core: the steadiest figure on a shared
machine). Run it against another
checkout with `PYTHONPATH=<checkout> python benchmarks/hot_paths.py` to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Linear(args.cols, args.rows) for _ in range(args.layers)])


def timed(fn, args, before=None) -> tuple[list[float], list[float]]:
    """Wall time and the calling thread's CPU time of each call (the second is what Python and the
    operators cost this thread, whatever else the shared machine runs meanwhile)."""
    wall, cpu = [], []
    for i in range(args.warmup + args.repeats):
        if before is not None:
            before()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        elapsed, used = time.perf_counter() - t0, time.thread_time() - c0
        if i >= args.warmup:
            wall.append(elapsed)
            cpu.append(used)
    return wall, cpu


def fsdp_paths(args) -> dict[str, list[float]]:
    from hyperparallel.fsdp import clip_grad_norm_, fully_shard
    from hyperparallel.fsdp.group import _GROUP
    from hyperparallel.optim import Muon

    model = fully_shard(make_model(args))
    group = getattr(model, _GROUP)
    out = {}

    def gather():
        group.unshard()
        group.reshard()

    out["all-gather (unshard + reshard)"] = timed(gather, args)

    grads = [torch.randn_like(p.full) for p in group.params]

    def give_grads():
        for p, g in zip(group.params, grads, strict=True):
            p.full.grad = g.clone()
            p.shard.grad = None

    def reduce():
        group._start_reduce()
        group._finish_reduce()

    out["reduce-scatter (grads in, shards' grads out)"] = timed(reduce, args, give_grads)

    shard_grads = [torch.randn_like(p.shard) for p in group.params]

    def give_shard_grads():
        for p, g in zip(group.params, shard_grads, strict=True):
            p.shard.grad = g.clone()

    out["clip (fsdp.clip_grad_norm_)"] = timed(lambda: clip_grad_norm_(model, 1.0), args, give_shard_grads)

    matrices = [p for p in model.parameters() if p.ndim == 2]
    muon = Muon([{"params": matrices}, {"params": [p for p in model.parameters() if p.ndim != 2],
                                        "use_muon": False}], lr=1e-3)
    out["Muon step (sharded)"] = timed(muon.step, args, give_shard_grads)
    return out


def tp_paths(args, rank: int, world: int) -> dict[str, list[float]]:
    from hyperparallel.parallel.tensor_parallel import TP_STATE, TensorParallelState, sync_partial_grads

    model = make_model(args)
    names = [name for name, _ in model.named_parameters()]
    # whole-group partial sums for the first half; replicated key/value weights (one slot shared
    # by every rank) for the second
    partial = {name: (None if i < len(names) // 2 else (0, 1)) for i, name in enumerate(names)}
    setattr(model, TP_STATE, TensorParallelState(None, world, rank, False, partial=partial))
    grads = [torch.randn_like(p) for p in model.parameters()]

    def give_grads():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()

    return {"TP gradient sum (sync_partial_grads)": timed(lambda: sync_partial_grads(model), args, give_grads)}


def worker(rank: int, world: int, args, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    results = {**fsdp_paths(args), **tp_paths(args, rank, world)}
    figures = torch.tensor([[statistics.median(wall), min(wall), statistics.median(cpu)] for wall, cpu in results.values()],
                           dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(dict(zip(results, figures.tolist(), strict=True))))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=100, help="linears: 2 parameters each")
    parser.add_argument("--rows", type=int, default=7)
    parser.add_argument("--cols", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(args.ranks, args, out_dir), nprocs=args.ranks)
        results = json.loads(Path(out_dir, "results.json").read_text())
    import hyperparallel

    print(f"hot paths, {args.ranks} gloo ranks x {args.threads} thread(s), torch {torch.__version__}, "
          f"{Path(hyperparallel.__file__).parent.parent}: {2 * args.layers} parameters ({args.layers} x "
          f"Linear({args.cols}, {args.rows})); median of {args.repeats} calls, slowest rank")
    print("| path | wall, median | wall, fastest | calling thread's CPU, median |")
    print("|---|---|---|---|")
    for label, (median, fastest, cpu) in results.items():
        print(f"| {label} | {median * 1e3:.3f} ms | {fastest * 1e3:.3f} ms | {cpu * 1e3:.3f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

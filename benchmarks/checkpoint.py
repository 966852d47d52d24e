"""hyperparallel.checkpoint vs plain torch.distributed.checkpoint of PyTorch FSDP2, side by side.

    python benchmarks/checkpoint.py               # 2 gloo ranks, the model of benchmarks/fsdp.py
    python benchmarks/checkpoint.py --dim 1000    # bigger

Both sides hold the same model (uneven shapes) and AdamW state after one step, sharded over the
same ranks: ours by hyperparallel.fsdp (non-uniform shards, saved as chunks of their global
tensors: global shape and each rank's rows, no padding, plus an atomic rename and a JSON
manifest), FSDP2's as DTensors saved the way its docs show (get_model_state_dict /
get_optimizer_state_dict, dcp.save or dcp.async_save on a gloo group, dcp.load, set_state_dict).
Times are the slowest rank's, median of --rounds, contenders alternating, into fresh
directories on the same disk, each timed call after a full garbage collection (so no contender
pays for another's garbage); bytes are what is on disk.

- save / load: the whole call.
- background save, blocking: how long `async_save` holds the caller (the copy to CPU memory);
  the write goes on in a thread.
- training around a save: --steps training steps (forward, backward, clip, AdamW) of our
  sharded model with a checkpoint saved after the first, minus the same steps without one:
  what the save costs training, saved now (`checkpoint.save`) or in the background
  (`checkpoint.async_save`, waited for after the last step).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_state_dict


def _fsdp_benchmark():
    """The model and batches of benchmarks/fsdp.py: the same thing both benchmarks measure."""
    spec = importlib.util.spec_from_file_location("fsdp_benchmark", Path(__file__).with_name("fsdp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trained(args, kind: str):
    bench = _fsdp_benchmark()
    model = bench.Model(args.dim, args.hidden, args.layers, args.vocab)
    if kind == "hyperparallel":
        from hyperparallel.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = bench.batch(0, args, dist.get_rank())
    torch.nn.functional.cross_entropy(model(ids), labels).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def save_ours(model, opt, path):
    from hyperparallel import checkpoint

    checkpoint.save(path, model, opt, extra={"step": 1})


def load_ours(model, opt, path):
    from hyperparallel import checkpoint

    checkpoint.load(path, model, opt)


def save_fsdp2(model, opt, path):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(path))


def async_save_ours(model, opt, path):
    from hyperparallel import checkpoint

    return checkpoint.async_save(path, model, opt, extra={"step": 1})


_GLOO: list = []  # FSDP2's background saves get a gloo group of their own, as DCP's docs advise


def async_save_fsdp2(model, opt, path):
    if not _GLOO:
        _GLOO.append(dist.new_group(backend="gloo"))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    return dcp.async_save(state, checkpoint_id=str(path), process_group=_GLOO[0])


def wait(pending) -> None:
    (pending.wait if hasattr(pending, "wait") else pending.result)()


def load_fsdp2(model, opt, path):
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


CONTENDERS = {"hyperparallel": (save_ours, load_ours, async_save_ours),
              "FSDP2 + DCP": (save_fsdp2, load_fsdp2, async_save_fsdp2)}


def train_step(model, opt, args, step: int) -> None:
    from hyperparallel.fsdp import clip_grad_norm_

    ids, labels = _fsdp_benchmark().batch(step, args, dist.get_rank())
    torch.nn.functional.cross_entropy(model(ids), labels).backward()
    clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()


def steps_around_a_save(model, opt, args, how: str, path: Path) -> float:
    """--steps training steps, with a checkpoint after the first (how: none, now, background)."""
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    pending = None
    for step in range(args.steps):
        train_step(model, opt, args, step)
        if step == 0 and how == "now":
            save_ours(model, opt, path)
        elif step == 0 and how == "background":
            pending = async_save_ours(model, opt, path)
    if pending is not None:
        pending.wait()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def timed(fn) -> float:
    gc.collect()  # every contender starts with the collector's generations empty: none pays for another's garbage
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(rank: int, world: int, args, out_dir: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    built = {name: trained(args, name) for name in CONTENDERS}
    results = {name: {"save": [], "load": [], "async_blocking": [], "bytes": 0} for name in CONTENDERS}
    results["training"] = {how: [] for how in ("none", "now", "background")}
    for round_ in range(args.rounds + 1):  # round 0 warms up (first collectives, lazy imports)
        for name, (save, load, async_save) in CONTENDERS.items():
            model, opt = built[name]
            path = Path(out_dir, f"{name.split()[0]}-{round_}")
            t_save = timed(lambda: save(model, opt, path))  # noqa: B023 (called at once)
            t_load = timed(lambda: load(model, opt, path))  # noqa: B023
            if rank == 0:
                results[name]["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            pending = []
            t_async = timed(lambda: pending.append(async_save(model, opt, Path(f"{path}-async"))))  # noqa: B023
            wait(pending[0])
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
                shutil.rmtree(f"{path}-async", ignore_errors=True)
            if round_:
                results[name]["save"].append(t_save)
                results[name]["load"].append(t_load)
                results[name]["async_blocking"].append(t_async)
        model, opt = built["hyperparallel"]
        for how in results["training"]:
            path = Path(out_dir, f"training-{how}-{round_}")
            elapsed = steps_around_a_save(model, opt, args, how, path)
            if round_:
                results["training"][how].append(elapsed)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=1375)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=2001)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="training steps around a save")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as out_dir:
        mp.spawn(worker, args=(args.ranks, args, out_dir), nprocs=args.ranks)
        results = json.loads(Path(out_dir, "results.json").read_text())

    mine, theirs = results["hyperparallel"], results["FSDP2 + DCP"]
    print(f"Checkpoints, {args.ranks} gloo ranks, torch {torch.__version__}: {args.layers} blocks "
          f"{args.dim}->{args.hidden}->{args.dim}, vocab {args.vocab}, model + AdamW state; median of {args.rounds} "
          f"rounds (slowest rank), contenders alternating")
    print("| | hyperparallel | FSDP2 + DCP | hyperparallel is |")
    print("|---|---|---|---|")
    table = {}
    for key, label in (("save", "save"), ("load", "load"), ("async_blocking", "background save, blocking")):
        a, b = statistics.median(mine[key]) * 1e3, statistics.median(theirs[key]) * 1e3
        table[key] = {"hyperparallel_ms": a, "fsdp2_ms": b}
        print(f"| {label} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f}x faster (time ratio {a / b:.2f}) |")
    a, b = mine["bytes"], theirs["bytes"]
    table["bytes"] = {"hyperparallel": a, "fsdp2": b}
    print(f"| bytes written | {a / 2**20:.2f} MiB | {b / 2**20:.2f} MiB | {a / b:.3f}x the bytes |")
    training = {how: statistics.median(times) * 1e3 for how, times in results["training"].items()}
    table["training"] = training
    added = {how: training[how] - training["none"] for how in ("now", "background")}
    print(f"\nTraining around a save (hyperparallel, {args.steps} steps, a checkpoint after the first):")
    print("| | ms | training time the save adds | vs saving now |")
    print("|---|---|---|---|")
    print(f"| no save | {training['none']:.1f} | | |")
    print(f"| save now (checkpoint.save) | {training['now']:.1f} | {added['now']:.1f} ms | |")
    print(f"| save in the background (checkpoint.async_save) | {training['background']:.1f} | "
          f"{added['background']:.1f} ms | {added['background'] / added['now']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table, "raw": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

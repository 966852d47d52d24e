"""hyperparallel FSDP vs PyTorch FSDP2 (torch.distributed.fsdp.fully_shard), side by side in one run.

    python benchmarks/fsdp.py                      # 2 gloo ranks, 1 thread each (this 2-core machine)
    python benchmarks/fsdp.py --ranks 4 --dim 256  # other sizes

The same model (an MLP-block transformer stand-in with uneven shapes: no weight's rows divide by
the ranks), the same seeded weights and batches, on the same ranks; the contenders alternate in
rounds. Three comparisons:

1. AdamW: whole step (forward, backward, clip, AdamW) with hyperparallel.fsdp vs FSDP2.
2. Muon, optimizer step only: hyperparallel.optim.Muon on hyperparallel.fsdp (each matrix
   orthogonalized once, by its owner rank) vs FSDP2 with the naive approach (every rank gathers
   every full gradient with DTensor.full_tensor() and runs Newton-Schulz on all of them, as
   torch.optim.Muon on the full matrix would, then keeps its own rows).
3. Muon, whole step throughput, both ways.

Also each rank's bytes of parameters, gradients and optimizer state against one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(step: int, args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, args.vocab, (args.tokens + 1,), generator=g)
    return ids[:-1], ids[1:]


def is_matrix(name: str, p) -> bool:
    return name.startswith("layers.") and p.ndim == 2


# ----------------------------------------------------------------------------------- contenders

def ours(args, optimizer: str):
    from hyperparallel.fsdp import clip_grad_norm_, fully_shard
    from hyperparallel.optim import Muon

    model = Model(args.dim, args.hidden, args.layers, args.vocab)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    named = list(model.named_parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = Muon([{"params": [p for n, p in named if is_matrix(n, p)]},
                    {"params": [p for n, p in named if not is_matrix(n, p)], "use_muon": False}], lr=1e-3)
    return model, opt, lambda: clip_grad_norm_(model, 1.0), opt.step


def fsdp2(args, optimizer: str):
    from torch.distributed.fsdp import fully_shard

    from hyperparallel.optim.muon import advance_momentum, apply_muon_update, orthogonalize

    model = Model(args.dim, args.hidden, args.layers, args.vocab)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    named = list(model.named_parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, opt, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), opt.step
    matrices = [p for n, p in named if is_matrix(n, p)]
    adamw = torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=1e-3, weight_decay=0.1)
    momentum: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def naive_muon_step():
        for p in matrices:
            grad = p.grad.full_tensor()  # every rank gathers every full gradient...
            buf = momentum.setdefault(id(p), torch.zeros_like(grad))
            direction = advance_momentum(grad, buf, momentum=0.95, nesterov=True)
            update = orthogonalize(direction)  # ...and orthogonalizes every matrix
            local = p.to_local()
            rows = local.shape[0]
            start = dist.get_rank() * -(-grad.shape[0] // dist.get_world_size())  # FSDP2 shards like torch.chunk
            apply_muon_update(local, update[start:start + rows], lr=1e-3, weight_decay=0.1, adjust_lr_fn=None,
                              matrix_shape=grad.shape)
        adamw.step()

    class Both:
        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=set_to_none)

        @property
        def state(self):  # what this optimizer holds: full-size momentum per matrix, AdamW's moments
            return {**{k: {"momentum_buffer": v} for k, v in momentum.items()}, **adamw.state}

    return model, Both(), lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), naive_muon_step


CONTENDERS = {"hyperparallel": ours, "FSDP2": fsdp2}


def held_bytes(model, opt) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    state = getattr(opt, "state", {})
    tensors += [local(t) for s in state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_steps(model, opt, clip, step_fn, args, rank: int, steps: int, first: int) -> tuple[list[float], list[float]]:
    step_times, opt_times = [], []
    for step in range(first, first + steps):
        ids, labels = batch(step, args, rank)
        dist.barrier()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        clip()
        t1 = time.perf_counter()
        step_fn()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        step_times.append(t2 - t0)
        opt_times.append(t2 - t1)
    return step_times, opt_times


def worker(rank: int, world: int, args, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    results: dict = {}
    for optimizer in ("adamw", "muon"):
        built = {name: make(args, optimizer) for name, make in CONTENDERS.items()}
        for model, opt, clip, step_fn in built.values():  # warm-up: lazy state, first collectives
            run_steps(model, opt, clip, step_fn, args, rank, args.warmup, 0)
        for round_ in range(args.rounds):
            for name, (model, opt, clip, step_fn) in built.items():
                steps, opt_steps = run_steps(model, opt, clip, step_fn, args, rank, args.steps,
                                             args.warmup + round_ * args.steps)
                entry = results.setdefault(f"{name}/{optimizer}", {"step": [], "opt": []})
                entry["step"] += steps
                entry["opt"] += opt_steps
        for name, (model, opt, clip, step_fn) in built.items():  # measured with the gradients still there
            ids, labels = batch(0, args, rank)
            torch.nn.functional.cross_entropy(model(ids), labels).backward()
            clip()
            step_fn()
            results[f"{name}/{optimizer}"]["bytes"] = held_bytes(model, opt)
            opt.zero_grad(set_to_none=True)
        del built
    # the slowest rank sets the pace: per step, the max over ranks
    for entry in results.values():
        for key in ("step", "opt"):
            t = torch.tensor(entry[key], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            entry[key] = t.tolist()
        b = torch.tensor([entry["bytes"]], dtype=torch.float64)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        entry["bytes"] = int(b.item())
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def one_process_bytes(args) -> dict[str, int]:
    from hyperparallel.optim import Muon

    out = {}
    for optimizer in ("adamw", "muon"):
        model = Model(args.dim, args.hidden, args.layers, args.vocab)
        named = list(model.named_parameters())
        opt = (torch.optim.AdamW(model.parameters()) if optimizer == "adamw" else
               Muon([{"params": [p for n, p in named if is_matrix(n, p)]},
                     {"params": [p for n, p in named if not is_matrix(n, p)], "use_muon": False}]))
        ids, labels = batch(0, args, 0)
        torch.nn.functional.cross_entropy(model(ids), labels).backward()
        opt.step()
        out[optimizer] = held_bytes(model, opt)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dim", type=int, default=500)
    parser.add_argument("--hidden", type=int, default=1375)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=2001)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the table's numbers here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(args.ranks, args, out_dir), nprocs=args.ranks)
        results = json.loads(Path(out_dir, "results.json").read_text())
    single = one_process_bytes(args)

    def ms(name, key):
        return 1e3 * statistics.median(results[name][key])

    tokens = args.tokens * args.ranks
    print(f"FSDP, {args.ranks} gloo ranks x {args.threads} thread(s), torch {torch.__version__}: {args.layers} blocks "
          f"{args.dim}->{args.hidden}->{args.dim}, vocab {args.vocab}, {args.tokens} tokens per rank; median of "
          f"{args.rounds} rounds x {args.steps} steps (slowest rank), contenders alternating")
    rows = ["| comparison | hyperparallel | FSDP2 | hyperparallel is |", "|---|---|---|---|"]
    table = {}
    for label, optimizer, key in (("AdamW: step", "adamw", "step"),
                                  ("Muon: optimizer step (FSDP2: naive full_tensor + NS on every rank)", "muon", "opt"),
                                  ("Muon: step", "muon", "step")):
        a, b = ms(f"hyperparallel/{optimizer}", key), ms(f"FSDP2/{optimizer}", key)
        table[label] = {"hyperparallel_ms": a, "fsdp2_ms": b, "ratio": a / b, "speedup": b / a}
        rows.append(f"| {label} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f}x faster (time ratio {a / b:.2f}) |")
        if key == "step":
            rows.append(f"| {label}: throughput | {tokens / a * 1e3:,.0f} tok/s | {tokens / b * 1e3:,.0f} tok/s | |")
    for optimizer in ("adamw", "muon"):
        a, b = results[f"hyperparallel/{optimizer}"]["bytes"], results[f"FSDP2/{optimizer}"]["bytes"]
        one = single[optimizer]
        table[f"bytes/{optimizer}"] = {"hyperparallel": a, "fsdp2": b, "one_process": one}
        rows.append(f"| {optimizer}: params + grads + optimizer state, largest rank (one process: {one / 2**20:.1f} "
                    f"MiB) | {a / 2**20:.1f} MiB ({a / one:.2f}x) | {b / 2**20:.1f} MiB ({b / one:.2f}x) | |")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "table": table, "raw": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

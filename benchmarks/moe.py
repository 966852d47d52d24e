"""MoE at the seed's shape scaled to this machine, side by side in one run.

    python benchmarks/moe.py                       # hidden 2048, expert intermediate 9216 / 8, 8 experts top-2
    python benchmarks/moe.py --tokens 1024 --repeat 2 --json moe.json

1. Experts, one process: GroupedExperts forward + backward at --tokens tokens, bf16 products vs
   the MXFP8 recipe (on a CPU the MX products are emulated: exact dequantization, then a bf16
   grouped matmul), same weights and inputs, alternated. The ratio is mx / bf16.
2. Two gloo ranks training a one-layer Qwen3-MoE of that shape (AdamW, fp32): expert
   parallelism (ep=2: each rank holds half the experts; tokens travel by all-to-all) against
   FSDP over both ranks (dp_shard=2: every rank gathers every expert's weights per layer), same
   weights and global batch. Per rank: parameter + optimizer bytes, tokens/s (both ranks), and
   for ep=2 the time spent in the all-to-alls (every one blocks the layer: nothing overlaps them
   yet, so this is the exposed communication) as a fraction of the MoE layer's time.
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
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe
from hyperparallel.models import build_model
from hyperparallel.moe import GroupedExperts, MoEBlock
from hyperparallel.parallel import apply_expert_parallel, expert_layout, shard_model


def experts_case(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int, repeat: int) -> dict:
    torch.manual_seed(0)
    bf16 = GroupedExperts(experts, hidden, intermediate, nn.SiLU(), dtype=torch.bfloat16)
    bf16.reset_parameters(0.02)
    mx = GroupedExperts(experts, hidden, intermediate, nn.SiLU(), dtype=torch.bfloat16)
    mx.load_state_dict(bf16.state_dict())
    mx.recipe = MXExpertsRecipe(LowPrecisionConfig(enabled=True))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    weights, index = torch.randn(tokens, experts).softmax(-1).topk(top_k, dim=-1)
    grad = torch.randn(tokens, hidden, dtype=torch.bfloat16)

    def step(module):
        t0 = time.perf_counter()
        out = module(x, index, weights)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        module.zero_grad(set_to_none=True)
        x.grad = None
        return t1 - t0, t2 - t1

    step(bf16), step(mx)  # warm-up (and the MX weight copies of this weight version)
    times = {"bf16": [], "mxfp8": []}
    for _ in range(repeat):  # alternated, so drift of the machine falls on both
        for label, module in (("bf16", bf16), ("mxfp8", mx)):
            times[label].append(step(module))
    med = {k: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v)) for k, v in times.items()}
    return {"fwd_ms": {k: v[0] * 1e3 for k, v in med.items()}, "bwd_ms": {k: v[1] * 1e3 for k, v in med.items()},
            "ratio": sum(med["mxfp8"]) / sum(med["bf16"])}


def model_config(args) -> dict:
    return {"vocab_size": 512, "hidden_size": args.hidden, "intermediate_size": args.hidden * 2,
            "moe_intermediate_size": args.intermediate // args.experts, "num_hidden_layers": 1,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": args.hidden // 16,
            "num_experts": args.experts, "num_experts_per_tok": args.top_k, "norm_topk_prob": True,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


class AllToAllTimer:
    """Wall time inside torch.distributed.all_to_all_single (blocking here: all of it is exposed)."""

    def __init__(self):
        self.seconds = 0.0
        self._original = dist.all_to_all_single

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = self._original(*args, **kwargs)
            if kwargs.get("async_op"):
                out.wait()
            self.seconds += time.perf_counter() - t0
            return out

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original


class LayerTimer:
    """Wall time of the MoE block's forward and backward (hooks on the block)."""

    def __init__(self, block: nn.Module):
        self.seconds = 0.0
        self._start = 0.0
        block.register_forward_pre_hook(lambda m, a: self._begin())
        block.register_forward_hook(lambda m, a, o: self._end())
        block.register_full_backward_pre_hook(lambda m, g: self._begin())
        block.register_full_backward_hook(lambda m, gi, go: self._end())

    def _begin(self):
        self._start = time.perf_counter()

    def _end(self):
        self.seconds += time.perf_counter() - self._start


def rank_worker(rank: int, world: int, out_dir: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for label in ("dp_shard=2", "ep=2"):
        model = build_model("qwen3_moe", config=model_config(args), seed=0)
        layout = expert_layout(2, "cpu") if label == "ep=2" else None
        if layout is not None:
            apply_expert_parallel(model, layout)
        shard_model(model, experts=layout)
        block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        layer_time = LayerTimer(block)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        seq = args.seq
        rows = args.rank_tokens // seq
        steps, a2a, layer = [], 0.0, 0.0
        for step in range(args.steps + 1):
            ids = torch.randint(0, 512, (rows * world, seq), generator=torch.Generator().manual_seed(step))
            ids = ids[rank * rows:(rank + 1) * rows]
            layer_time.seconds = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            with AllToAllTimer() as timer:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            if step:  # the first is a warm-up
                steps.append(time.perf_counter() - t0)
                a2a += timer.seconds
                layer += layer_time.seconds
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim())
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        results[label] = {"step_s": statistics.median(steps), "param_bytes": params, "optimizer_bytes": state,
                          "a2a_s": a2a / args.steps, "moe_layer_s": layer / args.steps}
        del model, optimizer
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def parallel_case(args) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_worker, args=(2, out_dir, args), nprocs=2)
        per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    rows = {}
    for label in per_rank[0]:
        r = [p[label] for p in per_rank]
        step_s = max(x["step_s"] for x in r)
        rows[label] = {"param_optimizer_MiB": max(x["param_bytes"] + x["optimizer_bytes"] for x in r) / 2**20,
                       "tokens_per_s": 2 * args.rank_tokens / step_s, "step_s": step_s,
                       "a2a_fraction_of_moe_layer": (max(x["a2a_s"] for x in r) / max(x["moe_layer_s"] for x in r)
                                                     if r[0]["a2a_s"] else None)}
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens through the experts (the seed used 4096)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=9216, help="divided by --experts per expert")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rank-tokens", type=int, default=1024, help="tokens per rank per training step")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-parallel", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    inter = args.intermediate // args.experts
    experts = experts_case(args.tokens, args.hidden, inter, args.experts, args.top_k, args.repeat)
    print(f"MoE experts, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'cuda' if torch.cuda.is_available() else 'cpu (MX products emulated)'}")
    print(f"{args.experts} experts top-{args.top_k}, hidden {args.hidden}, expert intermediate {inter}, "
          f"{args.tokens} tokens, forward + backward")
    print("| experts | fwd ms | bwd ms | total ms | vs bf16 |")
    print("|---------|--------|--------|----------|---------|")
    for label in ("bf16", "mxfp8"):
        f, b = experts["fwd_ms"][label], experts["bwd_ms"][label]
        ratio = 1.0 if label == "bf16" else experts["ratio"]
        print(f"| {label:<7} | {f:>6.0f} | {b:>6.0f} | {f + b:>8.0f} | {ratio:>6.2f}x |")
    result = {"experts": experts}
    if not args.skip_parallel:
        parallel = parallel_case(args)
        result["parallel"] = parallel
        base = parallel["dp_shard=2"]
        print(f"\nOne-layer Qwen3-MoE of that shape on 2 gloo ranks (1 thread each), fp32, AdamW, "
              f"{args.rank_tokens} tokens per rank per step")
        print("| layout     | params + AdamW MiB per rank | tokens/s | vs dp_shard=2 | all-to-all / MoE layer |")
        print("|------------|-----------------------------|----------|---------------|------------------------|")
        for label, r in parallel.items():
            frac = "-" if r["a2a_fraction_of_moe_layer"] is None else f"{r['a2a_fraction_of_moe_layer'] * 100:.1f}%"
            print(f"| {label:<10} | {r['param_optimizer_MiB']:>27.1f} | {r['tokens_per_s']:>8.0f} | "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:>12.2f}x | {frac:>22} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

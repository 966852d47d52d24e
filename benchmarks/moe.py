"""MoE at the seed's shape scaled to this machine, side by side in one run.

    python benchmarks/moe.py                       # hidden 2048, expert intermediate 9216 / 8, 8 experts top-2
    python benchmarks/moe.py --tokens 1024 --repeat 2 --json moe.json
    python benchmarks/moe.py --trace-dir docs/images   # also keeps MegaMoE's trace and its picture

1. Experts, one process: GroupedExperts forward + backward at --tokens tokens, bf16 products vs
   the MXFP8 recipe (on a CPU the MX products are emulated: exact dequantization, then a bf16
   grouped matmul), same weights and inputs, alternated. The ratio is mx / bf16.
2. Two gloo ranks training a one-layer Qwen3-MoE of that shape (AdamW, fp32): expert
   parallelism (ep=2: each rank holds half the experts; tokens travel by all-to-all) against
   FSDP over both ranks (dp_shard=2: every rank gathers every expert's weights per layer), same
   weights and global batch. Per rank: parameter + optimizer bytes, tokens/s (both ranks), and
   for ep=2 the exposed all-to-all time (the sequential layer's blocking exchanges; MegaMoE's
   count exchange and the time its graphs waited) as a fraction of the MoE layer's time; ep=2 with
   MegaMoE as well (the cost model's wave count); the three are stepped in turn.
3. One MoE layer on two gloo ranks, forward and backward (fp32, --layer-* shape): the sequential
   expert-parallel layer against MegaMoE at each of --waves (and the cost model's choice): times,
   the exposed communication of each, and the simulator's prediction of each MegaMoE run from
   the task costs of the same graphs run without overlap (traced, alternated with the rest),
   beside the prediction of the cpu cost model. --trace-dir keeps the traces and draws the MegaMoE one.
4. The simulator's prediction for 8 and 64 H200-class GPUs at a DeepSeek-V4-like MoE shape:
   the sequential layer against MegaMoE (at its predicted best wave count), with the cost models.
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
from hyperparallel.moe import GroupedExperts, MegaMoE, MoEBlock, MoEShape, default_waves, plan_graphs
from hyperparallel.moe.dispatch import ExpertParallel
from hyperparallel.multicore import COST_MODELS, EXECUTORS, CostModel, costs_from_trace, simulate, timeline
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
    """Wall time inside blocking torch.distributed.all_to_all_single calls: all of it is exposed
    (and, while tracing, a slice on the comm track). Asynchronous calls (MegaMoE's) are not
    counted: what of them is exposed, its graphs' statistics say."""

    def __init__(self):
        self.seconds = 0.0
        self._original = dist.all_to_all_single

    def __enter__(self):
        def timed(*args, **kwargs):
            if kwargs.get("async_op"):
                return self._original(*args, **kwargs)
            t0 = time.perf_counter()
            with timeline.span("all_to_all_single", lane="comm"):
                out = self._original(*args, **kwargs)
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
    """The three layouts built side by side and stepped in turn, so that drift of the machine falls
    on each alike."""
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    runs = {}
    for label in ("dp_shard=2", "ep=2", "ep=2 MegaMoE"):
        model = build_model("qwen3_moe", config=model_config(args), seed=0)
        layout = expert_layout(2) if label != "dp_shard=2" else None
        if layout is not None:
            megamoe = label.endswith("MegaMoE")
            shape = MoEShape(tokens=args.rank_tokens, hidden=args.hidden, intermediate=args.intermediate // args.experts,
                             experts=args.experts, top_k=args.top_k)
            apply_expert_parallel(model, layout, implementation="megamoe" if megamoe else "sequential",
                                  waves=default_waves(shape, 2, COST_MODELS["cpu"]) if megamoe else 1)
        shard_model(model, experts=layout)
        block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        megamoe_layers = [m.dispatcher for m in model.modules() if isinstance(getattr(m, "dispatcher", None), MegaMoE)]
        runs[label] = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
                       "layer_time": LayerTimer(block), "megamoe": megamoe_layers, "steps": [], "a2a": 0.0,
                       "layer": 0.0}
    seq = args.seq
    rows = args.rank_tokens // seq
    for step in range(args.steps + 1):
        ids = torch.randint(0, 512, (rows * world, seq), generator=torch.Generator().manual_seed(step))
        ids = ids[rank * rows:(rank + 1) * rows]
        for run in runs.values():
            model, optimizer = run["model"], run["optimizer"]
            run["layer_time"].seconds = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            with AllToAllTimer() as timer:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            if step:  # the first is a warm-up
                run["steps"].append(time.perf_counter() - t0)
                run["a2a"] += timer.seconds + sum((d.last_stats["forward"].exposed_comm_ns +
                                                   d.last_stats["backward"].exposed_comm_ns) / 1e9 for d in run["megamoe"])
                run["layer"] += run["layer_time"].seconds
    results = {}
    for label, run in runs.items():
        optimizer = run["optimizer"]
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim())
        params = sum(p.numel() * p.element_size() for p in run["model"].parameters())
        results[label] = {"step_s": statistics.median(run["steps"]), "param_bytes": params, "optimizer_bytes": state,
                          "a2a_s": run["a2a"] / args.steps, "moe_layer_s": run["layer"] / args.steps}
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


def layer_inputs(args, rank: int) -> dict:
    """This rank's tokens, top-k routing over uniform random scores, routing weights and output gradient."""
    g = torch.Generator().manual_seed(1000 + rank)
    T, H, E = args.layer_tokens, args.layer_hidden, args.layer_experts
    return {"tokens": torch.randn(T, H, generator=g), "indices": torch.rand(T, E, generator=g).topk(args.top_k, -1)[1],
            "weights": torch.rand(T, args.top_k, generator=g), "grad": torch.randn(T, H, generator=g)}


def local_experts(args, offset: int, count: int) -> GroupedExperts:
    torch.manual_seed(0)
    full = GroupedExperts(args.layer_experts, args.layer_hidden, args.layer_intermediate, nn.SiLU())
    full.reset_parameters(0.02)
    local = GroupedExperts(count, args.layer_hidden, args.layer_intermediate, nn.SiLU())
    with torch.no_grad():
        local.gate_up_proj.copy_(full.gate_up_proj[offset:offset + count])
        local.down_proj.copy_(full.down_proj[offset:offset + count])
    return local


def layer_once(dispatcher, experts: GroupedExperts, inputs: dict) -> dict:
    """One forward and backward of the layer: wall times, and the exposed communication (blocking
    all-to-alls, plus the time MegaMoE's graphs waited on theirs)."""
    tokens = inputs["tokens"].clone().requires_grad_()
    weights = inputs["weights"].clone().requires_grad_()
    dist.barrier()
    with AllToAllTimer() as blocking:
        t0 = time.perf_counter()
        out = dispatcher(experts, tokens, inputs["indices"], weights)
        t1 = time.perf_counter()
        out.backward(inputs["grad"])
        t2 = time.perf_counter()
    experts.zero_grad(set_to_none=True)
    exposed, graphs = blocking.seconds, 0.0
    if isinstance(dispatcher, MegaMoE):
        stats = dispatcher.last_stats
        exposed += (stats["forward"].exposed_comm_ns + stats["backward"].exposed_comm_ns) / 1e9
        graphs = (stats["forward"].wall_ns + stats["backward"].wall_ns) / 1e9
    return {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "exposed_s": exposed, "graphs_s": graphs}


def layer_worker(rank: int, world: int, out_dir: str, args, waves: list[int]) -> None:
    """Sequential EP, MegaMoE at each wave count, and each MegaMoE run without overlap inside a
    trace (the per-task costs the simulator replays), all alternated so that drift of the machine
    falls on each alike; then one traced run with overlap for the picture."""
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    inputs = layer_inputs(args, rank)
    group, E = dist.group.WORLD, args.layer_experts
    contenders = {"sequential EP": ExpertParallel(group, E)} | {f"MegaMoE K={k}": MegaMoE(group, E, k) for k in waves}
    serial = {k: MegaMoE(group, E, k, overlap=False) for k in waves}
    experts = {label: local_experts(args, *d.local_range) for label, d in contenders.items()}
    times: dict[str, list[dict]] = {label: [] for label in contenders} | {k: [] for k in waves}
    for label, dispatcher in contenders.items():  # warm-up
        layer_once(dispatcher, experts[label], inputs)
    for rep in range(args.layer_repeat):
        for label, dispatcher in contenders.items():
            times[label].append(layer_once(dispatcher, experts[label], inputs))
        for k, dispatcher in serial.items():  # the same graphs, each exchange waited for at once
            with timeline.trace(Path(out_dir) / f"serial_{k}_{rep}.json"):
                times[k].append(layer_once(dispatcher, experts[f"MegaMoE K={k}"], inputs))
    with timeline.trace(Path(out_dir) / "overlapped.json"):
        layer_once(contenders[f"MegaMoE K={waves[-1]}"], experts[f"MegaMoE K={waves[-1]}"], inputs)
    with timeline.trace(Path(out_dir) / "sequential.json"):
        layer_once(contenders["sequential EP"], experts["sequential EP"], inputs)
    median = {label: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for label, runs in times.items()}
    torch.save({"median": {label: median[label] for label in contenders}, "serial": {k: median[k] for k in waves}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def layer_shape(args) -> MoEShape:
    return MoEShape(tokens=args.layer_tokens, hidden=args.layer_hidden, intermediate=args.layer_intermediate,
                    experts=args.layer_experts, top_k=args.top_k)


def megamoe_case(args) -> dict:
    """MegaMoE against sequential EP on 2 ranks, with the simulator's predictions beside."""
    shape = layer_shape(args)
    chosen = default_waves(shape, 2, COST_MODELS["cpu"])
    waves = sorted({int(k) for k in args.waves.split(",")} | {chosen})
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(layer_worker, args=(2, out_dir, args, waves), nprocs=2)
        per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(2)]
        traces = {name: timeline.load(Path(out_dir) / f"{name}.json") for name in ("overlapped", "sequential")}
        for k in waves:
            traces[f"serial_{k}"] = [e for rep in range(args.layer_repeat)
                                     for e in timeline.load(Path(out_dir) / f"serial_{k}_{rep}.json")]
        if args.trace_dir:
            target = Path(args.trace_dir)
            target.mkdir(parents=True, exist_ok=True)
            for name in ("overlapped", "sequential"):
                (target / f"megamoe_{name}.json").write_text((Path(out_dir) / f"{name}.json").read_text())
            timeline.plot(Path(out_dir) / "overlapped.json", target / "megamoe_trace.png",
                          title=f"MegaMoE K={waves[-1]}, forward and backward, 2 gloo ranks")
    rows = {}
    for label in per_rank[0]["median"]:
        m = [p["median"][label] for p in per_rank]
        rows[label] = {"fwd_ms": max(x["fwd_s"] for x in m) * 1e3, "bwd_ms": max(x["bwd_s"] for x in m) * 1e3,
                       "exposed_fraction": max(x["exposed_s"] / (x["fwd_s"] + x["bwd_s"]) for x in m)}
    for k in waves:
        forward, backward = plan_graphs(shape, 2, k)
        costs = costs_from_trace(traces[f"serial_{k}"])  # (each compute task on its slowest rank)
        # the layer's work outside its graphs (routing, the count exchange, the weighted sum), as run
        outside = max(p["serial"][k]["fwd_s"] + p["serial"][k]["bwd_s"] - p["serial"][k]["graphs_s"] for p in per_rank)
        predicted = outside + simulate(forward, costs).overlapped_s + simulate(backward, costs).overlapped_s
        modelled = outside + sum(simulate(g, COST_MODELS["cpu"]).overlapped_s for g in (forward, backward))
        rows[f"MegaMoE K={k}"] |= {"predicted_ms": predicted * 1e3, "cost_model_ms": modelled * 1e3}
    return {"rows": rows, "default_waves": chosen, "traces": {k: len(v) for k, v in traces.items()}}


def print_megamoe(args, result: dict) -> None:
    rows = result["rows"]
    base = rows["sequential EP"]
    base_total = base["fwd_ms"] + base["bwd_ms"]
    print(f"\nOne MoE layer on 2 gloo ranks (1 thread each), fp32: {args.layer_tokens} tokens per rank, hidden "
          f"{args.layer_hidden}, expert intermediate {args.layer_intermediate}, {args.layer_experts} experts top-"
          f"{args.top_k}; median of {args.layer_repeat}, alternated (default waves from the cpu cost model: "
          f"K={result['default_waves']})")
    print("| layer | fwd ms | bwd ms | total ms | vs sequential | exposed comm | simulated from trace | "
          "/ measured | cost model |")
    print("|-------|--------|--------|----------|---------------|--------------|----------------------|"
          "------------|------------|")
    for label, r in rows.items():
        total = r["fwd_ms"] + r["bwd_ms"]
        predicted = f"{r['predicted_ms']:.0f} ms" if "predicted_ms" in r else "-"
        ratio = f"{r['predicted_ms'] / total:.2f}" if "predicted_ms" in r else "-"
        model = f"{r['cost_model_ms']:.0f} ms" if "cost_model_ms" in r else "-"
        print(f"| {label} | {r['fwd_ms']:.0f} | {r['bwd_ms']:.0f} | {total:.0f} | {base_total / total:.2f}x | "
              f"{r['exposed_fraction'] * 100:.1f}% | {predicted} | {ratio} | {model} |")


CLUSTER_SHAPE = MoEShape(tokens=8192, hidden=4096, intermediate=2048, experts=256, top_k=6, shared_intermediate=2048,
                         element_bytes=2)


def cluster_models() -> dict[int, CostModel]:
    """H200-class GPUs (their matmul and vector kernels sharing the SMs: one compute lane): within
    a node NVLink (the cuda preset), across nodes one 400 Gb/s NIC per GPU.
    At 64 GPUs (8 nodes of 8) 56 of a rank's 63 peers are off its node, and the NIC (50 GB/s) bounds
    the exchange: 50 GB/s x 63/56 = 56.25 GB/s for a rank's bytes, after 30 µs."""
    nvlink = COST_MODELS["cuda"]
    return {8: nvlink, 64: CostModel(matmul_flops=nvlink.matmul_flops, memory_bytes_per_s=nvlink.memory_bytes_per_s,
                                     link_bytes_per_s=50e9 * 63 / 56, link_latency_s=30e-6,
                                     task_overhead_s=nvlink.task_overhead_s)}


def cluster_case() -> dict:
    """Predicted forward + backward time of one DeepSeek-V4-like MoE layer per rank at 8 and 64 GPUs."""
    rows = {}
    for gpus, cost in cluster_models().items():
        local = CLUSTER_SHAPE.experts // gpus
        forward, backward = plan_graphs(CLUSTER_SHAPE, gpus, 1)
        sequential = simulate(forward, cost, **EXECUTORS["cuda"]).sequential_s + \
            simulate(backward, cost, **EXECUTORS["cuda"]).sequential_s
        comm = sum(cost(t) for g in (forward, backward) for t in g.tasks if t.kind == "comm")
        k = default_waves(CLUSTER_SHAPE, gpus, cost, **EXECUTORS["cuda"])
        forward, backward = plan_graphs(CLUSTER_SHAPE, gpus, k)
        overlapped = sum(simulate(g, cost, **EXECUTORS["cuda"]).overlapped_s for g in (forward, backward))
        exposed = sum(simulate(g, cost, **EXECUTORS["cuda"]).exposed_comm_s for g in (forward, backward))
        rows[gpus] = {"local_experts": local, "sequential_ms": sequential * 1e3, "comm_ms": comm * 1e3, "waves": k,
                      "megamoe_ms": overlapped * 1e3, "exposed_ms": exposed * 1e3}
    return rows


def print_cluster(rows: dict) -> None:
    s = CLUSTER_SHAPE
    print(f"\nPredicted (simulator, cost model below): one MoE layer forward + backward per rank, {s.tokens} tokens per "
          f"rank, hidden {s.hidden}, expert intermediate {s.intermediate}, {s.experts} experts top-{s.top_k}, one "
          f"shared expert, bf16, ep = GPUs; matmul and vector work share the SMs (one compute lane), every stream in "
          f"issue order")
    print("| GPUs | experts per GPU | sequential EP ms | of it all-to-all ms | MegaMoE waves | MegaMoE ms | "
          "exposed comm ms | speedup |")
    print("|------|-----------------|------------------|---------------------|---------------|------------|"
          "-----------------|---------|")
    for gpus, r in rows.items():
        print(f"| {gpus} | {r['local_experts']} | {r['sequential_ms']:.2f} | {r['comm_ms']:.2f} | {r['waves']} | "
              f"{r['megamoe_ms']:.2f} | {r['exposed_ms']:.2f} | {r['sequential_ms'] / r['megamoe_ms']:.2f}x |")
    for gpus, cost in cluster_models().items():
        print(f"  {gpus} GPUs: {cost}")


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
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-parallel", action="store_true")
    parser.add_argument("--layer-tokens", type=int, default=2048, help="MegaMoE layer: tokens per rank")
    parser.add_argument("--layer-hidden", type=int, default=1024)
    parser.add_argument("--layer-intermediate", type=int, default=128, help="per expert")
    parser.add_argument("--layer-experts", type=int, default=8)
    parser.add_argument("--layer-repeat", type=int, default=15)
    parser.add_argument("--waves", default="1,2,4", help="MegaMoE wave counts (the cost model's choice is added)")
    parser.add_argument("--skip-megamoe", action="store_true")
    parser.add_argument("--trace-dir", default=None, help="keep the MegaMoE traces and their picture here")
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
        print("| layout       | params + AdamW MiB per rank | tokens/s | vs dp_shard=2 | exposed all-to-all / MoE layer |")
        print("|--------------|-----------------------------|----------|---------------|--------------------------------|")
        for label, r in parallel.items():
            frac = "-" if r["a2a_fraction_of_moe_layer"] is None else f"{r['a2a_fraction_of_moe_layer'] * 100:.1f}%"
            print(f"| {label:<12} | {r['param_optimizer_MiB']:>27.1f} | {r['tokens_per_s']:>8.0f} | "
                  f"{r['tokens_per_s'] / base['tokens_per_s']:>12.2f}x | {frac:>30} |")
    if not args.skip_megamoe:
        result["megamoe"] = megamoe_case(args)
        print_megamoe(args, result["megamoe"])
    result["cluster"] = cluster_case()
    print_cluster(result["cluster"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

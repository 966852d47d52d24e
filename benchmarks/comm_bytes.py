"""Bytes a training step sends, as the trainer's traffic counter counts them (hyperparallel.traffic),
for float32, bf16 mixed precision and MXFP8, at 2 and 4 gloo ranks, with the ratios the issue
asks for: FSDP's all-gather in bf16 and in MXFP8 against float32's, and the MoE's EP dispatch with
MXFP8 experts sent as MX data against bf16 rows.

    .venv/bin/python benchmarks/comm_bytes.py [--out FILE.json]

Each row is one short run of `hyperparallel train` (--nproc N, 1 step); the figures are the first
step's record in metrics.jsonl (the busiest rank's bytes). The model shapes are tiny but keep a
large model's proportions where it matters here: the products' weights are >90% of the elements
(the embedding and head, never MXFP8, are what is left).

A second table sets `hyperparallel plan`'s prediction of the same config (planned in this process
after each run) beside the counter's, by mesh dimension and kind of collective. FSDP's bytes are
the same on every rank; EP's depend on the routing, which the plan takes as uniform.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from hyperparallel.train.config import load_config
from hyperparallel.train.planning import plan

ROOT = Path(__file__).resolve().parent.parent
DENSE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": True}
MOE = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
       "num_experts_per_tok": 2, "tie_word_embeddings": False}
PRECISIONS = {"fp32": [], "bf16": ["training.mixed_precision=bf16"],
              "mxfp8": ["training.mixed_precision=bf16", "low_precision.enabled=true"]}


def run(base: str, shape: dict, ranks: int, sets: list[str], work: Path) -> tuple[dict, dict]:
    """(the counter's bytes, the plan's), by "dimension/kind", of one run of `base` with `sets`."""
    config = work / f"model_{len(list(work.iterdir()))}.yaml"
    config.write_text(yaml.safe_dump(shape))
    run_dir = work / f"run_{len(list(work.iterdir()))}"
    sets = [f"model.config={config}", "training.steps=1", "training.eval_every=0", "data.validation=0",
            "checkpoint.every=0", "training.micro_batch=4", f"logging.run_dir={run_dir}", *sets]
    args = [sys.executable, "-m", "hyperparallel", "train", str(ROOT / "configs" / base), "--nproc", str(ranks)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, check=True, cwd=ROOT, capture_output=True, text=True,
                   env={**os.environ, "HYPERPARALLEL_CACHE": os.environ.get("HYPERPARALLEL_CACHE", "/tmp/bench/cache")})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counted = next(r["comm_bytes"] for r in records if "comm_bytes" in r)["by_dimension_and_kind"]
    planned = plan(load_config(ROOT / "configs" / base, sets), ranks, runtime=0).comm_by_dimension_and_kind
    return counted, planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dispatch", default="moe.dispatch",
                        help="the moe: key that chooses how EP sends MXFP8 experts' rows")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for ranks in (2, 4):
            for name, precision in PRECISIONS.items():
                got, planned = run("qwen3.yaml", DENSE, ranks, [f"parallel.dp_shard={ranks}", *precision], work)
                rows.append({"model": "dense", "ranks": ranks, "precision": name, **got, "plan": planned})
            moe_layout = [f"parallel.dp_shard={ranks}", "parallel.ep=2"]
            for name, precision in PRECISIONS.items():
                got, planned = run("qwen3_moe.yaml", MOE, ranks, [*moe_layout, *precision], work)
                rows.append({"model": "moe", "ranks": ranks, "precision": name, **got, "plan": planned})
            got, planned = run("qwen3_moe.yaml", MOE, ranks, [*moe_layout, *PRECISIONS["mxfp8"],
                                                              f"{args.dispatch}=compute"], work)
            rows.append({"model": "moe", "ranks": ranks, "precision": "mxfp8, bf16 dispatch", **got, "plan": planned})
    print("| model | ranks | precision | FSDP all-gather MiB | x fp32 | reduce-scatter MiB | EP all-to-all MiB | x bf16 dispatch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        base = next(r for r in rows if r["model"] == row["model"] and r["ranks"] == row["ranks"] and r["precision"] == "fp32")
        bf16_dispatch = next((r for r in rows if r["model"] == row["model"] and r["ranks"] == row["ranks"]
                              and r["precision"] == "mxfp8, bf16 dispatch"), None)
        gather, reduce = row.get("dp_shard/all_gather", 0), row.get("dp_shard/reduce_scatter", 0)
        ep = row.get("ep/all_to_all", 0)
        ep_ratio = f"{ep / bf16_dispatch['ep/all_to_all']:.3f}" if bf16_dispatch and ep else ""
        print(f"| {row['model']} | {row['ranks']} | {row['precision']} | {gather / 2**20:.3f} | "
              f"{gather / base['dp_shard/all_gather']:.3f} | {reduce / 2**20:.3f} | {ep / 2**20:.3f} | {ep_ratio} |")
    print()
    print("| model | ranks | precision | collective | counted MiB | planned MiB | plan / counted - 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for key in sorted({k for k in row if "/" in k} | set(row["plan"])):
            counted, planned = row.get(key, 0), row["plan"].get(key, 0)
            difference = f"{planned / counted - 1:+.2%}" if counted else "not counted"
            print(f"| {row['model']} | {row['ranks']} | {row['precision']} | {key} | {counted / 2**20:.4f} | "
                  f"{planned / 2**20:.4f} | {difference} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""`hyperparallel plan` against real runs: predicted vs measured step time and peak memory per rank,
for several layouts on 2 and 4 gloo ranks of this machine.

    python benchmarks/plan.py                 # the table in docs/train.md, "Planning" (about 5 minutes)
    python benchmarks/plan.py --steps 6 --layouts tp2_dp2
    python benchmarks/plan.py --suite examples --steps 30   # the trainer's example configs, as they are

`--suite examples` runs the trainer's own tiny example configs (configs/qwen3.yaml,
configs/qwen3_moe.yaml: 2 layers of width 64, sequences of 128), where Python's time per operator
and per module, not the tensors, makes the step: the case the plan's CPU model is most wrong
about, and the held-out check of its Python and shared-core terms (docs/train.md, "Predicted
against measured").

Each layout runs `hyperparallel train --nproc N` on one model (a Qwen3-MoE of 16 experts, big
enough that its tensors and products, not Python, dominate a step) for --steps steps, logging every
step; measured are the median step time after the first two steps (`step_time_s`: the slowest
rank's) and the largest rank's peak resident memory (`peak_mem_bytes`). Its plan is made first, in a
fresh process, with `--device cpu` (this machine's device model, measured then). Ratios are
predicted / measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = {  # a Qwen3-MoE: 7.4M parameters, 4 layers of 16 experts top-4
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 16,
    "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.001,
}
# name -> (ranks, parallel settings)
LAYOUTS = {
    "dp_shard2": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2}),
    "dp_shard4": (4, {"dp_shard": 4}),
    "tp2_dp2": (4, {"tp": 2, "dp_shard": 2}),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
    "ep2_dp4": (4, {"dp_shard": 4, "ep": 2}),
    "cp2_dp2": (4, {"cp": 2, "dp_shard": 2}),
}


# the example configs: name -> (config, ranks, parallel settings, micro-batch). One rank of each and
# plain FSDP on 2 and 4 ranks first: the configurations the plan's CPU model may be compared with
# while it is made; the six after them are held out, checked only
EXAMPLES = {
    "qwen3_1": ("qwen3", 1, {}, 8),
    "qwen3_moe_1": ("qwen3_moe", 1, {}, 8),
    "dp_shard2": ("qwen3", 2, {"dp_shard": 2}, 8),
    "dp_shard4": ("qwen3", 4, {"dp_shard": 4}, 4),
    "tp2": ("qwen3", 2, {"tp": 2}, 8),
    "dp_shard2_ep2": ("qwen3_moe", 2, {"dp_shard": 2, "ep": 2}, 8),
    "cp2": ("qwen3", 2, {"cp": 2}, 8),
    "tp2_dp2": ("qwen3", 4, {"tp": 2, "dp_shard": 2}, 8),
    "dp_shard4_ep2": ("qwen3_moe", 4, {"dp_shard": 4, "ep": 2}, 4),
    "cp2_dp2": ("qwen3", 4, {"cp": 2, "dp_shard": 2}, 8),
}


def example_settings(parallel: dict, micro_batch: int, steps: int, run_dir: Path) -> list[str]:
    values = {
        "training.steps": steps, "training.micro_batch": micro_batch, "training.eval_every": 0,
        "checkpoint.every": 0, "logging.every": 1, "logging.run_dir": str(run_dir), "logging.progress": "false",
    } | {f"parallel.{key}": value for key, value in parallel.items()}
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def settings(parallel: dict, steps: int, run_dir: Path) -> list[str]:
    values = {
        "model.config": json.dumps(MODEL), "data.seq_len": 512, "data.max_corpus_bytes": 400_000,
        "training.steps": steps, "training.global_batch": 8, "training.micro_batch": 2,
        "training.compile": "none", "training.eval_every": 0, "checkpoint.every": 0,
        "logging.every": 1, "logging.run_dir": str(run_dir), "logging.progress": "false",
    } | {f"parallel.{key}": value for key, value in parallel.items()}
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def run(name: str, steps: int, work: Path, suite: str = "default") -> dict:
    if suite == "examples":
        family, ranks, parallel, micro = EXAMPLES[name]
        config = str(ROOT / "configs" / f"{family}.yaml")
        options = example_settings(parallel, micro, steps, work / name)
    else:
        ranks, parallel = LAYOUTS[name]
        config = str(ROOT / "configs" / "qwen3_moe.yaml")
        options = settings(parallel, steps, work / name)
    cmd = [sys.executable, "-m", "hyperparallel"]
    env = os.environ | {"HYPERPARALLEL_CACHE": str(work / "cache")}
    # the corpus tokenized ahead (`hyperparallel prepare`, as on a cluster): the run then only maps its shards
    subprocess.run([*cmd, "prepare", config, *options], check=True, capture_output=True, env=env)
    planned = json.loads(subprocess.run(
        [*cmd, "plan", config, "--nproc", str(ranks), "--device", "cpu", "--json", *options],
        check=True, capture_output=True, text=True, env=env).stdout)
    trained = subprocess.run([*cmd, "train", config, "--nproc", str(ranks), *options],
                             capture_output=True, text=True, env=env)
    if trained.returncode:
        raise SystemExit(f"{name}: hyperparallel train failed:\n{trained.stdout[-2000:]}\n{trained.stderr[-2000:]}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["step_time_s"] for r in records if "step_time_s" in r][2:]
    return {
        "layout": name, "ranks": ranks,
        "predicted_step_s": planned["time"]["predicted_step_s"], "measured_step_s": statistics.median(steps_s),
        "predicted_mem": planned["per_rank_bytes"]["total"],
        "measured_mem": max(r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r),
        "predicted_parts": {"compute_s": planned["time"]["compute_s"], "exposed": planned["time"]["exposed_comm_s"],
                            "optimizer_s": planned["time"]["optimizer_s"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--suite", choices=("default", "examples"), default="default")
    parser.add_argument("--layouts", default=None, help="comma-separated (default: every layout of the suite)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the first two are not counted)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = args.layouts.split(",") if args.layouts else list(EXAMPLES if args.suite == "examples" else LAYOUTS)
        for name in names:
            rows.append(run(name, args.steps, Path(tmp), args.suite))
            r = rows[-1]
            print(f"{name}: step {r['predicted_step_s']:.3f} s predicted / {r['measured_step_s']:.3f} s measured, "
                  f"memory {r['predicted_mem'] / 2**30:.3f} / {r['measured_mem'] / 2**30:.3f} GiB", file=sys.stderr)
    print("| layout | ranks | step predicted (s) | step measured (s) | ratio | peak predicted (GiB) "
          "| peak measured (GiB) | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layout']} | {r['ranks']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} "
              f"| {r['predicted_step_s'] / r['measured_step_s']:.2f} | {r['predicted_mem'] / 2**30:.3f} "
              f"| {r['measured_mem'] / 2**30:.3f} | {r['predicted_mem'] / r['measured_mem']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

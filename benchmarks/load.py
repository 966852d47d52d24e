"""Loading a Hugging Face directory into a sharded run, and exporting it again: time and peak
memory per rank, side by side with what a user would otherwise do.

    python benchmarks/load.py                   # a ~0.46 GB Qwen3-MoE in 5 files, W = 1, 2, 4
    python benchmarks/load.py --json load.json

The model (Qwen3-MoE, fp32: 8 layers of 32 experts, hidden 512; --layers / --experts to change
it) is saved once with save_pretrained in files of at most 100 MB. Then, each case in fresh
processes (gloo ranks on this machine, one thread each):
- hyperparallel: `build_trained_model` with `model.path` (the trainer's build: the meta device,
  the plans, FSDP shards given memory, each rank reading only its blocks of the files), at
  W=1, dp_shard=2, dp_shard=2 x ep=2, dp_shard=4, tp=2 x dp_shard=2 and dp_shard=4 x ep=2;
- from_pretrained in every rank: transformers' `AutoModelForCausalLM.from_pretrained` of the
  directory in each of W processes (what a rank holds before any sharding could begin).
Peak memory is the rise of each process's peak resident set (VmHWM) during the load, the
largest over the ranks; a tiny model's (configs/models/qwen3_moe_tiny.yaml) rise is measured
the same way and shown, since the figures that matter are those above it. Then the dp_shard=4
run's checkpoint is exported: `hyperparallel export` (streaming, one tensor at a time) against
loading the checkpoint whole and calling save_pretrained, each in a fresh process. The ratios
are hyperparallel's time and memory over the other's (below 1: less).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name -> (world, parallel section)
    "one process": (1, {}),
    "dp_shard=2": (2, {"dp_shard": 2}),
    "dp_shard=2, ep=2": (2, {"dp_shard": 2, "ep": 2}),
    "dp_shard=4": (4, {"dp_shard": 4}),
    "tp=2 x dp_shard=2": (4, {"tp": 2, "dp_shard": 2}),
    "dp_shard=4, ep=2": (4, {"dp_shard": 4, "ep": 2}),
}


def model_config(args) -> dict:
    return {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 256,
            "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
            "num_experts": args.experts, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def peak_rss() -> int:
    from hyperparallel.train.metrics import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu"))


def train_config(path: str, parallel: dict):
    from hyperparallel.train.config import TrainConfig

    return TrainConfig.model_validate({
        "model": {"family": "qwen3_moe", "path": path},
        "data": {"seq_len": 32}, "training": {"global_batch": 4, "micro_batch": 1, "steps": 1, "compile": "none"},
        "parallel": parallel})


def rank_main(rank: int, world: int, port: int, how: str, directory: str, parallel: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from hyperparallel.train.distributed import init_distributed

    rt = init_distributed(timeout_s=600, device=torch.device("cpu"))  # (one rank: a process group of its own)
    import transformers  # (imported before the baseline: both contenders use it)

    transformers.utils.logging.disable_progress_bar()

    from hyperparallel.train.build import build_trained_model

    before = peak_rss()
    start = time.perf_counter()
    if how == "hyperparallel":
        built = build_trained_model(train_config(directory, parallel), rt, 512)
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    seconds = time.perf_counter() - start
    grown = peak_rss() - before
    if how == "hyperparallel" and parallel == {"dp_shard": 4}:
        from hyperparallel import checkpoint
        from hyperparallel.checkpoint.model_card import KEY

        checkpoint.save(Path(out) / "checkpoint", built.model, extra={"step": 1, KEY: built.card.to_json()})
    torch.save({"seconds": seconds, "grown": grown}, Path(out) / f"rank{rank}.pt")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()  # (one rank too: init_distributed gave it a group of its own)


def measure(how: str, directory: Path, world: int, parallel: dict, out: Path) -> dict:
    from tests.dist.spawn import free_port

    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(rank_main, args=(world, free_port(), how, str(directory), parallel, str(out)), nprocs=world)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return {"seconds": max(r["seconds"] for r in ranks), "grown": max(r["grown"] for r in ranks)}


def export_main(how: str, checkpoint_dir: str, out: str, result: str) -> None:
    torch.set_num_threads(1)
    import transformers  # noqa: F401

    from hyperparallel.checkpoint.export import export_hf, model_from_checkpoint

    before = peak_rss()
    start = time.perf_counter()
    if how == "hyperparallel export":
        export_hf(checkpoint_dir, out)
    else:
        model, _ = model_from_checkpoint(checkpoint_dir)
        model.save_pretrained(out)
    torch.save({"seconds": time.perf_counter() - start, "grown": peak_rss() - before}, result)


def measure_export(how: str, checkpoint_dir: Path, out: Path) -> dict:
    result = out.with_suffix(".pt")
    process = mp.get_context("spawn").Process(target=export_main, args=(how, str(checkpoint_dir), str(out), str(result)))
    process.start()
    process.join()
    if process.exitcode:
        raise SystemExit(f"the export ({how}) failed with exit code {process.exitcode}")
    return torch.load(result)


def save_model(config: dict, directory: Path) -> int:
    import transformers

    from hyperparallel.models import build_model

    transformers.utils.logging.disable_progress_bar()

    model = build_model("qwen3_moe", config=config, seed=0)
    model.save_pretrained(directory, max_shard_size="100MB")
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import yaml

    work = Path(tempfile.mkdtemp(prefix="hp-load-"))
    model_bytes = save_model(model_config(args), work / "model")
    save_model(yaml.safe_load((ROOT / "configs/models/qwen3_moe_tiny.yaml").read_text()), work / "tiny")
    files = len(list((work / "model").glob("*.safetensors")))
    print(f"Loading qwen3_moe ({model_bytes / 2**30:.2f} GiB in fp32, {files} safetensors files) on gloo ranks of "
          f"this machine, torch {torch.__version__}; memory: the largest rank's rise of its peak resident set")
    rows = []
    for name, (world, parallel) in LAYOUTS.items():
        tiny = measure("hyperparallel", work / "tiny", world, parallel, work / "runs" / f"tiny-{name}")
        ours = measure("hyperparallel", work / "model", world, parallel, work / "runs" / name)
        theirs = measure("from_pretrained", work / "model", world, {}, work / "runs" / f"hf-{world}")
        rows.append({"layout": name, "world": world, "ours": ours, "tiny": tiny, "from_pretrained": theirs})
    GiB = 2**30
    print("| layout            | W | hyperparallel s | peak rise GiB | above tiny / model | from_pretrained s | "
          "peak rise GiB | / model | hyperparallel's time, memory |")
    print("|" + "|".join("-" * w for w in (19, 3, 17, 15, 20, 19, 15, 9, 31)) + "|")
    for r in rows:
        ours, tiny, theirs = r["ours"], r["tiny"], r["from_pretrained"]
        above = (ours["grown"] - tiny["grown"]) / model_bytes
        print(f"| {r['layout']:<17} | {r['world']} | {ours['seconds']:>15.2f} | {ours['grown'] / GiB:>13.3f} | "
              f"{above:>18.2f} | {theirs['seconds']:>17.2f} | {theirs['grown'] / GiB:>13.3f} | "
              f"{theirs['grown'] / model_bytes:>7.2f} | {ours['seconds'] / theirs['seconds']:>11.2f}x, "
              f"{ours['grown'] / max(theirs['grown'], 1):>14.2f}x |")
    checkpoint_dir = work / "runs" / "dp_shard=4" / "checkpoint"
    tiny_checkpoint = work / "runs" / "tiny-dp_shard=4" / "checkpoint"
    exports = []
    for how in ("hyperparallel export", "load whole + save_pretrained"):
        tiny = measure_export(how, tiny_checkpoint, work / "exports" / f"tiny-{how.split()[0]}")
        full = measure_export(how, checkpoint_dir, work / "exports" / how.split()[0])
        exports.append({"how": how, "tiny": tiny, "model": full})
    print("\nExport of the dp_shard=4 checkpoint to a Hugging Face directory (one process):")
    print("| how                           | seconds | peak rise GiB | above tiny / model | time, memory ratio |")
    print("|-------------------------------|---------|---------------|--------------------|--------------------|")
    ours = exports[0]["model"]
    for e in exports:
        above = (e["model"]["grown"] - e["tiny"]["grown"]) / model_bytes
        ratio = f"{ours['seconds'] / e['model']['seconds']:.2f}x, {ours['grown'] / e['model']['grown']:.2f}x"
        print(f"| {e['how']:<29} | {e['model']['seconds']:>7.2f} | {e['model']['grown'] / GiB:>13.3f} | {above:>18.2f} | "
              f"{ratio:>18} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "loads": rows, "exports": exports}, indent=2))


if __name__ == "__main__":
    main()

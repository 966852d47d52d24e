"""Data at scale, side by side in one run: tokenizing throughput, and a rank's memory against the
corpus's size.

    python benchmarks/data.py                       # both parts (about 6 min on 2 cores)
    python benchmarks/data.py --part throughput --mb 32 --json data.json

throughput: one jsonl corpus (--mb MB of this Python's standard library sources, records of
about 4 KB) tokenized with one tokenizer (the builtin BPE, trained once beforehand and left out
of every timing) into what training reads, by
- hyperparallel's streaming pass (`hyperparallel prepare`'s: token shards), 1 and --workers
  processes;
- Hugging Face `datasets`: `load_dataset("json")` then `.map(batched=True)` with the same
  tokenizer as a `PreTrainedTokenizerFast` (what a user would otherwise write), num_proc 1 and
  --workers; its Arrow cache on the same disk.
Each contender starts cold (its own cache directory); tokens/s counts the same tokens (EOS
included) for all.

memory: `hyperparallel train` on 2 ranks (a tiny Qwen3, 3 steps, seq 256) over an 8 MB and an
80 MB jsonl corpus, each twice: cold (rank 0 tokenizes while rank 1 waits) and warm (the shards
found). Each rank's peak resident memory (VmHWM) after the run, and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORD_CHARS = 4096


def write_corpus(path: Path, megabytes: float) -> int:
    """A jsonl corpus of `megabytes` of standard-library source, in records of ~4 KB (the
    library repeated, each pass marked, until it is that large); its record count."""
    from hyperparallel.train.data.sources import stdlib_files

    target, written, count, copy = int(megabytes * 1e6), 0, 0, 0
    files = stdlib_files()
    with open(path, "w") as out:
        while written < target:
            for f in files:
                text = f.read_text(encoding="utf-8", errors="replace")
                for at in range(0, len(text), RECORD_CHARS):
                    line = json.dumps({"text": f"# pass {copy}\n" + text[at: at + RECORD_CHARS]}) + "\n"
                    out.write(line)
                    written += len(line)
                    count += 1
                    if written >= target:
                        return count
            copy += 1
    return count


def _cfg(corpus: Path, cache: Path, workers: int):
    from hyperparallel.train.config import DataSection

    return DataSection(source="files", files=[str(corpus)], cache_dir=str(cache), workers=workers, validation=None)


# ----------------------------------------------------------------------------- throughput


def ours(corpus: Path, tokenizer, workdir: Path, workers: int) -> tuple[float, int]:
    from hyperparallel.train.data import shards, sources

    found = sources.corpus_sources([str(corpus)], "files", "data.files", "train")
    settings = shards.EncodeSettings("text", "text", True, True, None)
    start = time.perf_counter()
    meta = shards.write_shards(workdir / "shards", shards.capped_records(found, settings, "data.files"), tokenizer,
                               settings, workers=workers, description={}, progress=False)
    return time.perf_counter() - start, meta["tokens"]


def hf_datasets(corpus: Path, tokenizer, workdir: Path, workers: int) -> tuple[float, int]:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    eos = tokenizer.eos_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in fast(batch["text"])["input_ids"]]}

    start = time.perf_counter()
    table = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(workdir / "hf"))
    tokenized = table.map(tokenize, batched=True, remove_columns=["text"], num_proc=workers if workers > 1 else None)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for batch in tokenized.iter(batch_size=4096) for ids in batch["input_ids"])
    return seconds, tokens


def throughput(args, workdir: Path) -> list[dict]:
    from hyperparallel.train import data

    corpus = workdir / "corpus.jsonl"
    records = write_corpus(corpus, args.mb)
    def sample():  # (what the trainer trains the builtin tokenizer on: the corpus's first 8 MB)
        with open(corpus) as f:
            size = 0
            for line in f:
                yield json.loads(line)["text"]
                size += len(line)
                if size > 8_000_000:
                    return

    # the tokenizer, trained once before any timing
    tokenizer = data.load_tokenizer(_cfg(corpus, workdir / "tok", 1), None, sample, "bench", cache_dir=workdir / "tok")
    rows = []
    for name, run, workers in (("hyperparallel prepare", ours, 1), ("hyperparallel prepare", ours, args.workers),
                               ("datasets .map", hf_datasets, 1), ("datasets .map", hf_datasets, args.workers)):
        rates = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(dir=workdir) as scratch:
                seconds, tokens = run(corpus, tokenizer, Path(scratch), workers)
            rates.append(tokens / seconds)
        rows.append({"contender": name, "processes": workers, "tokens": tokens, "records": records,
                     "tokens_per_s": max(rates), "tokens_per_s_min": min(rates)})
    return rows


def print_throughput(rows: list[dict], mb: float) -> None:
    base = {r["processes"]: r["tokens_per_s"] for r in rows if r["contender"] == "datasets .map"}
    print(f"\ntokenizing a {mb:g} MB jsonl corpus ({rows[0]['records']:,} records, {rows[0]['tokens']:,} tokens), "
          f"{os.cpu_count()} cores: best (worst) of the repeats")
    print(f"| {'contender':<22} | processes | tokens/s (best)  | worst            | vs datasets .map, same processes |")
    print(f"| {'-' * 22} | --------- | ---------------- | ---------------- | -------------------------------- |")
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["processes"]]
        print(f"| {r['contender']:<22} | {r['processes']:>9} | {r['tokens_per_s']:>16,.0f} | "
              f"{r['tokens_per_s_min']:>16,.0f} | {ratio:>31.2f}x |")


# --------------------------------------------------------------------------------- memory

RANK_SCRIPT = """
import json, os, sys
from hyperparallel.train.config import from_mapping
from hyperparallel.train.loop import train
from hyperparallel.train.metrics import peak_memory_bytes
import torch
raw = json.loads(sys.argv[1])
summary = train(from_mapping(raw))
with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"peak": peak_memory_bytes(torch.device("cpu")), "data": summary["data"]}, f)
"""


def one_run(corpus: Path, cache: Path, run_dir: Path, out: Path) -> dict:
    raw = {"model": {"family": "qwen3", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}},
           "data": {"source": "files", "files": [str(corpus)], "cache_dir": str(cache), "seq_len": 256,
                    "validation": None, "vocab_size": 4096},
           "training": {"steps": 3, "global_batch": 4, "micro_batch": 2, "eval_batches": 1},
           "logging": {"run_dir": str(run_dir), "progress": False}, "checkpoint": {"every": 0}}
    out.mkdir(parents=True)
    script = out / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(29500 + os.getpid() % 1000), str(script), json.dumps(raw), str(out)],
                          capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the 2-rank run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"seconds": seconds, "peaks": [r["peak"] for r in ranks], "data": ranks[0]["data"]}


def memory(args, workdir: Path) -> list[dict]:
    rows = []
    for mb in args.memory_mb:
        corpus = workdir / f"corpus-{mb:g}mb.jsonl"
        write_corpus(corpus, mb)
        cache = workdir / f"cache-{mb:g}"
        for run in ("cold", "warm"):
            result = one_run(corpus, cache, workdir / f"run-{mb:g}-{run}", workdir / f"out-{mb:g}-{run}")
            rows.append({"corpus_mb": mb, "run": run, **result})
    return rows


def print_memory(rows: list[dict]) -> None:
    mib = 1 << 20
    first = {r["run"]: r for r in rows if r["corpus_mb"] == rows[0]["corpus_mb"]}
    print("\n2 ranks, `hyperparallel train` (tiny Qwen3, 3 steps): each rank's peak resident memory")
    print("| corpus | run  | rank 0 peak | rank 1 peak | grown vs the smallest corpus (rank 0, rank 1) | wall   | "
          "shards                         |")
    print("| ------ | ---- | ----------- | ----------- | --------------------------------------------- | ------ | "
          "------------------------------ |")
    for r in rows:
        base = first[r["run"]]["peaks"]
        grown = ", ".join(f"{(p - b) / mib:+.1f} MiB" for p, b in zip(r["peaks"], base, strict=True))
        d = r["data"]
        shards = "found" if d["reused"] else f"made, {d['tokens_per_s']:,} tokens/s"
        print(f"| {r['corpus_mb']:>3g} MB | {r['run']} | {r['peaks'][0] / mib:>7.1f} MiB | {r['peaks'][1] / mib:>7.1f} MiB "
              f"| {grown:<45} | {r['seconds']:>5.1f}s | {shards:<30} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["throughput", "memory", "both"], default="both")
    parser.add_argument("--mb", type=float, default=32, help="the throughput corpus's size")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="processes of the parallel contenders")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-mb", type=float, nargs="+", default=[8, 80], help="the memory part's corpora")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="hp-data-bench-") as tmp:
        workdir = Path(tmp)
        if args.part in ("throughput", "both"):
            results["throughput"] = throughput(args, workdir)
            print_throughput(results["throughput"], args.mb)
        if args.part in ("memory", "both"):
            results["memory"] = memory(args, workdir)
            print_memory(results["memory"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()

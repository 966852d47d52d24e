"""Every text decoder-only causal-LM type of transformers through the trainer at a tiny size, and
the table of what runs: `python scripts/model_coverage.py [TYPE ...] [--write]`.

Per type (hyperparallel/train/coverage.py): one process (the reference, MXFP8, export then
`from_pretrained`), then two gloo ranks in each layout that applies (FSDP dp_shard=2, EP ep=2,
TP tp=2, CP cp=2), each against the reference's losses. The one-process cells run here; the
two-rank ones in spawned ranks, a chunk of types per spawn, so that a type that hangs a
collective costs only its own cells (the spawn is ended after `--timeout` seconds and the sweep
goes on with the next type). Results go to a JSON-lines file as they come (`--results`; a rerun
skips the types already there unless `--again`); `--write` renders docs/models.md from them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hyperparallel.train import coverage  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _append(path: Path, model_type: str, cells: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"model_type": model_type, "cells": cells}) + "\n")


def rank_worker(rank: int, world: int, port: int, jobs: list[tuple[str, list[str]]], root: str, results: str,
                progress: str) -> None:
    """One rank of a spawn: each job's one-process cells (world 1) or two-rank layouts (world 2)."""
    from hyperparallel.train.distributed import init_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), HYPERPARALLEL_CACHE=str(Path(root) / "cache"))
    torch.set_num_threads(1)
    if world > 1:
        init_distributed(timeout_s=120, device=torch.device("cpu"))
    for model_type, layouts in jobs:
        if rank == 0:
            Path(progress).write_text(model_type)
        if world == 1:
            cells = coverage.reference(model_type, Path(root) / model_type)
        else:
            cells = coverage.on_ranks(model_type, Path(root) / model_type, layouts)
            try:  # both ranks still here: a rank that died makes the cells' collective errors its own
                torch.distributed.barrier()
            except Exception:  # noqa: BLE001
                os._exit(1)  # (the driver retries the rest of the chunk and fails this type)
        if rank == 0:
            _append(Path(results), model_type, cells)


def run_spawned(world: int, jobs: list[tuple[str, list[str]]], root: Path, results: Path, timeout: float,
                wanted: str) -> list[tuple[str, list[str]]]:
    """Run the jobs in one spawn of `world` ranks; the jobs it did not finish (the first of them
    hung or crashed the spawn), judged by cell `wanted` (or each job's layouts) in the results."""
    progress = root / "progress.txt"
    progress.unlink(missing_ok=True)
    for model_type, layouts in jobs:  # (what an earlier, ended try of these cells left)
        for cell in layouts if world > 1 else ("one", "one_no_aux", "mxfp8", "export"):
            shutil.rmtree(root / model_type / cell, ignore_errors=True)
    context = mp.start_processes(rank_worker, args=(world, free_port(), jobs, str(root), str(results), str(progress)),
                                 nprocs=world, join=False, start_method="spawn")
    started, current = time.monotonic(), None
    while True:
        try:
            if context.join(timeout=5):
                break
        except Exception:  # noqa: BLE001 (a rank that died: the rest of the chunk is retried)
            break
        now = progress.read_text() if progress.is_file() else None
        if now != current:
            started, current = time.monotonic(), now
        if time.monotonic() - started > timeout:
            break
    for process in context.processes:
        if process.is_alive():
            process.kill()
    have = coverage.load_cells(results)
    return [(t, layouts) for t, layouts in jobs
            if not all(cell in have.get(t, {}) for cell in (layouts if world > 1 else [wanted]))]


def run_all(world: int, jobs: list[tuple[str, list[str]]], args) -> None:
    """Every job, a chunk per spawn; a job that did not finish gets a failed cell and the rest go on."""
    while jobs:
        chunk, jobs = jobs[:args.chunk], jobs[args.chunk:]
        print(f"{world} rank(s): {', '.join(t for t, _ in chunk)}", flush=True)
        unfinished = run_spawned(world, chunk, args.work, args.results, args.timeout, "train")
        if unfinished:
            (hung, layouts), rest = unfinished[0], unfinished[1:]
            done = coverage.load_cells(args.results).get(hung, {})
            reason = f"did not finish within {args.timeout:.0f} s, or ended its process"
            _append(args.results, hung, {cell: coverage.Cell(failed=reason).to_json()
                                         for cell in (layouts if world > 1 else ["train", "mxfp8", "export"])
                                         if cell not in done})
            jobs = rest + jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every text decoder-only type)")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "models.jsonl")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hyperparallel-coverage"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one type's two-rank cells may take")
    parser.add_argument("--chunk", type=int, default=12, help="types per spawn")
    parser.add_argument("--again", action="store_true", help="run types the results file already has")
    parser.add_argument("--write", action="store_true", help="render docs/models.md from the results")
    args = parser.parse_args()

    from hyperparallel.models.catalog import text_decoder_types

    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HYPERPARALLEL_CACHE", str(args.work / "cache"))
    torch.set_num_threads(1)
    types = args.types or text_decoder_types()
    if args.again:
        kept = [line for line in (args.results.read_text().splitlines() if args.results.is_file() else [])
                if json.loads(line)["model_type"] not in types]
        partial = args.results.with_name(args.results.name + ".tmp")
        partial.write_text("".join(f"{line}\n" for line in kept))
        partial.replace(args.results)  # (the earlier results stay whole if this is interrupted)
    have = coverage.load_cells(args.results)
    run_all(1, [(t, []) for t in types if "train" not in have.get(t, {})], args)
    have = coverage.load_cells(args.results)
    jobs = []
    for model_type in types:
        if not have.get(model_type, {}).get("train", {}).get("losses"):
            continue
        wanted = [layout for layout, why in coverage.applicable(model_type).items()
                  if why is None and layout not in have[model_type]]
        if wanted:
            jobs.append((model_type, wanted))
    run_all(2, jobs, args)
    if args.write:
        (ROOT / "docs" / "models.md").write_text(coverage.render(coverage.load_cells(args.results)))


if __name__ == "__main__":
    main()

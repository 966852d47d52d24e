"""`hyperparallel train` and `hyperparallel plot` from the command line, one rank and two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent


def tiny_raw(run_dir, family="qwen3", **training) -> dict:
    return {
        "model": {"family": family, "config": yaml.safe_load((ROOT / f"configs/models/{family}_tiny.yaml").read_text())},
        "data": {"max_corpus_bytes": 60_000, "vocab_size": 512, "seq_len": 32},
        "training": {"steps": 4, "global_batch": 4, "micro_batch": 2, "compile": "none", "eval_batches": 1, **training},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"warmup_steps": 0},
        "logging": {"run_dir": str(run_dir), "every": 1},
    }


def tiny_config(tmp_path, run_dir, family="qwen3", **training) -> Path:
    raw = tiny_raw(run_dir, family, **training)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(*args, tmp_path):
    env = dict(os.environ, HYPERPARALLEL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hyperparallel", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]  # (the training records, not the validation ones)


def test_train_runs_a_config_with_overrides_then_plot_redraws(tmp_path):
    result = run("train", str(tiny_config(tmp_path, tmp_path / "run")), "--set", "training.steps=3", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "done: 3 steps" in result.stdout and len(losses(tmp_path / "run")) == 3
    (tmp_path / "run" / "loss.png").unlink()
    result = run("plot", str(tmp_path / "run"), tmp_path=tmp_path)
    assert result.returncode == 0 and (tmp_path / "run" / "loss.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["train", "missing.yaml"], "error: config file missing.yaml does not exist"),
    (["train", "--set", "training.stepz=3"], r"error: training.stepz: unknown key; did you mean training.steps\?"),
    (["train", "--set", "optimizer.lr=fast"], "error: .*optimizer.lr: .*got 'fast'"),
    (["train", "--set", "training.global_batch=7"], r"error: training.global_batch \(7\) must be a multiple"),
    (["train", "--set", "model.config=null", "--set", "model.path=nowhere"], "error: .*nowhere"),
    (["plot", "nowhere"], "error: nowhere holds no metrics.jsonl"),
    (["train", "--set", "parallel.dp_shard=2"], r"error: parallel.dp_shard = 2 .* this run has 1; .*--nproc 2"),
    # found inside the ranks: one line for the run, not one per rank
    (["train", "--set", "parallel.dp_shard=3", "--nproc", "2", "--max-restarts", "3"],
     r"error: parallel.dp_shard = 3 .* this run has 2"),  # and no restart meets it again
    (["train", "--nproc", "0"], r"error: --nproc must be at least 1, got 0"),
])
def test_user_errors_print_one_line_and_exit_2(tmp_path, args, message):
    result = run(*args, tmp_path=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "runs").exists()


def test_two_ranks_replicate_and_match_one_rank(tmp_path):
    one = run("train", str(tiny_config(tmp_path, tmp_path / "one")), tmp_path=tmp_path)
    assert one.returncode == 0, one.stderr
    two = run("train", str(tiny_config(tmp_path, tmp_path / "two")), "--nproc", "2", tmp_path=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    # 2 ranks x 1 micro-batch vs 1 rank x 2 accumulated: the same sequences, the same mean gradient
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)


def imbalance(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["moe_imbalance"] for r in records if "loss" in r]


def test_two_sharded_ranks_match_one_rank(tmp_path):
    """parallel.dp_shard: 2 with expert parallelism (ep: 2, each rank holds 8 of the 16 experts),
    an MoE model with its auxiliary loss, Muon, uneven shards (balanced, align 32), decoder layers
    compiled (dvm: FSDP's hooks stay outside the graphs), then resumed."""
    options = ["--set", "optimizer.name=muon", "--set", "training.steps=4", "--set", "checkpoint.every=2"]
    config = tiny_config(tmp_path, tmp_path / "one", family="qwen3_moe")
    one = run("train", str(config), *options, tmp_path=tmp_path)
    assert one.returncode == 0, one.stderr
    sharding = ["--set", "parallel.dp_shard=2", "--set", "parallel.shard_geometry=balanced", "--set", "parallel.align=32",
                "--set", "training.compile=dvm", "--set", "parallel.ep=2"]
    config = tiny_config(tmp_path, tmp_path / "two", family="qwen3_moe")
    # (evaluating after every step, under FSDP, changes nothing of the training)
    two = run("train", str(config), *options, *sharding, "--set", "training.eval_every=1", "--nproc", "2",
              tmp_path=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 rank(s) sharded (balanced, align 32), experts split over 2 ranks (ep)" in two.stdout
    assert two.stdout.count("  validation loss ") == 4
    # the expert loads, summed over the ranks, are one rank's: the same routing
    assert imbalance(tmp_path / "two") == pytest.approx(imbalance(tmp_path / "one"), rel=1e-6)
    # the ranks average their gradients in another order than one process accumulates them, and
    # Muon's bf16 Newton-Schulz turns that last bit into ~1e-4 of the loss within 4 steps
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
    # resume: as if the job had died after step 2, from the sharded checkpoint it left there
    import shutil

    run_dir = tmp_path / "two"
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    full = losses(run_dir)
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in (run_dir / "metrics.jsonl").read_text()
                                                   .splitlines() if json.loads(line)["step"] <= 2))
    resumed = run("train", str(config), *options, *sharding, "--set", "checkpoint.resume=latest", "--nproc", "2",
                  tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert losses(run_dir) == full  # exactly: the same ranks, shards and order of every sum


def megamoe_trainer_runs(rank: int, out_dir: str) -> dict:
    """On a rank of the shared 2-rank spawn (tests/conftest.py's `ep_spawn_2`, whose process group
    the trainer joins): the trainer for 20 steps with the sequential EP layer, then with MegaMoE
    in 2 waves and logging.trace; dp_shard 2, ep 2, fp32, the aux loss on."""
    import os

    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.loop import train

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      HYPERPARALLEL_CACHE=os.path.join(out_dir, "cache"))
    runs = {}
    for implementation in ("sequential", "megamoe"):
        run_dir = Path(out_dir) / implementation
        raw = tiny_raw(run_dir, family="qwen3_moe", steps=20, eval_every=0)  # (no file: both ranks build it)
        raw["parallel"] = {"dp_shard": 2, "ep": 2}
        raw["logging"].update(progress=False)
        if implementation == "megamoe":
            raw["moe"] = {"implementation": "megamoe", "waves": 2}
            raw["logging"].update(trace=True, trace_steps=2)
        train(from_mapping(raw))
        runs[implementation] = str(run_dir)
    for kernels in (True, False):  # tests/train/test_deepseek_v4.py: DeepSeek-V4 with and without its kernels
        run_dir = Path(out_dir) / f"deepseek_v4_kernels_{'on' if kernels else 'off'}"
        raw = tiny_raw(run_dir, family="deepseek_v4", steps=20, eval_every=0)
        raw.update(parallel={"dp_shard": 2, "ep": 2}, moe={"implementation": "megamoe", "waves": 2},
                   kernels={"mega_gate": kernels, "mega_mhc": kernels}, optimizer={"lr": 3e-3, "eps": 1e-5})
        raw["logging"].update(progress=False)
        train(from_mapping(raw))
        runs[run_dir.name] = str(run_dir)
    return runs


def test_megamoe_trains_as_the_sequential_layer_and_traces_its_graphs(ep_spawn_2):
    """moe.implementation: megamoe in 2 waves against the sequential EP layer in the trainer for 20
    steps: the same loss curve; logging.trace writes a timeline of two steps with MegaMoE's tasks
    on every rank's lanes. (Run by the ranks of the shared spawn: two launches fewer.)"""
    from hyperparallel.multicore import timeline

    runs = ep_spawn_2[0]["trainer"]
    want = losses(Path(runs["sequential"]))
    assert len(want) == 20
    # measured: 7.8e-8 relative at most (each expert's products see the same rows; a token's four
    # results are summed in another order)
    assert losses(Path(runs["megamoe"])) == pytest.approx(want, rel=1e-6)
    events = timeline.load(Path(runs["megamoe"]) / "trace.json")
    assert {e["pid"] for e in events} == {0, 1}
    steps = sorted({e["name"] for e in events if e["lane"] == "step"})
    assert steps == ["step 2", "step 3"]  # the first step warms up
    names = {e["name"] for e in events if e["pid"] == 1}
    assert {"dispatch 0", "combine 1", "experts 1", "dgrad 0", "wgrad 1", "dispatch grad 1"} <= names
    assert {e["lane"] for e in events} == {"step", "compute", "comm"}


def test_the_validation_loss_is_the_same_on_one_rank_and_two_sharded_ranks(tmp_path):
    """lr 0: both layouts evaluate the same (initial) weights on the same held-out sequences."""
    options = ["--set", "optimizer.lr=0", "--set", "training.steps=2", "--set", "training.eval_batches=2"]
    one = run("train", str(tiny_config(tmp_path, tmp_path / "one", family="qwen3_moe")), *options, tmp_path=tmp_path)
    assert one.returncode == 0, one.stderr
    two = run("train", str(tiny_config(tmp_path, tmp_path / "two", family="qwen3_moe")), *options, "--set",
              "parallel.dp_shard=2", "--nproc", "2", tmp_path=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]

    def validation(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line]

    (a,), (b,) = validation(tmp_path / "one"), validation(tmp_path / "two")
    assert a["val_tokens"] == b["val_tokens"] == 2 * 4 * 31
    # measured equal: the same micro-batches through the same weights; only the float64 sum's order differs
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-12)


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


def test_train_runs_a_config_with_overrides_then_plot_redraws(cli, tmp_path):
    result = cli("train", str(tiny_config(tmp_path, tmp_path / "run")), "--set", "training.steps=3")
    assert result.returncode == 0, result.stderr
    assert "done: 3 steps" in result.stdout and len(losses(tmp_path / "run")) == 3
    (tmp_path / "run" / "loss.png").unlink()
    result = cli("plot", str(tmp_path / "run"))
    assert result.returncode == 0 and (tmp_path / "run" / "loss.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["train", "missing.yaml"], "error: config file missing.yaml does not exist"),
    (["train", "--set", "training.stepz=3"], r"error: training.stepz: unknown key; did you mean training.steps\?"),
    (["train", "--set", "optimizer.lr=fast"], "error: .*optimizer.lr: .*got 'fast'"),
    (["train", "--set", "training.global_batch=7"], r"error: training.global_batch \(7\) must be a multiple"),
    (["train", "--set", "model.config=null", "--set", "model.path=nowhere"], "error: .*nowhere"),
    (["plot", "nowhere"], "error: nowhere holds no metrics.jsonl"),
    (["train", "--set", "parallel.dp_shard=2"], r"error: parallel.dp_shard = 2 .* this run has 1; .*--nproc 2"),
    # found by the launcher before any rank starts (tests/conftest.py's `cli` refuses to start
    # ranks): one line for the run, and no restart meets it again
    (["train", "--set", "parallel.dp_shard=3", "--nproc", "2", "--max-restarts", "3"],
     r"error: parallel.dp_shard = 3 .* this run has 2"),
    (["train", "--nproc", "0"], r"error: --nproc must be at least 1, got 0"),
    (["prepare", "--set", "data.source=files", "--set", "data.files=none*.jsonl"],
     r"error: data.files: 'none\*.jsonl' matches no file"),
    (["prepare", "--set", "model.family=deepseek_v4", "--set", "model.config={}", "--set", "data.document_mask=true"],
     r"error: data.document_mask: model.family deepseek_v4: its compressed attention"),
])
def test_user_errors_print_one_line_and_exit_2(cli, tmp_path, args, message):
    """In this process (tests/conftest.py's `cli`); test_the_real_entry_point_... shows the same
    from `python -m hyperparallel`."""
    result = cli(*args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "runs").exists()


def test_the_real_entry_point_prints_one_line_and_exits_2_without_a_traceback(tmp_path):
    """What a user sees, from a process of its own: `python -m hyperparallel train missing.yaml`."""
    result = run("train", "missing.yaml", tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: config file missing.yaml does not exist, and no example "
                                                   "config has that name (the examples: chat, "), result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def one_rank(config: Path, *sets: str) -> None:
    """`hyperparallel train CONFIG --set ...` on one rank, here: the reference of a 2-rank run,
    computed on one thread as each rank computes (a matmul's summation order depends on it)."""
    from hyperparallel.train.config import load_config
    from hyperparallel.train.loop import train
    from tests.dist.test_fsdp import one_thread

    with one_thread():
        train(load_config(config, list(sets)))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))


# The 2-rank runs of the shared spawn's trainer part (trainer_runs below): --set options of each
SHARDED_RUN = ["optimizer.name=muon", "training.steps=4", "checkpoint.every=2", "logging.progress=false"]
SHARDING = ["parallel.dp_shard=2", "parallel.shard_geometry=balanced", "parallel.align=32", "training.compile=dvm",
            "parallel.ep=2"]
VALIDATION_RUN = ["optimizer.lr=0", "training.steps=2", "training.eval_batches=2", "logging.progress=false"]


def sets(options: list[str]) -> list[str]:
    return [arg for option in options for arg in ("--set", option)]


def test_two_ranks_replicate_and_match_one_rank(spawn_2, tmp_path, private_cache):
    """tests/train/test_fault_tolerance.py's run (qwen3, 12 steps), uninterrupted on the 2 ranks of
    the shared spawn (replicated: no dp_shard), and on one rank here."""
    from tests.train.test_fault_tolerance import STEPS, write_config

    two = Path(spawn_2["trainer"][0]["replicate"])
    one_rank(write_config(tmp_path, tmp_path / "one"))
    assert len(losses(two)) == STEPS
    # 2 ranks x 1 micro-batch vs 1 rank x 2 accumulated: the same sequences, the same mean gradient
    assert losses(two) == pytest.approx(losses(tmp_path / "one"), rel=1e-4)


def imbalance(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["moe_imbalance"] for r in records if "loss" in r]


def test_two_sharded_ranks_match_one_rank(spawn_2, tmp_path, private_cache):
    """parallel.dp_shard: 2 with expert parallelism (ep: 2, each rank holds 8 of the 16 experts),
    an MoE model with its auxiliary loss, Muon, uneven shards (balanced, align 32), decoder layers
    compiled (dvm: FSDP's hooks stay outside the graphs), on the ranks of the shared spawn; then
    resumed by `hyperparallel train --nproc 2`, ranks of their own."""
    sharded = spawn_2["trainer"][0]["sharded"]
    config, run_dir = Path(sharded["config"]), Path(sharded["run_dir"])
    one_rank(tiny_config(tmp_path, tmp_path / "one", family="qwen3_moe"), *SHARDED_RUN)
    printed = sharded["printed"]
    # the run summary names the layout that ran: ep and dp_shard, with FSDP's geometry
    assert "layout: 2 ranks: dp_shard 2, ep 2; FSDP over 2 ranks (balanced, align 32)\n" in printed
    # (evaluating after every step, under FSDP, changes nothing of the training)
    assert printed.count("  validation loss ") == 4
    # the expert loads, summed over the ranks, are one rank's: the same routing
    assert imbalance(run_dir) == pytest.approx(imbalance(tmp_path / "one"), rel=1e-6)
    # the ranks average their gradients in another order than one process accumulates them, and
    # Muon's bf16 Newton-Schulz turns that last bit into ~1e-4 of the loss within 4 steps
    assert losses(run_dir) == pytest.approx(losses(tmp_path / "one"), rel=1e-3)
    # resume: as if the job had died after step 2, from the sharded checkpoint it left there (in a
    # copy: the shared spawn's run stays as it was)
    import shutil

    died = shutil.copytree(run_dir, tmp_path / "died")
    shutil.rmtree(died / "checkpoints" / "step_00000004")
    full = losses(died)
    (died / "metrics.jsonl").write_text("".join(line + "\n" for line in (died / "metrics.jsonl").read_text()
                                                .splitlines() if json.loads(line)["step"] <= 2))
    resumed = run("train", str(config), *sets(SHARDED_RUN + SHARDING), "--set", "checkpoint.resume=latest",
                  "--set", f"logging.run_dir={died}", "--nproc", "2", tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert losses(died) == full  # exactly: the same ranks, shards and order of every sum


def trainer_runs(rank: int, world: int, out_dir: str) -> dict:
    """`hyperparallel train`'s loop on a rank of the session's shared 2-rank spawn
    (tests/dist/spawn.py; the trainer joins its process group), each run's directory by name:
    - sequential, megamoe: 20 steps with the sequential EP layer, then with MegaMoE in 2 waves and
      logging.trace; dp_shard 2, ep 2, fp32, the aux loss on;
    - deepseek_v4_kernels_on/off: DeepSeek-V4 with and without its kernels (tests/train/test_deepseek_v4.py);
    - replicate: tests/train/test_fault_tolerance.py's run, uninterrupted (that file's reference);
    - validation: qwen3_moe at lr 0 on dp_shard 2, evaluated;
    - sharded: test_two_sharded_ranks_match_one_rank's run, from a YAML file as the CLI reads it,
      with what it printed."""
    import contextlib
    import io
    import os

    from hyperparallel.train.config import from_mapping, load_config
    from hyperparallel.train.loop import train
    from tests.train import test_fault_tolerance

    os.environ.update(HYPERPARALLEL_CACHE=os.path.join(out_dir, "cache"))
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
    out = Path(out_dir)
    train(load_config(test_fault_tolerance.write_config(out, out / "replicate")))
    runs["replicate"] = str(out / "replicate")
    validation = out / "validation.yaml"
    validation.write_text(yaml.safe_dump(tiny_raw(out / "validation", family="qwen3_moe")))
    train(load_config(validation, [*VALIDATION_RUN, "parallel.dp_shard=2"]))
    runs["validation"] = str(out / "validation")
    sharded = out / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(tiny_raw(out / "sharded", family="qwen3_moe")))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train(load_config(sharded, [*SHARDED_RUN, *SHARDING, "training.eval_every=1"]))
    runs["sharded"] = {"config": str(sharded), "run_dir": str(out / "sharded"), "printed": printed.getvalue()}
    return runs


def test_megamoe_trains_as_the_sequential_layer_and_traces_its_graphs(spawn_2):
    """moe.implementation: megamoe in 2 waves against the sequential EP layer in the trainer for 20
    steps: the same loss curve; logging.trace writes a timeline of two steps with MegaMoE's tasks
    on every rank's lanes. (Run by the ranks of the shared spawn: two launches fewer.)"""
    from hyperparallel.multicore import timeline

    runs = spawn_2["trainer"][0]
    want = losses(Path(runs["sequential"]))
    assert len(want) == 20
    # measured: 8e-8 relative on most steps (each expert's products see the same rows; a token's
    # four results are summed in another order), and up to 3.4e-5 on a few: those rounding
    # differences, in the hidden states, flip a near-tie of some token's top-k experts that step
    got = losses(Path(runs["megamoe"]))
    relative = [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]
    assert sum(r < 1e-6 for r in relative) >= 15 and max(relative) < 3e-4, relative
    events = timeline.load(Path(runs["megamoe"]) / "trace.json")
    assert {e["pid"] for e in events} == {0, 1}
    steps = sorted({e["name"] for e in events if e["lane"] == "step"})
    assert steps == ["step 2", "step 3"]  # the first step warms up
    names = {e["name"] for e in events if e["pid"] == 1}
    assert {"dispatch 0", "combine 1", "experts 1", "dgrad 0", "wgrad 1", "dispatch grad 1"} <= names
    assert {e["lane"] for e in events} == {"step", "compute", "comm"}


def test_the_validation_loss_is_the_same_on_one_rank_and_two_sharded_ranks(spawn_2, tmp_path, private_cache):
    """lr 0: both layouts evaluate the same (initial) weights on the same held-out sequences (two
    sharded ranks: the shared spawn's)."""
    one_rank(tiny_config(tmp_path, tmp_path / "one", family="qwen3_moe"), *VALIDATION_RUN)

    def validation(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line]

    (a,), (b,) = validation(tmp_path / "one"), validation(Path(spawn_2["trainer"][0]["validation"]))
    assert a["val_tokens"] == b["val_tokens"] == 2 * 4 * 31
    # measured equal: the same micro-batches through the same weights; only the float64 sum's order differs
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-12)


def test_prepare_then_train_a_chat_datasets_directory(cli, tmp_path):
    """A DatasetDict of chat records written by `datasets.save_to_disk`: `hyperparallel prepare`
    tokenizes it (its train split), then `train` finds the shards and fine-tunes on them."""
    datasets = pytest.importorskip("datasets")
    chats = [{"messages": [{"role": "user", "content": f"word {i} " * (1 + i % 5)},
                           {"role": "assistant", "content": "noted"}]} for i in range(200)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(chats),
                          "test": datasets.Dataset.from_list(chats[:10])}).save_to_disk(str(tmp_path / "chats"))
    raw = tiny_raw(tmp_path / "run", steps=2)
    raw["data"] = {"source": "files", "files": str(tmp_path / "chats"), "vocab_size": 512, "seq_len": 64,
                   "validation": None}
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(raw))
    prepared = cli("prepare", str(tmp_path / "chat.yaml"))
    assert prepared.returncode == 0, prepared.stderr
    assert "data: 200 documents, chat, the assistant turns trained, packed, document masks; shards tokenized" in prepared.stdout
    trained = cli("train", str(tmp_path / "chat.yaml"), "--set", "logging.progress=false")
    assert trained.returncode == 0, trained.stderr
    assert "data: 200 documents, chat, the assistant turns trained, packed, document masks; shards found" in trained.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()

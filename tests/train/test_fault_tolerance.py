"""A rank that dies or hangs, an elastic restart, a preempted job and Ctrl-C, through the command line.

Each run is 2 gloo ranks (`hyperparallel train --nproc 2`) of a tiny fp32 model, compared with
one uninterrupted run of the same layout (on the 2 ranks of the session's shared spawn): resuming
is exact there (the same ranks, shards and order of every sum), so a restarted or preempted run
must give the very same losses.

To interrupt a run at a point it cannot have passed, the test stops its ranks (SIGSTOP) as soon
as the checkpoint of step 2 is complete, does what a failure or a scheduler would, and lets
them go on (SIGCONT).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.train.test_cli_train import ROOT, losses

STEPS = 12
TIMEOUT_S = 60  # training.timeout_s of these runs: a failure must end a run within it


def write_config(tmp_path: Path, run_dir: Path) -> Path:
    raw = {
        "model": {"family": "qwen3", "config": yaml.safe_load((ROOT / "configs/models/qwen3_tiny.yaml").read_text())},
        "data": {"max_corpus_bytes": 60_000, "vocab_size": 512, "seq_len": 32, "validation": None},
        "training": {"steps": STEPS, "global_batch": 4, "micro_batch": 2, "timeout_s": TIMEOUT_S, "compile": "none"},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"warmup_steps": 0},
        "checkpoint": {"every": 2, "keep_last": 10},
        "logging": {"run_dir": str(run_dir), "every": 1, "progress": False},
    }
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def environment(cache: Path) -> dict:
    return dict(os.environ, HYPERPARALLEL_CACHE=str(cache), OMP_NUM_THREADS="1")


def start(tmp_path: Path, cache: Path, *args: str, command=("-m", "hyperparallel", "train"), **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *command, *args], cwd=tmp_path, text=True,
                            env={**environment(cache), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def rank_pids(cache: Path) -> dict[int, int]:
    """The pids of this run's ranks, by rank (from each process's environment)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"HYPERPARALLEL_CACHE={cache}".encode() in env and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                pids[rank] = int(proc.name)
    return pids


def pause_after_step_2(run_dir: Path, cache: Path, proc: subprocess.Popen, ranks: int = 2) -> dict[int, int]:
    """Wait for the checkpoint of step 2, then stop every rank where it is; their pids."""
    done = run_dir / "checkpoints" / "step_00000002" / "checkpoint.json"
    while not done.is_file():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    pids = rank_pids(cache)
    assert sorted(pids) == list(range(ranks)), pids
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    return pids


def resume(pids: dict[int, int]) -> None:
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def uninterrupted(spawn_2) -> list[float]:
    """The same run on 2 ranks, uninterrupted: run by the ranks of the session's shared spawn
    (tests/train/test_cli_train.py's trainer_runs), one launch fewer."""
    run_dir = Path(spawn_2["trainer"][0]["replicate"])
    assert len(losses(run_dir)) == STEPS
    return losses(run_dir)


def kill_rank_1(tmp_path: Path, *options: str, **how) -> tuple[subprocess.Popen, dict[int, int], Path]:
    """Start a run, kill rank 1 after step 2; the run, its ranks' pids, its run dir."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = start(tmp_path, cache, str(write_config(tmp_path, run_dir)), *options, **how)
    pids = pause_after_step_2(run_dir, cache, proc)
    os.kill(pids[1], signal.SIGKILL)
    resume(pids)
    return proc, pids, run_dir


# rank 1: the second shard of the model, or its pipeline's second (last) stage
LAYOUTS = {"dp_shard": (), "pp": ("--set", "parallel.pp=2")}  # (its head tied to its embedding)


def test_a_killed_rank_ends_the_run_with_one_line_naming_it(tmp_path):
    """(The launcher's own report: the same under a pipeline, whose restart is tested below.)"""
    proc, pids, run_dir = kill_rank_1(tmp_path, "--nproc", "2", *LAYOUTS["dp_shard"])
    out, err = proc.communicate(timeout=TIMEOUT_S)  # within training.timeout_s, or this raises: never a hang
    assert proc.returncode == 1
    assert "Traceback" not in err + out
    newest = sorted((run_dir / "checkpoints").glob("step_????????"))[-1]
    assert err.splitlines() == [
        f"error: rank 1 (pid {pids[1]}) was killed by SIGKILL; the run stopped; newest complete checkpoint: {newest} "
        f"(continue with --set checkpoint.resume=latest)"
    ], err
    # nothing half-written: every checkpoint directory under its name is complete
    assert all((p / "checkpoint.json").is_file() for p in (run_dir / "checkpoints").glob("step_????????"))


def test_with_a_restart_a_killed_pipeline_completes_to_the_uninterrupted_losses(tmp_path, uninterrupted):
    """`--nproc 2 --max-restarts 1` (the data-parallel layout's restart: under torchrun, below).
    pp=2, its last stage's rank killed: the restart resumes both stages from the newest
    checkpoint, and the losses are the uninterrupted run's (that one on 2 data-parallel ranks: the
    same sums in another order, measured 3.8e-8 apart; a lost or repeated step moves the loss by far
    more)."""
    proc, _, run_dir = kill_rank_1(tmp_path, "--nproc", "2", "--max-restarts", "1", *LAYOUTS["pp"])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "restart 1 of 1 after a failure: resumed from" in out and f"done: {STEPS} steps" in out
    got = losses(run_dir)
    assert len(got) == STEPS and max(abs(a - b) / b for a, b in zip(got, uninterrupted, strict=True)) < 1e-5


def test_under_torchrun_itself_a_restart_resumes_the_same_way(tmp_path, uninterrupted):
    """What several machines run (README): torchrun on each, the trainer as its module."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                "-m", "hyperparallel", "train")
    proc, _, run_dir = kill_rank_1(tmp_path, command=torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "restart 1 of 1 after a failure: resumed from" in out
    assert losses(run_dir) == uninterrupted


def test_sigterm_saves_a_checkpoint_that_resumes_to_the_uninterrupted_losses(tmp_path, uninterrupted):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    config = str(write_config(tmp_path, run_dir))
    proc = start(tmp_path, cache, config, "--nproc", "2")
    pids = pause_after_step_2(run_dir, cache, proc)
    proc.send_signal(signal.SIGTERM)  # what a scheduler preempting the job does to the launcher
    time.sleep(0.2)  # (the launcher passes it on to the stopped ranks; they see it when they go on)
    resume(pids)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err + out
    assert err.splitlines() == ["SIGTERM: the ranks finish this step, save a checkpoint and stop"]
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1, out
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 2 < step < STEPS and (run_dir / "checkpoints" / f"step_{step:08d}" / "checkpoint.json").is_file()
    again = start(tmp_path, cache, config, "--nproc", "2", "--set", "checkpoint.resume=latest")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:08d}'} at step {step}" in out
    assert losses(run_dir) == uninterrupted


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    """One process, no launcher: the first Ctrl-C asks for a checkpoint after the step, the
    second (sent once the first has been seen) ends the process there and then."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = start(tmp_path, cache, str(write_config(tmp_path, run_dir)), "--set", "training.steps=100000")
    while not (run_dir / "metrics.jsonl").is_file():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    first = proc.stderr.readline()
    assert first == "SIGINT: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGINT
    assert err.splitlines() == ["error: interrupted again: stopped at once; the newest complete checkpoint is kept"]
    assert "Traceback" not in out


def test_sigterm_while_the_ranks_start_stops_them_and_says_nothing_was_saved(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    proc = start(tmp_path, cache, str(write_config(tmp_path, run_dir)), "--nproc", "2", "--max-restarts", "2")
    while len(rank_pids(cache)) < 2:  # started, and still importing torch: long before their first step
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.splitlines() == ["SIGTERM: the ranks finish this step, save a checkpoint and stop",
                                "error: stopped by SIGTERM before the ranks saved a checkpoint; no checkpoint was "
                                "complete"], err
    assert rank_pids(cache) == {}  # none left behind, restarts included


HANG_TIMEOUT_S = 10  # training.timeout_s of the hang test: short, as its run waits that long


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for `pid` (sent to a stopped process, it waits for SIGCONT)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    pending = {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines())
               if k in ("SigPnd", "ShdPnd")}
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending.values())


def test_a_rank_that_hangs_alive_ends_the_run_after_the_timeout_with_one_line_naming_it(tmp_path):
    """Of 3 ranks, rank 1 stopped (SIGSTOP: alive, holding its sockets, answering nothing) after
    step 2: the others' next collective waits training.timeout_s for it and fails (the first to
    time out closes its connections, so the other's may fail as a lost peer first), they answer a
    roll call that rank 1 misses (`train.roll_call`), and the launcher's one line names rank 1,
    with gloo's "Timed out waiting 10000ms": this run's timeout_s, not the default 300 s.

    The agent then stops rank 1 with SIGTERM, which ends a rank stuck in a loop or a call at once
    (the ranks keep SIGTERM fatal) but waits on a stopped one: once it is pending, the test lets
    rank 1 go on (SIGCONT) to see it, rather than wait the agent's 30 s before its SIGKILL."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    config = str(write_config(tmp_path, run_dir))
    proc = start(tmp_path, cache, config, "--nproc", "3", "--set", f"training.timeout_s={HANG_TIMEOUT_S}",
                 "--set", "training.global_batch=6")
    try:
        pids = pause_after_step_2(run_dir, cache, proc, ranks=3)
        resume({0: pids[0], 2: pids[2]})  # ranks 0 and 2 go on; rank 1 stays stopped
        # a bound, never a hang: with the default timeout (300 s on CPU) rank 0 would still wait
        deadline = time.monotonic() + HANG_TIMEOUT_S + 120
        while proc.poll() is None and not sigterm_pending(pids[1]):
            assert time.monotonic() < deadline, "no rank timed out: the agent never stopped rank 1"
            time.sleep(0.01)
        resume({1: pids[1]})
        out, err = proc.communicate(timeout=60)
    finally:  # however it went: no rank left behind, stopped or not (SIGKILL ends a stopped one too)
        for pid in rank_pids(cache).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert "Traceback" not in err + out
    newest = run_dir / "checkpoints" / "step_00000002"  # ranks 0 and 2 cannot finish step 3 alone
    assert sorted((run_dir / "checkpoints").glob("step_????????")) == [newest]
    [line] = err.splitlines()
    said = ("error: rank 1 stopped answering (stuck, or a step longer than training.timeout_s): a collective timed "
            "out waiting, and rank 1 missed the roll call after it (rank 0: RuntimeError: ")
    assert line.startswith(said), line
    gloo = line[len(said):]
    # gloo's words: rank 0's own wait timed out, on this run's timeout, or its peer closed its pairs
    # when rank 2's did
    assert f"Timed out waiting {HANG_TIMEOUT_S * 1000}ms" in gloo or "Connection closed by peer" in gloo, line
    assert gloo.endswith(f"); the run stopped; newest complete checkpoint: {newest} "
                         f"(continue with --set checkpoint.resume=latest)"), line
    assert rank_pids(cache) == {}  # none left behind

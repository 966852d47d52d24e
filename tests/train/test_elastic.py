"""What the launcher reads from its ranks: which failure started it, and the line it prints.

The failures are torch.distributed.elastic's own ProcessFailure records, read from error files
that `elastic.record_failure` wrote (as a failing rank does) or from exit codes alone (a rank
killed by a signal writes nothing)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from hyperparallel.errors import ConfigError
from hyperparallel.train import elastic, roll_call
from hyperparallel.train.distributed import check_restartable
from hyperparallel.train.launch import check_nproc


def recorded(tmp_path, monkeypatch, rank: int, error: BaseException, absent: list[int] | None = None) -> ProcessFailure:
    path = tmp_path / str(rank) / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise error
    except BaseException as raised:  # with its traceback, as a rank records it
        elastic.record_failure(raised, absent)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(path))


def killed(tmp_path, rank: int, sig: signal.Signals) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=-sig, error_file=str(tmp_path / "none.json"))


PEER_LOST = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24270")
TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")


def test_a_killed_rank_is_named_before_the_ranks_that_lost_it(tmp_path, monkeypatch):
    failures = {0: recorded(tmp_path, monkeypatch, 0, PEER_LOST), 1: killed(tmp_path, 1, signal.SIGKILL),
                2: killed(tmp_path, 2, signal.SIGTERM)}
    rank, failure = elastic.root_cause(failures)
    assert rank == 1
    assert elastic.describe(rank, failure) == ("rank 1 (pid 1001) was killed by SIGKILL", False)


def test_an_error_is_named_before_a_rank_that_lost_its_peer(tmp_path, monkeypatch):
    failures = {0: recorded(tmp_path, monkeypatch, 0, PEER_LOST),
                1: recorded(tmp_path, monkeypatch, 1, MemoryError("out of memory allocating 2 GiB"))}
    rank, failure = elastic.root_cause(failures)
    line, user_error = elastic.describe(rank, failure)
    assert rank == 1 and not user_error
    assert line == f"rank 1 failed: MemoryError: out of memory allocating 2 GiB (traceback: {tmp_path / '1' / 'traceback.txt'})"
    assert "raise error" in (tmp_path / "1" / "traceback.txt").read_text()


def test_a_timeout_is_named_before_the_stuck_rank_the_agent_killed(tmp_path, monkeypatch):
    """A stuck rank does not exit on SIGTERM; the agent then kills it with SIGKILL. The rank whose
    collective timed out tells what happened."""
    failures = {0: recorded(tmp_path, monkeypatch, 0, TIMED_OUT), 1: killed(tmp_path, 1, signal.SIGKILL)}
    rank, failure = elastic.root_cause(failures)
    line, _ = elastic.describe(rank, failure)
    assert rank == 0 and line.startswith("rank 0 timed out waiting for the other ranks: another rank is stuck")


def test_the_ranks_a_roll_call_missed_are_named_as_stuck(tmp_path, monkeypatch):
    failures = {0: recorded(tmp_path, monkeypatch, 0, TIMED_OUT, absent=[1, 3]), 1: killed(tmp_path, 1, signal.SIGKILL),
                2: recorded(tmp_path, monkeypatch, 2, TIMED_OUT, absent=[]), 3: killed(tmp_path, 3, signal.SIGKILL)}
    rank, failure = elastic.root_cause(failures)
    line, _ = elastic.describe(rank, failure)
    assert rank == 0 and line.startswith("ranks 1, 3 stopped answering (stuck, or a step longer than training.timeout_s): "
                                         "a collective timed out waiting, and ranks 1, 3 missed the roll call after it "
                                         "(rank 0: RuntimeError: [gloo"), line


def test_a_roll_call_that_named_the_stuck_rank_is_the_root_cause_whoever_timed_out_first(tmp_path, monkeypatch):
    """Rank 1's collective timed out first; rank 0's then lost its peer (gloo closes a timed-out
    rank's pairs) and made the roll call, which named rank 2; the agent killed rank 2 at last."""
    failures = {0: recorded(tmp_path, monkeypatch, 0, PEER_LOST, absent=[2]),
                1: recorded(tmp_path, monkeypatch, 1, TIMED_OUT, absent=[]), 2: killed(tmp_path, 2, signal.SIGKILL)}
    rank, failure = elastic.root_cause(failures)
    assert rank == 0 and elastic.describe(rank, failure)[0].startswith("rank 2 stopped answering")


def test_a_rank_that_recorded_its_failure_is_named_for_it_though_the_agent_then_stopped_it(tmp_path, monkeypatch):
    """Rank 0 ends the roll call, records, and the agent may stop it (SIGTERM) before it exits."""
    failure = recorded(tmp_path, monkeypatch, 0, TIMED_OUT, absent=[2])
    stopped = ProcessFailure(local_rank=0, pid=1000, exitcode=-signal.SIGTERM, error_file=failure.error_file)
    failures = {0: stopped, 1: killed(tmp_path, 1, signal.SIGTERM), 2: killed(tmp_path, 2, signal.SIGKILL)}
    rank, failure = elastic.root_cause(failures)
    assert rank == 0 and elastic.describe(rank, failure)[0].startswith("rank 2 stopped answering")


@pytest.mark.parametrize("error, kind, waited", [
    (TIMED_OUT, "timeout", True),
    (RuntimeError("[Rank 0]: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)"),
     "timeout", True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:593] Application timeout caused pair closure"), "timeout", True),
    (PEER_LOST, "peer_lost", True),
    (ConfigError("logging.wandb: wandb.init failed: Run initialization has timed out after 90.0 sec."), "user", False),
    (RuntimeError("Socket Timeout: the store at 10.0.0.1:29500 did not answer"), "timeout", False),
    (MemoryError("out of memory"), "error", False)])
def test_only_a_collective_that_waited_for_a_rank_calls_the_roll(error, kind, waited):
    assert elastic.failure_kind(error) == kind
    assert elastic.waited_for_a_rank(error) is waited


# What gloo's monitored_barrier raises (torch 2.13), on rank 0 and on a rank that rank 0 left waiting
ROLL_CALL_ON_RANK_0 = "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 10000 ms"
ROLL_CALL_RANK_0_STUCK = ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting for "
                          "send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n"
                          "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for send operation")
ROLL_CALL_RANK_0_DONE = ("Rank 2 successfully reached monitoredBarrier, but received errors while waiting for "
                         "send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n"
                         "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:32433.")


@pytest.mark.parametrize("message, absent", [(ROLL_CALL_ON_RANK_0, [1, 3]), (ROLL_CALL_RANK_0_STUCK, [0]),
                                             (ROLL_CALL_RANK_0_DONE, []),
                                             ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 10000 ms", [2])])
def test_the_roll_call_reads_who_was_absent_from_gloos_words(message, absent):
    assert roll_call.absent_in(message) == absent


def test_a_user_error_in_the_ranks_is_its_own_message(tmp_path, monkeypatch):
    error = ConfigError("parallel.dp_shard = 3 shards the model over that many ranks, but this run has 2")
    failures = {r: recorded(tmp_path, monkeypatch, r, error) for r in (0, 1)}
    rank, failure = elastic.root_cause(failures)
    assert rank == 0 and elastic.describe(rank, failure) == (str(error), True)


@pytest.mark.parametrize("nproc, restarts, message", [
    (0, 0, "--nproc must be at least 1, got 0"),
    (-2, 0, "--nproc must be at least 1, got -2"),
    (2, -1, "--max-restarts must be 0 or more, got -1"),
])
def test_impossible_launches_are_named(nproc, restarts, message):
    with pytest.raises(ConfigError, match=message):
        check_nproc(nproc, restarts)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"--nproc 3: this machine has 2 visible GPU\(s\), one per rank"):
        check_nproc(3, 0)
    check_nproc(2, 0)


def test_torchrun_restarts_need_a_fixed_run_dir_and_no_shared_store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(ConfigError, match=r"logging.run_dir 'runs/\{time\}': under torchrun --max-restarts"):
        check_restartable("runs/{time}", resolved_by_launcher=False)
    check_restartable("runs/job-1", resolved_by_launcher=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restartable("runs/job-1", resolved_by_launcher=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # nothing to restart: nothing to refuse
    check_restartable("runs/{time}", resolved_by_launcher=False)

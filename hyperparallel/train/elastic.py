"""What `hyperparallel train --nproc` (the launcher, `train.launch`) and its ranks tell each other.

- The launcher marks the ranks' environment (`LAUNCHED`) and names a result file (`RESULT`):
  rank 0 writes there how the run ended (completed, or stopped by a signal after step N).
- A rank that fails records why in torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE, in
  the format torch.distributed.elastic reads back): one line of message, what kind of failure it
  was, and its traceback in a text file beside it. It prints nothing: the launcher prints one
  line for the whole run, naming the rank that failed first (`root_cause`).
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from pathlib import Path

from hyperparallel.errors import HyperparallelError

LAUNCHED = "HYPERPARALLEL_LAUNCHED"  # "1" in the environment of ranks our launcher started
RESULT = "HYPERPARALLEL_RESULT"  # where rank 0 writes how the run ended

# What a collective raises when the rank at the other end is gone, or when it waited too long
# for one that is alive but stuck: gloo's and NCCL's words.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted", "Read error")
_TIMED_OUT = ("Timed out waiting", "Socket Timeout", "timed out", "Watchdog caught collective operation timeout",
              "Application timeout caused pair closure")
# ... and only a collective's, waiting for another rank (not a store's, or a network call's); gloo's
# "pair closure" is this rank's other operation of the group that timed out
_COLLECTIVE_TIMED_OUT = re.compile(r"Timed out waiting \d+ ?ms for (send|recv)|Watchdog caught collective operation "
                                   r"timeout|Application timeout caused pair closure")


def launched_by_hyperparallel() -> bool:
    return os.environ.get(LAUNCHED) == "1"


def _write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: the launcher reads it meanwhile
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def write_result(result: dict) -> None:
    path = os.environ.get(RESULT)
    if path:
        _write_json(Path(path), result)


def read_json(path: Path) -> dict | None:
    """A JSON file a rank wrote (the result, an error record); None while it is absent or partial."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def failure_kind(error: BaseException) -> str:
    """user (a HyperparallelError), timeout (a collective waited training.timeout_s for a rank that
    is stuck), peer_lost (a collective failed because another rank died, or closed the group when
    its own wait timed out) or error (anything else)."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, HyperparallelError):  # (ours around a collective, a CheckpointError, is no mistake
        # of the user's; a message of the user's that says "timed out", a network call's, is)
        if _COLLECTIVE_TIMED_OUT.search(text):
            return "timeout"
        return "peer_lost" if any(marker in text for marker in _PEER_LOST) else "user"
    if any(marker in text for marker in _TIMED_OUT):
        return "timeout"
    return "peer_lost" if any(marker in text for marker in _PEER_LOST) else "error"


def waited_for_a_rank(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out waiting for another rank (gloo's or NCCL's
    words) or lost it: a roll call (`roll_call`) can tell which rank is stuck. (A rank whose wait
    timed out closes its pairs, so its neighbours' collectives fail as peer_lost, before their
    own timeout: they answer the roll call too, or rank 0 would name them.)"""
    kind = failure_kind(error)
    return kind == "peer_lost" or (kind == "timeout" and bool(_COLLECTIVE_TIMED_OUT.search(str(error))))


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def record_failure(error: BaseException, absent: list[int] | None = None) -> None:
    """Write `error` into this rank's torchrun error file (nothing outside torchrun), with the ranks
    a timeout's roll call found absent (`roll_call.missing`)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    kind = failure_kind(error)
    message = str(error) if kind == "user" else one_line(error)
    trace = Path(path).with_name("traceback.txt")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("".join(traceback.format_exception(error)))
    record = {"message": message, "timestamp": str(int(time.time())),
              "hyperparallel": {"kind": kind, "traceback": str(trace), "absent": absent}}
    _write_json(Path(path), record)


def _ours(record: dict | None) -> dict:
    """What `record_failure` put in an error file for us (kind, traceback), or {}."""
    return (record or {}).get("hyperparallel") or {}


def absent_of(failure) -> list[int]:
    """The ranks a failed rank's roll call found absent ([] when it made none, or all answered)."""
    return _ours(getattr(failure, "error_file_data", None)).get("absent") or []


def kind_of(failure) -> str | None:
    """The kind of failure a rank recorded before it ended (None: it recorded nothing)."""
    return _ours(getattr(failure, "error_file_data", None)).get("kind")


def traceback_of(failure) -> str | None:
    """The file holding the traceback a failed rank recorded, if it recorded one."""
    ours = _ours(getattr(failure, "error_file_data", None))
    return ours.get("traceback") if ours.get("kind") in ("error", "peer_lost") else None


def user_error_in(log_dir: Path) -> str | None:
    """The message of a mistake in the config or the data that a rank recorded under torchrun's
    log directory, while the run goes on (it would come back on every attempt)."""
    for path in log_dir.rglob("error.json"):
        record = read_json(path)
        if _ours(record).get("kind") == "user":
            return record.get("message")
    return None


def _signal(failure) -> str | None:
    return failure.signal_name() if failure.exitcode is not None and failure.exitcode < 0 else None


def root_cause(failures: dict) -> tuple[int, object]:
    """(rank, failure) of the failure that most likely started it, out of torchrun's per-rank
    failures: an error a rank raised, before a roll call that named the stuck ranks, before a
    collective that timed out (a stuck rank: the agent then kills that one with SIGKILL), before a
    rank killed from outside (SIGKILL, a crash), before one NCCL's watchdog aborted (SIGABRT: its
    collective failed or timed out, often because of another), before a rank that only lost its
    peers, before one the agent stopped (SIGTERM)."""
    def rank_order(item):
        rank, failure = item
        kind, sig = kind_of(failure), _signal(failure)
        if kind in ("user", "error"):
            order = 0
        elif absent_of(failure):
            order = 1
        elif kind == "timeout":
            order = 2
        elif sig is not None and sig not in ("SIGTERM", "SIGINT", "SIGABRT"):
            order = 3
        elif sig == "SIGABRT":  # on GPUs: NCCL's watchdog ending a rank whose collective failed
            order = 4
        elif kind == "peer_lost":
            order = 6
        elif sig is not None:
            order = 7
        else:
            order = 5  # exited non-zero without saying why
        return order, rank
    return min(failures.items(), key=rank_order)


def describe(rank: int, failure) -> tuple[str, bool]:
    """One line for a failed rank, and whether it was the user's mistake (exit 2, no hints)."""
    kind, sig = kind_of(failure), _signal(failure)
    # what a rank recorded, before the signal the agent may then have stopped it with (but NCCL's
    # SIGABRT says more than the peer it lost)
    if kind == "user":
        return failure.message, True
    if absent := absent_of(failure):
        who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {', '.join(map(str, absent))}"
        return (f"{who} stopped answering (stuck, or a step longer than training.timeout_s): a collective timed out "
                f"waiting, and {who} missed the roll call after it (rank {rank}: {failure.message})"), False
    if kind == "timeout":
        return (f"rank {rank} timed out waiting for the other ranks: another rank is stuck, or training.timeout_s is "
                f"shorter than a step ({failure.message})"), False
    if kind == "error":
        return f"rank {rank} failed: {failure.message} (traceback: {traceback_of(failure)})", False
    if sig == "SIGABRT":
        return (f"rank {rank} (pid {failure.pid}) was aborted (SIGABRT; on GPUs NCCL's watchdog does this when a "
                f"collective fails or waits longer than training.timeout_s, often for a rank that died or is stuck)"), \
            False
    if sig is not None:
        return f"rank {rank} (pid {failure.pid}) was killed by {sig}", False
    if kind == "peer_lost":
        return f"rank {rank} failed: {failure.message} (traceback: {traceback_of(failure)})", False
    return f"rank {rank} (pid {failure.pid}) exited with status {failure.exitcode}", False

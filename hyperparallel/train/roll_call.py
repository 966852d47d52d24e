"""Which rank is stuck, once a collective has timed out: a roll call of the ranks.

A collective that waits `training.timeout_s` for a rank that is alive but stuck (a hung call, a
stopped process, a step far longer than the timeout) fails on the ranks that wait, and says
nothing of which rank they waited for. So each rank whose collective timed out then answers a
roll call, `dist.monitored_barrier` on a gloo group of its own made at start (the run's groups may
be broken by the timeout): rank 0 hears every rank that answers within the wait and names the
others; a rank that hears nothing back from rank 0 within twice the wait names rank 0. The
launcher's one line names them (`elastic.describe`). Ranks whose collective failed because a
timed-out rank closed its connections (gloo's) answer too (`elastic.waited_for_a_rank`).

The wait is the run's timeout, at most a minute: every rank not stuck is then past its own
collective's timeout too, unless it waited in one that began much later (another mesh
dimension's, a step behind), which the roll call would name with the stuck one.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

_LONGEST_WAIT_S = 60
_group: dist.ProcessGroup | None = None
_wait_s: float = 0.0


def prepare(timeout_s: int) -> None:
    """Make the roll call's group (every rank calls this, at the same point of its start)."""
    global _group, _wait_s
    if dist.is_initialized() and dist.get_world_size() > 1:
        _wait_s = min(timeout_s, _LONGEST_WAIT_S)
        # the group's own timeout (another rank's wait for rank 0's answer) twice the roll call's:
        # rank 0 ends the roll call first, and its closing the group ends the others' wait at once
        _group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * _wait_s))


def missing() -> list[int] | None:
    """The ranks that did not answer the roll call (rank 0: every one it did not hear; another
    rank: [0] when rank 0 did not answer within twice the wait, else []); None without a roll
    call to make."""
    if _group is None:
        return None
    try:
        with _stderr_silenced():  # (gloo logs what it raises, in lines of its own, to the launcher's terminal)
            dist.monitored_barrier(group=_group, timeout=timedelta(seconds=_wait_s), wait_all_ranks=True)
    except RuntimeError as error:
        return absent_in(str(error))
    return []


def absent_in(message: str) -> list[int]:
    """The ranks a failed `monitored_barrier` names as absent: rank 0's "Ranks 1, 3 failed to pass
    monitoredBarrier"; another rank's timeout waiting for rank 0: [0]; another rank's wait ended
    otherwise (rank 0 closed the group, having named the absent ones): []."""
    if named := re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message):
        return sorted(int(rank) for rank in named.group(1).split(",") if rank.strip())
    if "from rank 0" in message and "Timed out" in message:
        return [0]
    return []


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 (where C++ code logs) on /dev/null for the block."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)

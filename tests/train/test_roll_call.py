"""The roll call after a collective's timeout (train/roll_call.py), on 3 gloo ranks of the shared
spawn: rank 2 never answers (stuck); rank 0 names it, and rank 1, whose wait rank 0 ends by closing
the group, names no one: its own wait is twice rank 0's, so though it starts the roll call half a
wait before rank 0 (its collective timed out first), it cannot time out first and name rank 0."""

from __future__ import annotations

import time

from hyperparallel.train import roll_call

WAIT_S = 2


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    roll_call.prepare(WAIT_S)
    if rank == world - 1:  # the stuck rank: it misses the roll call
        return {"absent": None, "took_s": 0.0}
    if rank == 0:  # (rank 0's collective timed out later than rank 1's: it starts the roll call last)
        time.sleep(WAIT_S / 2)
    start = time.perf_counter()
    absent = roll_call.missing()
    return {"absent": absent, "took_s": time.perf_counter() - start}


def test_rank_0_names_the_rank_that_missed_the_roll_call_and_the_others_name_no_one(spawn_3):
    results = spawn_3["roll_call"]
    assert [r["absent"] for r in results] == [[2], [], None]
    assert results[0]["took_s"] >= WAIT_S  # rank 0 waited out the roll call for rank 2
    assert results[1]["took_s"] < 2 * WAIT_S  # and rank 1's wait ended with it (after 1.5 x WAIT_S)


def test_one_rank_has_no_roll_call():
    roll_call.prepare(WAIT_S)  # (no process group here: nothing to make)
    assert roll_call.missing() is None

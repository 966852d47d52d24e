"""Checkpoints move between layouts: 3 ranks balanced, 2 ranks chunk, 1 unsharded process.

Every run gives each rank the whole batch and reduces in float64, so that any layout computes
bit for bit the same training (see test_fsdp's acceptance runs). Then "the same state" is exact:
a run resumed in a new layout must reproduce, exactly, the losses and weights of an
uninterrupted run of that layout, and a loaded state must equal the saved one exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hyperparallel import checkpoint
from hyperparallel.fsdp import MixedPrecision, clip_grad_norm_, shard_info
from tests.dist.spawn import part_dir
from tests.dist.test_fsdp import Uneven, make_optimizer, micro_batch, one_thread, shard_all

OPTIMIZERS = ("adamw", "muon")
THREE_BALANCED, TWO_CHUNK, ONE = (3, "balanced"), (2, "chunk"), (1, None)


def build(optimizer: str, geometry: str | None):
    model = Uneven()
    if geometry is not None:
        shard_all(model, geometry=geometry, mp_policy=MixedPrecision(reduce_dtype=torch.float64))
    return model, make_optimizer(model, optimizer, sharded=True)[0]  # hyperparallel's Muon: sharded or not


def state(model, opt) -> list:
    """Per parameter: this rank's rows, its optimizer state, and where the rows sit."""
    return [(shard_info(p), p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for p in model.parameters()]


def steps(model, opt, first: int, last: int, sharded: bool) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = micro_batch(step, 0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        # clipping, with a norm the gradients never reach: it runs, and leaves the bits alone
        if sharded:
            clip_grad_norm_(model, 1e6)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run(geometry, optimizer, out_dir, tasks) -> dict:
    """tasks: ("fresh", name) trains 4 steps and saves after 2 as `name`;
    ("resume", name) loads `name` and trains steps 3 and 4."""
    results = {}
    for kind, name in tasks:
        model, opt = build(optimizer, geometry)
        path = os.path.join(out_dir, f"{name}-{optimizer}")
        if kind == "fresh":
            losses = steps(model, opt, 0, 2, geometry is not None)
            saved = state(model, opt)
            checkpoint.save(path, model, opt, extra={"step": 2})
            losses += steps(model, opt, 2, 4, geometry is not None)
            results[name] = {"losses": losses, "saved": saved, "final": state(model, opt)}
        else:
            manifest = checkpoint.load(path, model, opt)
            loaded = state(model, opt)
            losses = steps(model, opt, manifest["extra"]["step"], 4, geometry is not None)
            results[f"{name}->"] = {"losses": losses, "loaded": loaded, "final": state(model, opt)}
    return results


# What each layout's ranks do, in the order the session runs them: one process first (before the
# shared 2-rank spawn), then 2 ranks and 3 ranks in the shared spawns (tests/dist/spawn.py), then
# 2 ranks once more for the 3-rank checkpoint (a spawn of its own: it needs the 3-rank spawn's
# files), and one process resuming from the sharded ones last.
TASKS = {2: [("fresh", "two"), ("resume", "one")], 3: [("fresh", "three"), ("resume", "two"), ("resume", "one")]}
LAYOUT = {2: TWO_CHUNK, 3: THREE_BALANCED}


def before_ranks(out_dir: str) -> None:
    """The one-process run whose checkpoint the ranks resume (tests/dist/spawn.py calls it before
    the first spawn that runs this file's part)."""
    if not (Path(out_dir) / "one.pt").exists():
        torch.save(one_process([("fresh", "one")], out_dir), Path(out_dir) / "one.pt")


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    return {opt: run(LAYOUT[world][1], opt, out_dir, TASKS[world]) for opt in OPTIMIZERS}


def resume_three(rank: int, world: int, out_dir: str) -> dict:
    shared = str(Path(out_dir).parent / "checkpoint")  # (the checkpoints of the shared spawns' part)
    return {opt: run(TWO_CHUNK[1], opt, shared, [("resume", "three")]) for opt in OPTIMIZERS}


def one_process(tasks, out_dir) -> list[dict]:
    with one_thread():
        return [{opt: run(None, opt, str(out_dir), tasks) for opt in OPTIMIZERS}]


def full(per_rank: list[dict], opt: str, run_name: str, key: str) -> list[tuple[torch.Tensor, dict]]:
    """Whole tensors (parameter, optimizer state) assembled from every rank's rows."""
    out = []
    for i in range(len(per_rank[0][opt][run_name][key])):
        pieces = sorted((r[opt][run_name][key][i] for r in per_rank), key=lambda e: e[0].offset)
        info = pieces[0][0]
        rows = [(p.reshape(inf.length, -1) if len(info.global_shape) else p.reshape(-1, 1)) for inf, p, _ in pieces]
        param = torch.cat(rows).reshape(info.global_shape)
        states = {}
        for k, v in pieces[0][2].items():
            if v.dim() == 0:
                assert all(torch.equal(s[k], v) for _, _, s in pieces)
                states[k] = v
            else:
                states[k] = torch.cat([s[k].reshape(inf.length, -1) for inf, _, s in pieces]).reshape(info.global_shape)
        out.append((param, states))
    return out


def assert_same(a, b, label):
    assert len(a) == len(b), label
    for i, ((pa, sa), (pb, sb)) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(pa, pb), f"{label}: parameter {i}"
        assert sa.keys() == sb.keys(), f"{label}: parameter {i} state keys"
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{label}: parameter {i} state {k}"


@pytest.fixture(scope="module")
def saved_and_resumed(spawn_2, spawn_3, spawn_dir) -> tuple:
    from tests.dist.spawn import Part, spawn

    out = part_dir(spawn_dir, "checkpoint")
    results = {"one": torch.load(out / "one.pt", weights_only=False), "two": spawn_2["checkpoint"],
               "three": spawn_3["checkpoint"]}
    again = spawn(2, [Part("checkpoint_from_three", "tests.dist.test_checkpoint:resume_three", (2,), ())], spawn_dir)
    results["two"] = [{o: {**a[o], **b[o]} for o in OPTIMIZERS}
                      for a, b in zip(results["two"], again["checkpoint_from_three"], strict=True)]
    for opt in OPTIMIZERS:  # the one process resumes from the sharded checkpoints last: they exist now
        extra = one_process([("resume", "three"), ("resume", "two")], out)[0][opt]
        results["one"][0][opt].update(extra)
    return out, results


@pytest.fixture(scope="module")
def layouts(saved_and_resumed) -> dict[str, list[dict]]:
    return saved_and_resumed[1]


# (saved by, loaded by)
MOVES = [("three", "two"), ("three", "one"), ("two", "three"), ("one", "three"), ("one", "two"), ("two", "one")]


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("saver, loader", MOVES)
def test_a_loaded_state_equals_the_saved_one(layouts, opt, saver, loader):
    saved = full(layouts[saver], opt, saver, "saved")
    loaded = full(layouts[loader], opt, f"{saver}->", "loaded")
    assert_same(loaded, saved, f"{opt}: saved by {saver}, loaded by {loader}")


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("saver, loader", MOVES)
def test_a_resumed_run_continues_as_the_uninterrupted_run_of_its_layout(layouts, opt, saver, loader):
    uninterrupted = layouts[loader][0][opt][loader]
    resumed = layouts[loader][0][opt][f"{saver}->"]
    assert resumed["losses"] == uninterrupted["losses"][2:]
    assert_same(full(layouts[loader], opt, f"{saver}->", "final"), full(layouts[loader], opt, loader, "final"),
                f"{opt}: saved by {saver}, resumed by {loader}")


def test_every_layout_computes_the_same_training(layouts):
    """What makes the two tests above exact: the layouts agree bit for bit without checkpoints."""
    for opt in OPTIMIZERS:
        want = layouts["one"][0][opt]["one"]["losses"]
        assert layouts["two"][0][opt]["two"]["losses"] == want
        assert layouts["three"][0][opt]["three"]["losses"] == want


def test_every_row_is_on_disk_once_and_no_padding(saved_and_resumed):
    """The chunks DCP wrote for a tensor tile its global shape exactly: nothing twice, no padding."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out, _ = saved_and_resumed
    for opt in OPTIMIZERS:
        for name in ("one", "two", "three"):
            meta = checkpoint.SafeFileSystemReader(str(out / f"{name}-{opt}")).read_metadata()
            tensors = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
            assert any(k.startswith("optim.") for k in tensors)
            for key, entry in tensors.items():
                stored = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
                assert stored == torch.Size(entry.size).numel(), f"{name}-{opt}: {key}"

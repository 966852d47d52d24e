"""The distributed paths of fsdp, optim, checkpoint and the trainer, on each device.

Every collective must run on tensors of its process group's device, or on the CPU side of the
trainer's `cpu:gloo,cuda:nccl` group: code that passes on gloo alone can still fail at its first
collective under NCCL. So each test here runs once per device, in ranks that join the group the
way the trainer does (`train.distributed.init_distributed`): on the CPU with 2 gloo ranks, and
unchanged on CUDA where GPUs are present (NCCL, one rank per GPU, at most 2). Without a GPU the
CUDA cases are skipped, and pytest's summary says so.

One spawn per device does everything (FSDP training with clipping, sharded Muon, a checkpoint
saved now and one saved in the background, loading into another geometry, the trainer's
per-step agreement): on the CPU the session's shared 2-rank spawn (tests/dist/spawn.py, whose
ranks join with `init_distributed`), on CUDA one of its own; the tests compare what it recorded
with one process on the same device.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyperparallel import checkpoint
from hyperparallel.fsdp import MixedPrecision, clip_grad_norm_, shard_info
from hyperparallel.train.distributed import agree, init_distributed, sum_over_ranks
from tests.dist.ranks import leave
from tests.dist.spawn import free_port
from tests.dist.test_checkpoint import full
from tests.dist.test_fsdp import Uneven, clip_one_process, make_optimizer, one_thread, shard_all
from tests.dist.test_fsdp import train as train_steps

OPTIMIZERS = ("adamw", "muon")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine; these tests run unchanged where there is one"))]


def world_size(device: str) -> int:
    return 2 if device == "cpu" else min(2, torch.cuda.device_count())


def full_state(model, opt) -> list[tuple]:
    """Per parameter: where this rank's rows sit, the rows, and their optimizer state (on the CPU)."""
    return [(shard_info(p), p.detach().cpu().clone(), {k: v.detach().cpu().clone() for k, v in opt.state[p].items()})
            for p in model.parameters()]


def sharded(device: torch.device, optimizer: str, geometry: str):
    model = Uneven().to(device)
    shard_all(model, geometry=geometry, mp_policy=MixedPrecision(reduce_dtype=torch.float64))
    return model, make_optimizer(model, optimizer, sharded=True)[0]


def run_on_rank(rank: int, world: int, device: torch.device, out_dir: str) -> dict:
    results: dict = {"backend": str(dist.get_backend())}
    for optimizer in OPTIMIZERS:
        # every rank sees the whole batch and gradients are averaged in float64: one process's training, exactly
        model, opt = sharded(device, optimizer, "chunk")
        train_steps(model, [opt], rank, world, clip=clip_grad_norm_, whole_batch=True, device=device)
        results[optimizer] = {"states": {"trained": full_state(model, opt)}}
        now, later = os.path.join(out_dir, f"{optimizer}-now"), os.path.join(out_dir, f"{optimizer}-background")
        checkpoint.save(now, model, opt, extra={"how": "now"})
        pending = checkpoint.async_save(later, model, opt, extra={"how": "background"})
        train_steps(model, [opt], rank, world, clip=clip_grad_norm_, whole_batch=True, device=device)  # while it writes
        results[optimizer]["published"] = str(pending.wait())
        # the checkpoint saved now, into another geometry
        again, again_opt = sharded(device, optimizer, "balanced")
        checkpoint.load(now, again, again_opt)
        results[optimizer]["states"]["loaded"] = full_state(again, again_opt)
    agreed = agree(loss=float(rank + 1), step_time_s=0.5 + rank, stop=rank == world - 1)
    results["agreed"] = (agreed.loss, agreed.step_time_s, agreed.stop)
    results["summed"] = sum_over_ranks([float(rank + 1), 2.0])  # (the validation loss's sums)
    return results


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    """The CPU's case, on a rank of the session's shared 2-rank spawn (tests/dist/spawn.py), whose
    ranks joined as the trainer does (`init_distributed`)."""
    return run_on_rank(rank, world, torch.device("cpu"), out_dir)


def cuda_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rt = init_distributed(timeout_s=120, device=torch.device("cuda", rank))
    torch.save(run_on_rank(rank, world, rt.device, out_dir), os.path.join(out_dir, f"rank{rt.rank}.pt"))
    leave()


@pytest.fixture(scope="module", params=DEVICES)
def ranks(request, tmp_path_factory):
    device = request.param
    if device == "cpu":
        return device, request.getfixturevalue("spawn_dir") / "device_paths", request.getfixturevalue("spawn_2")[
            "device_paths"]
    out = tmp_path_factory.mktemp(f"paths-{device}")
    world = world_size(device)
    mp.spawn(cuda_worker, args=(world, free_port(), str(out)), nprocs=world)
    return device, out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def whole(per_rank: list[dict], optimizer: str, key: str) -> list[tuple[torch.Tensor, dict]]:
    """Whole tensors (parameter, optimizer state) assembled from every rank's rows."""
    return full(per_rank, optimizer, "states", key)


def one_process(device: torch.device, optimizer: str):
    model = Uneven().to(device)
    opts = make_optimizer(model, optimizer, sharded=optimizer == "muon")  # hyperparallel's Muon: sharded or not
    with one_thread():
        train_steps(model, opts, clip=clip_one_process, device=device)
    return model, opts[0]


def test_the_trainer_joins_the_group_with_the_backends_of_its_device(ranks):
    device, _, per_rank = ranks
    want = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"  # torch returns the string the group was made with
    assert all(r["backend"] == want for r in per_rank)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sharded_training_with_clipping_equals_one_process(ranks, optimizer):
    device, _, per_rank = ranks
    model, opt = one_process(torch.device(device), optimizer)
    trained = whole(per_rank, optimizer, "trained")
    for (param, states), (name, want) in zip(trained, model.named_parameters(), strict=True):
        assert torch.equal(param, want.detach().cpu()), name
        for key, value in states.items():
            assert torch.equal(value.reshape(-1), opt.state[want][key].cpu().reshape(-1)), (name, key)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_background_save_holds_the_same_tensors_as_one_saved_now(ranks, optimizer):
    """Saved from the same state, the background one while training went on: loaded into one
    process, every parameter and optimizer state is the same, bit for bit."""
    device, out, per_rank = ranks
    assert per_rank[0][optimizer]["published"] == str(out / f"{optimizer}-background")
    loaded = {}
    for how in ("now", "background"):
        model = Uneven()
        opt = make_optimizer(model, optimizer, sharded=True)[0]
        manifest = checkpoint.load(out / f"{optimizer}-{how}", model, opt)
        assert manifest["extra"] == {"how": how} and manifest["world_size"] == len(per_rank)
        loaded[how] = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in model.parameters()]
    for (a, sa), (b, sb) in zip(loaded["now"], loaded["background"], strict=True):
        assert torch.equal(a, b)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    trained = whole(per_rank, optimizer, "trained")  # and both are the state they were saved from
    for (param, _), (saved, _) in zip(trained, loaded["now"], strict=True):
        assert torch.equal(param, saved)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_checkpoint_loads_into_another_geometry_on_the_device(ranks, optimizer):
    _, _, per_rank = ranks
    for (pa, sa), (pb, sb) in zip(whole(per_rank, optimizer, "loaded"), whole(per_rank, optimizer, "trained"),
                                  strict=True):
        assert torch.equal(pa, pb)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_every_rank_agrees_on_loss_time_and_a_stop_request(ranks):
    _, _, per_rank = ranks
    world = len(per_rank)
    want = (sum(range(1, world + 1)) / world, 0.5 + world - 1, True)
    assert all(r["agreed"] == want for r in per_rank)
    assert all(r["summed"] == [sum(range(1, world + 1)), 2.0 * world] for r in per_rank)

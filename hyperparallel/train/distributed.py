"""The process group of a training run, and what its ranks tell each other every step.

[Note: device-correct collectives] On GPUs the default group is `cpu:gloo,cuda:nccl`: CUDA
tensors go through NCCL, and the few CPU tensors of bookkeeping (each step's loss, time and
stop request, the validation loss's sums) through gloo. NCCL has no CPU path, so code that
passes on a gloo-only CPU run would otherwise fail at its first collective on GPUs. Model code
(FSDP, Muon, checkpoints) keeps its collectives on its tensors' device.

Elastic restarts: torchrun's agent starts the ranks again after a failure with
TORCHELASTIC_RESTART_COUNT counting the attempts; the trainer then resumes from the newest
complete checkpoint of the run directory (`train.loop`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hyperparallel import errors
from hyperparallel.errors import ConfigError, HyperparallelError
from hyperparallel.process_groups import forget
from hyperparallel.traffic import Traffic


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_for_this_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed(timeout_s: int, device: torch.device | None = None) -> Runtime:
    """Join the ranks torchrun started (WORLD_SIZE > 1), or with none a process group of this
    process alone, as torchrun's one-rank runs have: the mesh then has its groups on one rank as on
    many (parallel/mesh.py). Collectives fail after `timeout_s` seconds of waiting for another rank
    instead of hanging. An existing process group is joined as it is."""
    device = device or device_for_this_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world == 1 else {}
        dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), **alone)
    return Runtime(dist.get_rank(), world, device)


@contextmanager
def joined(timeout_s: int, device: torch.device | None = None) -> Iterator[Runtime]:
    """`init_distributed` for the block; a one-rank process group it started is left at the end,
    so a run in a process that goes on (a test, a notebook) leaves nothing behind. torchrun's ranks
    keep theirs until the process ends, as before: leaving a group while a collective may be in
    flight (an error mid-step) can block until the watchdog's timeout."""
    started = not dist.is_initialized()
    rt = init_distributed(timeout_s, device)
    try:
        yield rt
    finally:
        if started and rt.world == 1 and dist.is_initialized():
            forget()
            dist.destroy_process_group()


def background_group(timeout_s: int) -> dist.ProcessGroup | None:
    """A gloo group of every rank for work in a thread of its own (background checkpoints), with
    the run's collective timeout; None without a process group. Every rank calls it. Made anew
    for every run, not kept (process_groups.py): a run that failed may leave its last background
    save still writing through it."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


# ---------------------------------------------------------------------------- elastic runs

def restart_count() -> int:
    """How many times torchrun's agent has restarted this run's ranks (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def check_restartable(run_dir_template: str, resolved_by_launcher: bool) -> None:
    """Under torchrun with --max-restarts, refuse what would make a restart fail or start over."""
    if max_restarts() == 0:
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the agent then shares its store with the ranks across attempts, and restarted ranks
        # can read the previous attempt's addresses and hang (measured on torch 2.13)
        raise ConfigError("torchrun --max-restarts: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment; "
                          "with the rendezvous store shared with the ranks, restarted ranks can hang at start")
    if "{time}" in run_dir_template and not resolved_by_launcher:
        raise ConfigError(f"logging.run_dir {run_dir_template!r}: under torchrun --max-restarts every restart would "
                          f"start a new {{time}} directory and could not resume; give a fixed one (--set "
                          f"logging.run_dir=runs/my-job) or launch with hyperparallel train --nproc N --max-restarts K")


def decided_by_rank0(decide: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """`decide()` on rank 0 only (a look at the file system: on shared storage, ranks looking for
    themselves could see different files), its answer (anything JSON holds) on every rank; a
    mistake it finds (a HyperparallelError) is raised on every rank alike. `group`: the one to
    wait on (another timeout), the default group's ranks."""
    if not dist.is_initialized():
        return decide()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = json.dumps({"answer": decide()})
        except HyperparallelError as error:
            box[0] = json.dumps({"error": type(error).__name__, "message": str(error)})
    dist.broadcast_object_list(box, src=0, group=group)  # (a JSON string: nothing but text is unpickled)
    answer = json.loads(box[0])
    if "error" in answer:
        raise getattr(errors, answer["error"], HyperparallelError)(answer["message"])
    return answer["answer"]


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over the ranks, in float64 on the CPU (gloo) side of the group."""
    mine = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(mine)
    return mine.tolist()


def traffic_over_ranks(counted: Traffic) -> dict:
    """The bytes each rank sent in a counted step (`hyperparallel.traffic`), as the rank that sent
    the most counted them (by mesh dimension and kind: what `hyperparallel plan` predicts for
    it), with the mean over ranks; the same on every rank. Once per run: an object all-gather."""
    mine = counted.to_json()
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    busiest = max(range(len(everyone)), key=lambda r: everyone[r]["total"])
    return {"rank": busiest, **everyone[busiest],
            "mean_total": sum(t["total"] for t in everyone) / len(everyone)}


# ------------------------------------------------------------------------------ every step

@dataclass(frozen=True)
class StepAgreement:
    loss: float  # the mean of the ranks' losses
    step_time_s: float  # the slowest rank's
    stop: bool  # some rank was asked to stop (SIGTERM, Ctrl-C): all stop after this step


def agree(loss: float, step_time_s: float, stop: bool) -> StepAgreement:
    """One small all-gather on the CPU (gloo) side of the group; every rank gets the same answer."""
    if not dist.is_initialized():
        return StepAgreement(loss, step_time_s, stop)
    mine = torch.tensor([loss, step_time_s, float(stop)], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    table = torch.stack(everyone)
    return StepAgreement(table[:, 0].sum().item() / len(everyone), table[:, 1].max().item(),
                         bool(table[:, 2].max().item()))

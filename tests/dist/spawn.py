"""One spawn of gloo ranks per world size for the whole session, running the multi-rank parts of
every test module that the session collected.

Starting a rank costs more than most cases do: each imports torch, transformers and the
package (about 10 s of one core here, so 10-20 s of the suite's wall time per spawn on 2 cores).
So the ranks of each world size start once (`tests/conftest.py`'s `spawn_2`, `spawn_3`,
`spawn_4`) and run, one after the other, the parts below whose readers are in the session; each
part is a function `(rank, world, out_dir) -> result` of its test module, and the tests assert
on what every rank returned. The ranks join as the trainer does (`init_distributed`: env://,
the collective timeout), so a case stuck in a collective fails instead of hanging.
"""

from __future__ import annotations

import importlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

TIMEOUT_S = 600  # any collective of any part: fail after this long rather than hang the suite


@dataclass(frozen=True)
class Part:
    name: str
    run: str  # "module:function", called on every rank as function(rank, world, out_dir)
    worlds: tuple[int, ...]
    readers: tuple[str, ...]  # the test modules that read its results: it runs when one is collected
    before: str | None = None  # "module:function", called in this process as function(out_dir) before the spawn
    after: tuple[int, ...] = ()  # other world sizes whose spawn must have run first (their files are its inputs)


# In the order the ranks run them. The trainer's parts come last: a training run changes
# process-wide settings (seeds, environment, Dynamo's caches).
PARTS = (
    Part("fsdp", "tests.dist.test_fsdp:on_ranks", (2, 3, 4), ("tests.dist.test_fsdp",)),
    Part("mixed_precision", "tests.dist.test_mixed_precision:on_ranks", (2, 4), ("tests.dist.test_mixed_precision",)),
    Part("checkpoint", "tests.dist.test_checkpoint:on_ranks", (2, 3), ("tests.dist.test_checkpoint",),
         before="tests.dist.test_checkpoint:before_ranks", after=(2,)),
    Part("sharded_muon", "tests.dist.test_sharded_muon:on_ranks", (2, 3, 4), ("tests.dist.test_sharded_muon",)),
    Part("device_paths", "tests.dist.test_device_paths:on_ranks", (2,), ("tests.dist.test_device_paths",)),
    Part("export", "tests.checkpoint.test_export:on_ranks", (2,),
         ("tests.checkpoint.test_export", "tests.train.test_generate")),
    Part("moe", "tests.dist.test_expert_parallel:on_ranks", (2, 4),
         ("tests.dist.test_expert_parallel", "tests.dist.test_moe_dispatch", "tests.dist.test_mx_dispatch",
          "tests.moe.test_router", "tests.multicore.test_trace")),
    Part("parallel", "tests.dist.test_parallel_layouts:on_ranks", (4,),
         ("tests.dist.test_parallel_layouts", "tests.dist.test_context_parallel")),
    Part("weights", "tests.dist.test_sharded_weights:on_ranks", (4,), ("tests.dist.test_sharded_weights",),
         before="tests.dist.test_sharded_weights:before_ranks"),
    Part("pipeline", "tests.dist.test_pipeline:on_ranks", (4,), ("tests.dist.test_pipeline",),
         before="tests.dist.test_pipeline:before_ranks"),
    Part("trainer", "tests.train.test_cli_train:trainer_runs", (2,),
         ("tests.train.test_cli_train", "tests.train.test_deepseek_v4", "tests.train.test_fault_tolerance")),
    Part("parallel_trainer", "tests.dist.test_parallel_layouts:trainer_runs", (4,), ("tests.dist.test_parallel_layouts",)),
    Part("comm_bytes", "tests.train.test_comm_bytes:on_ranks", (2, 4), ("tests.train.test_comm_bytes",)),
    Part("coverage", "tests.models.test_coverage:on_ranks", (2,), ("tests.models.test_coverage",)),
    # last: its stuck rank goes on to nothing while the others wait out the roll call
    Part("roll_call", "tests.train.test_roll_call:on_ranks", (3,), ("tests.train.test_roll_call",)),
)


def parts_for(world: int, modules: set[str]) -> list[Part]:
    """The parts a world size's ranks run for a session that collected `modules`."""
    return [p for p in PARTS if world in p.worlds and modules & set(p.readers)]


def _function(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def part_dir(root: Path, part: str) -> Path:
    """A part's directory, the same at every world size (a part's files name their world size
    where it runs at several and they differ)."""
    return root / part


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, parts: list[Part], root: str, results_file: str) -> None:
    from hyperparallel.train.distributed import init_distributed
    from tests.dist.ranks import leave

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_distributed(timeout_s=TIMEOUT_S, device=torch.device("cpu"))
    results = {}
    for part in parts:
        start = time.perf_counter()
        try:
            results[part.name] = _function(part.run)(rank, world, str(part_dir(Path(root), part.name)))
        except Exception as e:  # (mp.spawn then ends every rank; this names the part in its report)
            raise RuntimeError(f"the shared spawn's part {part.name!r} ({part.run}) failed on rank {rank} of {world}") from e
        if rank == 0:  # where the suite's time goes: `pytest -s` prints it, the durations list cannot see inside a spawn
            print(f"spawn of {world}: part {part.name} took {time.perf_counter() - start:.1f} s", flush=True)
    torch.save(results, results_file.format(rank=rank))
    leave()


def spawn(world: int, parts: list[Part], root: Path) -> dict[str, list]:
    """Run `parts` on `world` ranks; part name -> what each rank returned, by rank."""
    for part in parts:
        part_dir(root, part.name).mkdir(parents=True, exist_ok=True)
        if part.before is not None:
            _function(part.before)(str(part_dir(root, part.name)))
    if not parts:
        return {}
    results_file = str(root / f"world{world}-{'+'.join(p.name for p in parts)}-rank{{rank}}.pt")
    mp.spawn(worker, args=(world, free_port(), parts, str(root), results_file), nprocs=world)
    per_rank = [torch.load(results_file.format(rank=r), weights_only=False) for r in range(world)]
    return {part.name: [results[part.name] for results in per_rank] for part in parts}

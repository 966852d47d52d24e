"""What a run prints: the layout that runs, the kernels a model has, step lines that fit 80
columns. (The headers of real tp=2, cp=2 and ep=2 runs: tests/dist/test_parallel_layouts.py and
tests/train/test_cli_train.py.)"""

from __future__ import annotations

import pytest

from hyperparallel.models.kernels import KernelsReport
from hyperparallel.parallel.mesh import MeshShape
from hyperparallel.train.config import ParallelSection
from hyperparallel.train.console import describe_layout, step_line, validation_line


@pytest.mark.parametrize("parallel, world, waves, described", [
    ({}, 1, None, "1 rank"),
    ({}, 2, None, "2 ranks, replicated (DDP)"),
    # tp alone shards nothing: no geometry (the FSDP group, dp_shard x cp, is one rank)
    ({"tp": 2}, 2, None, "2 ranks: tp 2"),
    ({"cp": 2}, 2, None, "2 ranks: cp 2 (ring attention); FSDP over 2 ranks (chunk, align 1)"),
    ({"dp_shard": 2, "ep": 2, "shard_geometry": "balanced", "align": 32}, 2, 2,
     "2 ranks: dp_shard 2, ep 2 (MegaMoE, 2 waves); FSDP over 2 ranks (balanced, align 32)"),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2, "sequence_parallel": True}, 8, None,
     "8 ranks: dp_replicate 2 (HSDP) x dp_shard 2 x tp 2 (sequence parallel); FSDP over 2 ranks (chunk, align 1)"),
])
def test_the_layout_described_is_the_one_that_runs(parallel, world, waves, described):
    p = ParallelSection(**parallel)
    assert describe_layout(p, MeshShape.of(p, world), waves=waves) == described


def test_the_kernels_line_names_only_what_the_model_has():
    dense, moe, v4 = KernelsReport(0, 0), KernelsReport(4, 0, routers=4), KernelsReport(0, 0, routers=4, hyper_connected=4)
    assert dense.summary(mega_gate=True, mega_mhc=True) == ""  # (no line)
    assert dense.summary(mega_gate=False, mega_mhc=False) == ""
    assert moe.summary(mega_gate=True, mega_mhc=True) == "kernels: MegaGate on (4 routers)"
    assert v4.summary(mega_gate=False, mega_mhc=False) == "kernels: MegaGate off, MegaMHC off"


RECORD = {"loss": 5.8026, "lr": 3e-4, "grad_norm": 0.75, "tokens_per_s": 5032.4, "step_time_s": 0.407, "mfu": 0.004,
          "peak_mem_bytes": int(0.81 * 2**30), "moe_imbalance": 3.28}
LARGEST = {"loss": 12.3456, "lr": 3e-4, "grad_norm": 123.4, "tokens_per_s": 1.234e6, "step_time_s": 123.4, "mfu": 1.0,
           "peak_mem_bytes": 140 * 2**30, "moe_imbalance": 12.34}


def test_a_step_line_is_whole_for_a_file_and_compact_at_80_columns():
    assert step_line(150, RECORD) == ("step    150  loss 5.8026  lr 3.0e-04  gnorm 0.75  5,032 tok/s  407 ms  mfu 0%  "
                                      "0.81 GiB  moe imbalance 3.28")
    assert step_line(150, RECORD, width=120, total_steps=150) == step_line(150, RECORD)  # (it fits: whole)
    assert (step_line(150, RECORD, width=80, total_steps=150)
            == "step 150 loss 5.8026 gn 0.75 5,032 tok/s 407ms mfu 0.4% 0.81GiB imb 3.28")
    # the widest figures of a long run still fit
    assert len(step_line(1_000_000, LARGEST, width=80, total_steps=1_000_000)) <= 80
    validation = {"val_loss": 5.656, "val_perplexity": 285.99, "val_tokens": 1_234_567}
    assert validation_line(150, validation, width=60, total_steps=150) == "step 150 val loss 5.6560 ppl 286 (1,234,567 tokens)"

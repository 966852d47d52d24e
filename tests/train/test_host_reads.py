"""The host reads of a training step: what would make the host wait for a GPU, counted on the
CPU path of the same code (tests/host_reads.py).

A step reads one value back: its loss, which the ranks agree on after every step (with the
step's time and any stop request: `train.distributed.agree`). transformers reads one more per
micro-batch when position ids come with it (packed documents, the default):
`masking_utils` asks whether the ids describe packed sequences (`(mask[:, -1] == 0).all()`),
inside the model's forward, which the count names by our frame that called it. The gradient norm, the MoE loads,
imbalance and bias updates stay on the device; they are read when a record is logged. On the CPU
only, the MoE layers' groups are padded to 32 rows for oneDNN (`moe/permutation.py`,
`padded_slots`: the padded length, one read per MoE layer per micro-batch); on CUDA the groups
are not padded and that read is not made.
"""

from __future__ import annotations

from hyperparallel.train import loop, metrics
from hyperparallel.train import step as step_module
from hyperparallel.train.loop import train
from tests.host_reads import HostReads
from tests.train.test_loop import config

MICRO_BATCHES = 2  # global batch 4, micro-batch 2, one rank


def test_a_step_reads_its_loss_and_logging_reads_the_rest(tmp_path, monkeypatch):
    steps, logs = [], []
    take, call = metrics.LogWindow.take, step_module.TrainStep.__call__

    def counted(original, into):
        def wrapper(*args, **kwargs):
            with HostReads() as reads:
                result = original(*args, **kwargs)
            into.append(reads)
            return result
        return wrapper

    monkeypatch.setattr(step_module.TrainStep, "__call__", counted(call, steps))
    monkeypatch.setattr(metrics.LogWindow, "take", counted(take, logs))
    assert loop.train is train
    train(config(tmp_path, "qwen3_moe", training={"steps": 4}, logging={"every": 4}))
    assert len(steps) == 4 and len(logs) == 2  # steps 1 and 4 are logged
    for reads in steps:
        sites = reads.sites()
        assert {op for op, _ in sites} == {"_local_scalar_dense"} and {s.split(":")[0] for _, s in sites} == {
            "train/step.py"}, sites
        assert reads.total() == 1 + MICRO_BATCHES, sites  # the loss; transformers' packed-sequence check
    # a record of a window of 3 steps: the grad norms' mean, and per step its aux loss and its
    # layers' imbalance (`moe.balance.read_figures`)
    sites = {(op, site.split(":")[0]): count for (op, site), count in logs[1].sites().items()}
    assert sites == {("_local_scalar_dense", "train/metrics.py"): 1, ("_local_scalar_dense", "moe/balance.py"): 3,
                     ("tolist", "moe/balance.py"): 3}, sites

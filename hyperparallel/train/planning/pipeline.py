"""What pipeline parallelism (`parallel.pp`) adds to a plan ([Note: how the plan is made],
planner.py): the plan of each pipeline rank is made from its own stages' model (`model.fake_model`
cut as the trainer cuts it) and micro-batch (`timeline.simulate` through its stages); this file
says what the schedule adds on top of one micro-batch, and how the ranks' step times make the
pipeline's.

- Micro-batches in flight: a schedule runs several forwards before their backwards, and each
  keeps what its backward needs. The counts are torch.distributed.pipelining's own schedules':
  1F1B runs `min(n, pp - stage)` forwards first, then one backward before each forward; GPipe
  all `n`; interleaved 1F1B `warmup + 1` chunks (a chunk: one of the rank's stages on one
  micro-batch), its warmup as `_get_warmup_ops` counts it. What one micro-batch keeps is the
  timeline's bytes alive when its backward starts.
- Gradients: a stage's are reduced once, after the schedule's last backward (train/step.py), so
  its whole gradients accumulate from the first backward on and nothing is reduce-scattered in
  backward (`memory.timeline_peak`'s `pipelined`). The first backward has every micro-batch in
  flight and no accumulated gradients yet; the later ones the accumulated gradients and, where
  the step has more micro-batches than the schedule keeps, as many in flight: the peak is the
  larger (`stage_peak`).
- The schedule's buffers: a stage after the first receives each micro-batch's activations and
  its ids, labels and positions into buffers of its own, made once for all the step's
  micro-batches; a stage before the last likewise receives the gradients of what it sent.
- Stage-to-stage traffic: per micro-batch each boundary sends the activations (and the ids,
  labels and positions) forward and their gradient back; a `send` of the `pp` dimension.
- The step: the slowest rank paces the steady state, and the others' work per micro-batch is
  the bubble, each rank's divided by its virtual stages (an interleaved rank's chunks are
  smaller): for equal stages (n + (pp - 1) / v) micro-batches of a rank's time, the
  fill-and-drain formula of Megatron-LM's interleaved schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperparallel.parallel.pipeline import StageLayout
from hyperparallel.train.planning.memory import Group, timeline_peak
from hyperparallel.train.planning.plan_time import Collective
from hyperparallel.train.planning.timeline import Timeline


@dataclass(frozen=True)
class StageWork:
    """One pipeline rank's part of a step, in the plan: its step time as if alone, and its compute
    for one micro-batch (every stage it holds)."""

    step_s: float
    micro_batch_s: float


def in_flight(stages: StageLayout, pp_rank: int, n: int) -> float:
    """The micro-batches whose activations pipeline rank `pp_rank` keeps at once (at its peak),
    in whole micro-batches through all its stages (an interleaved rank's chunks are 1 / v each)."""
    v = stages.per_rank
    if stages.schedule == "gpipe":
        return float(n)
    if stages.schedule == "1f1b":
        return float(min(n, stages.pp - pp_rank))
    rounds = max(1, n // stages.pp)
    warmup = min((v - 1) * (n // rounds) + 2 * (stages.pp - 1 - pp_rank), n * v)  # (torch's _get_warmup_ops)
    return min(warmup + 1, n * v) / v


def stage_peak(timeline: Timeline, groups: list[Group], world: int, n: int, grads_whole: int, copies: int,
               stages: StageLayout, pp_rank: int) -> tuple[int, int, int]:
    """(activations, buffers, their peak with the gradients) of pipeline rank `pp_rank`'s step, as
    `memory.timeline_peak` gives them for one micro-batch, at the first backward and the later ones
    (the module's note)."""
    kept = timeline.kept_for_backward()
    first = in_flight(stages, pp_rank, n)
    best = (0, 0, -1)
    for backward, count in (("first", first), ("later", min(first, n - 1))):
        activations, buffers, peak = timeline_peak(timeline, groups, world, n, grads_whole, copies, pipelined=backward)
        extra = int((count - 1) * kept)
        if peak + extra > best[2]:
            best = (activations + extra, buffers, peak + extra)
    return best


def pipeline_buffers(stages: StageLayout, pp_rank: int, n: int, rows: int, seq: int, hidden: int,
                     element: int) -> int:
    """Bytes of the schedule's receive buffers on pipeline rank `pp_rank`: per micro-batch, the
    activations and the ids, labels and positions (int64) for each of its stages after the first,
    and the gradient of what it sends for each before the last."""
    activations, ids = rows * seq * hidden * element, rows * seq * 8
    total = 0
    for s in stages.stages_of(pp_rank):
        total += n * (activations + 3 * ids) if s > 0 else 0
        total += n * activations if s < stages.stages - 1 else 0
    return total


def stage_sends(stages: StageLayout, pp_rank: int, n: int, rows: int, seq: int, hidden: int, element: int,
                spans_nodes: bool) -> list[Collective]:
    """The sends of pipeline rank `pp_rank` in a step: forward, each stage but the last hands on
    its activations with the ids, labels and positions; backward, each stage but the first the
    gradient of the activations it received."""
    activations, ids = rows * seq * hidden * element, rows * seq * 8
    held = stages.stages_of(pp_rank)
    forward = sum(1 for s in held if s < stages.stages - 1)
    backward = sum(1 for s in held if s > 0)
    out = []
    if forward:
        out.append(Collective("pp_send_activations", "pp", "send", 2, activations + 3 * ids, n * forward, spans_nodes))
    if backward:
        out.append(Collective("pp_send_gradients", "pp", "send", 2, activations, n * backward, spans_nodes))
    return out


def pipeline_step_s(work: list[StageWork], per_rank: int) -> tuple[float, float]:
    """(the step, its bubble) from each pipeline rank's work: the slowest rank's step, and the
    other ranks' micro-batch each once, divided by the virtual stages (the module's note)."""
    slowest = max(range(len(work)), key=lambda r: work[r].step_s)
    bubble = sum(w.micro_batch_s for r, w in enumerate(work) if r != slowest) / per_rank
    return work[slowest].step_s + bubble, bubble

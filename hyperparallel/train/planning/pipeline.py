"""What pipeline parallelism (`parallel.pp`) adds to a plan ([Note: how the plan is made],
planner.py): the plan of each pipeline rank is made from its own stages' model (`model.fake_model`
cut as the trainer cuts it) and micro-batch (`timeline.simulate` through its stages); this file
says what the schedule adds on top of one micro-batch, and how the ranks' step times make the
pipeline's.

- Micro-batches in flight: a schedule runs several forwards before their backwards, and each
  keeps what its backward needs. The order is torch.distributed.pipelining's own schedules'
  (`schedule_order`): 1F1B runs `min(n, pp - stage)` forwards first, then one backward before
  each forward; GPipe all `n` forwards, then the backwards; interleaved 1F1B its warmup's chunks
  (a chunk: one of the rank's stages on one micro-batch; the warmup as `_get_warmup_ops` counts
  it), then a forward and a backward in turn. What a chunk keeps is what its stage's forward
  added in the timeline, alive when backward starts (`Timeline.kept_per_stage`).
- Gradients: a stage's are reduced once, after the schedule's last backward (train/step.py), so
  its whole gradients accumulate from its first backward on and nothing is reduce-scattered in
  backward (`memory.timeline_peak`'s `pipelined`). The peak (`stage_peak`) is the largest over
  the order's backwards, each with the chunks in flight then and the accumulated gradients of
  the stages that ran a backward before it (the first backward: none, with every warmup chunk in
  flight).
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


def schedule_order(stages: StageLayout, pp_rank: int, n: int) -> list[tuple[str, int]]:
    """The forwards ("F") and backwards ("B") pipeline rank `pp_rank` runs in a step, in order, each
    with its stage: torch.distributed.pipelining's schedules' order (1F1B: its warmup's forwards,
    then a backward before each forward, then the rest; GPipe: every forward, then every backward;
    interleaved 1F1B as `_calculate_single_rank_operations` orders its chunks)."""
    held = stages.stages_of(pp_rank)
    if stages.schedule == "gpipe":
        return [("F", held[0])] * n + [("B", held[0])] * n
    if stages.schedule == "1f1b":
        warmup = min(n, stages.pp - pp_rank)
        return ([("F", held[0])] * warmup + [op for _ in range(n - warmup) for op in (("B", held[0]), ("F", held[0]))]
                + [("B", held[0])] * warmup)
    v, pp = stages.per_rank, stages.pp
    per_round = n // max(1, n // pp)
    chunks = n * v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), chunks)
    forward = [("F", held[(k // per_round) % v]) for k in range(chunks)]
    backward = [("B", held[v - 1 - (k // per_round) % v]) for k in range(chunks)]
    steady = [op for k in range(chunks - warmup) for op in (forward[warmup + k], backward[k])]
    return forward[:warmup] + steady + backward[chunks - warmup:]


@dataclass(frozen=True)
class StageCalls:
    """How many times a pipeline rank runs what runs once per micro-batch without a pipeline."""

    root_gathers: int  # FSDP's gathers of the root (`root_gathers`)
    embeddings: int  # input-embedding lookups: every forward of a rank holding the embedding
    losses: int  # the loss: every forward of the last stage


def stage_calls(stages: StageLayout, pp_rank: int, n: int, embedding: bool) -> StageCalls:
    """`embedding`: whether the rank holds the input embedding (the first stage, or the last with a
    tied head), which the model's forward looks up in each of the rank's forwards."""
    order = schedule_order(stages, pp_rank, n)
    forwards = sum(1 for op, _ in order if op == "F")
    last = sum(1 for op, s in order if op == "F" and s == stages.stages - 1)
    return StageCalls(root_gathers(stages, pp_rank, n), forwards if embedding else 0, last)


def root_gathers(stages: StageLayout, pp_rank: int, n: int) -> int:
    """How many times FSDP gathers the root (what a rank holds outside its stages' layers: the
    embedding on the first stage, the norm and head on the last) in a step: in each forward of
    the rank's (the model's forward runs for each), and for backward: on the last stage before
    each of its backwards (the head's values make its input's gradient); on the first, ahead of
    the first layer's backward where a forward has freed the root since the last (an embedding's
    gradient needs no values: fsdp's pipeline transitions)."""
    held = stages.stages_of(pp_rank)
    order = schedule_order(stages, pp_rank, n)
    forwards = sum(1 for op, _ in order if op == "F")
    if stages.stages - 1 in held:
        return forwards + sum(1 for op, s in order if op == "B" and s == stages.stages - 1)
    if 0 not in held:
        return 0
    backwards, freed = 0, True
    for op, s in order:
        if op == "F":
            freed = True
        elif s == 0 and freed:
            backwards, freed = backwards + 1, False
    return forwards + backwards


def stage_peak(timeline: Timeline, groups: list[Group], world: int, n: int, grads_whole: int, copies: int,
               stages: StageLayout, pp_rank: int) -> tuple[int, int, int]:
    """(activations, buffers, their peak with the gradients) of pipeline rank `pp_rank`'s step: at
    each backward of the schedule's order, what the chunks in flight keep beyond the timeline's
    own micro-batch, with the accumulated gradients of the stages that ran a backward before
    (`memory.timeline_peak`'s `pipelined`); the module's note."""
    held = stages.stages_of(pp_rank)
    kept = dict(zip(held, timeline.kept_per_stage(), strict=True))
    whole = sum(kept.values())  # (the timeline's own micro-batch keeps this)
    stage_of_group = [s for s in held for _ in range(*stages.layers[s])]  # (the layers', in order)
    stage_of_group.append(0 if 0 in held else stages.stages - 1)  # the root: the embedding's, or the head's
    alive, done, worst = 0, set(), {}  # (the most in flight at a backward, by the stages done before it)
    for op, stage in schedule_order(stages, pp_rank, n):
        if op == "F":
            alive += kept[stage]
            continue
        key = frozenset(done)
        worst[key] = max(worst.get(key, 0), alive)
        alive -= kept[stage]
        done.add(stage)
    best = (0, 0, -1)
    for key, in_flight in worst.items():
        accumulated = frozenset(g for g, s in enumerate(stage_of_group) if s in key)
        activations, buffers, peak = timeline_peak(timeline, groups, world, n, grads_whole, copies,
                                                   pipelined=accumulated)
        extra = max(in_flight - whole, 0)
        if peak + extra > best[2]:
            best = (activations + extra, buffers, peak + extra)
    return best


def _travelling_bytes(rows: int, seq: int, cp: bool) -> int:
    """A micro-batch's ids, labels and positions (int64), and with context parallelism its counted
    tokens (float32, a row each): what travels along the pipeline with the activations."""
    return 3 * rows * seq * 8 + (rows * 4 if cp else 0)


def pipeline_buffers(stages: StageLayout, pp_rank: int, n: int, rows: int, seq: int, hidden: int,
                     element: int, cp: bool = False) -> int:
    """Bytes of the schedule's receive buffers on pipeline rank `pp_rank`: per micro-batch, the
    activations and what travels with them for each of its stages after the first, and the
    gradient of what it sends for each before the last."""
    activations, travelling = rows * seq * hidden * element, _travelling_bytes(rows, seq, cp)
    total = 0
    for s in stages.stages_of(pp_rank):
        total += n * (activations + travelling) if s > 0 else 0
        total += n * activations if s < stages.stages - 1 else 0
    return total


def stage_sends(stages: StageLayout, pp_rank: int, n: int, rows: int, seq: int, hidden: int, element: int,
                spans_nodes: bool, cp: bool = False) -> list[Collective]:
    """The sends of pipeline rank `pp_rank` in a step: forward, each stage but the last hands on
    its activations with what travels with them; backward, each stage but the first the gradient
    of the activations it received."""
    activations, travelling = rows * seq * hidden * element, _travelling_bytes(rows, seq, cp)
    held = stages.stages_of(pp_rank)
    forward = sum(1 for s in held if s < stages.stages - 1)
    backward = sum(1 for s in held if s > 0)
    out = []
    if forward:
        out.append(Collective("pp_send_activations", "pp", "send", 2, activations + travelling, n * forward,
                              spans_nodes))
    if backward:
        out.append(Collective("pp_send_gradients", "pp", "send", 2, activations, n * backward, spans_nodes))
    return out


def pipeline_step_s(work: list[StageWork], per_rank: int) -> tuple[float, float]:
    """(the step, its bubble) from each pipeline rank's work: the slowest rank's step, and the
    other ranks' micro-batch each once, divided by the virtual stages (the module's note)."""
    slowest = max(range(len(work)), key=lambda r: work[r].step_s)
    bubble = sum(w.micro_batch_s for r, w in enumerate(work) if r != slowest) / per_rank
    return work[slowest].step_s + bubble, bubble

"""What `hyperparallel plan` prints: a plan as a small table (`format_plan`), its predicted step
time (`format_time`), and the end of a run's summary, its measured peak beside the plan's total
(`memory_summary`).
"""

from __future__ import annotations

from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.communication import COMM_FORMULA
from hyperparallel.train.planning.plan_time import StepTime
from hyperparallel.train.planning.planner import Plan, plan_total_bytes

GiB = 2**30


def memory_summary(cfg: TrainConfig, world: int, runtime: int, records: list[dict]) -> str:
    """The end of a run's summary: its measured peak beside the plan's total. (A plan that cannot
    be made, for a reason of its own, is named instead: it never fails a finished run.)"""
    measured = max((r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r), default=0)
    try:
        planned = f"{plan_total_bytes(cfg, world, runtime=runtime) / 2**30:.2f} GiB"
    except Exception as error:  # noqa: BLE001  (the run is done; the plan is only a comparison)
        planned = f"unavailable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return f"peak memory {measured / 2**30:.2f} GiB per rank, planned {planned} (hyperparallel plan)"


def format_time(t: StepTime) -> list[str]:
    """The predicted step time's lines."""
    exposed = ", ".join(f"{dim} {seconds * 1e3:,.1f} ms" for dim, seconds in t.exposed_comm_s.items() if seconds)
    own = ", ".join(f"{dim} {seconds * 1e3:,.1f} ms" for dim, seconds in t.comm_s.items() if seconds)
    bubble = f" + pipeline bubble {t.bubble_s:,.3f} s" if t.bubble_s else ""
    return [
        f"predicted step on {t.device}: {t.predicted_step_s:,.3f} s = compute {t.compute_s:,.3f} s + exposed "
        f"communication {sum(t.exposed_comm_s.values()):,.3f} s ({exposed or 'none'}) + optimizer "
        f"{t.optimizer_s:,.3f} s{bubble}; {t.tokens_per_s:,.0f} tokens/s, MFU {100 * t.mfu:.1f}%",
        f"  communication's own time: {own or 'none'}; a prediction from the device model "
        f"({t.device_source}), not a measurement: docs/train.md, \"Planning\"",
    ]


def format_pipeline(pipeline: dict) -> list[str]:
    """The lines on a pipeline's stages: each pipeline rank's layers and total."""
    stages, totals = pipeline["stages"], pipeline["totals"]
    if len(totals) == 1:  # (a screened first stage: every stage taken as it)
        return [f"pipeline ({pipeline['schedule']}): planned as its first stage, layers {stages[0][0]}-{stages[0][1] - 1}"]
    per_rank = len(stages) // len(totals)
    held = [", ".join(f"{stages[s][0]}-{stages[s][1] - 1}" for s in range(r, len(stages), len(totals)))
            for r in range(len(totals))]
    ranks = "; ".join(f"{r}: layers {held[r]}, {totals[r] / GiB:.3f} GiB" for r in range(len(totals)))
    return [f"pipeline ({pipeline['schedule']}, {per_rank} stage(s) a rank), figures of pipeline rank "
            f"{pipeline['pp_rank']}; by pipeline rank: {ranks}"]


def format_plan(p: Plan) -> str:
    """A small table of the plan."""
    buffers = "FSDP unsharded blocks and buffers" if p.layout.startswith("sharded") else "DDP gradient buckets"
    rows = [
        ("parameters", p.params),
        ("gradients", p.grads),
        ("optimizer state", p.optimizer),
        (f"activations (one micro-batch of {p.micro_batch} x {p.seq_len})", p.activations),
        (buffers, p.buffers),
        ("the model's build (its shards, plus one module whole)", p.build),
        ("tensors at the peak (the parts peak at different times)", p.tensors),
    ]
    if p.device == "cpu":
        rows.append(("runtime (measured: resident memory after imports)", p.runtime))
    rows.append(("total", p.total))
    width = max(len(name) for name, _ in rows)
    lines = [
        f"plan: {p.family}, {p.n_params / 1e6:.1f}M parameters, {p.world} rank(s) {p.layout}, on {p.device}; "
        f"grad accumulation {p.accumulation}, recompute {p.recompute}, mixed precision {p.mixed_precision}, fused "
        f"loss {'on' if p.fused_loss else 'off'}, compile {p.compile}, {p.optimizer_name}",
        f"{'per rank (rank ' + str(p.rank) + ')':<{width}}  {'bytes':>15}  {'GiB':>8}",
    ]
    for name, value in rows:
        lines.append(f"{name:<{width}}  {value:>15,}  {value / GiB:>8.3f}")
    if p.pipeline:
        lines.extend(format_pipeline(p.pipeline))
    if p.comm:
        parts = ", ".join(f"{key} {value / 2**20:,.1f} MiB" for key, value in p.comm.items())
        who = f"pipeline rank {p.pipeline['comm_pp_rank']}" if "comm_pp_rank" in p.pipeline else f"rank {p.rank}"
        lines.append(f"sent per step by {who}: {p.comm_bytes_per_step / 2**20:,.1f} MiB ({parts})")
        dims = ", ".join(f"{key} {value / 2**20:,.1f} MiB" for key, value in p.comm_by_dimension.items())
        lines.append(f"  by mesh dimension: {dims}")
        lines.append(f"  ({COMM_FORMULA})")
    else:
        lines.append("sent per step: nothing (one rank)")
    if p.time is not None:
        lines.extend(format_time(p.time))
    if p.unaccounted:
        lines.append("not accounted: " + "; ".join(p.unaccounted))
    return "\n".join(lines)

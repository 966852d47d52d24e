"""What a run prints: the setup phases, the run summary (the model, the data, the layout that
runs, MFU's yardstick), the step and validation lines, and the progress bar of the steps.

Rank 0 prints; the other ranks print nothing. In a terminal the lines fit its width: a step line
wider than the terminal is printed in a compact form (80 columns hold it), and the bar starts
with the first step, after the setup's lines have said what the setup was doing. A file or a pipe
gets every line whole and no bar.
"""

from __future__ import annotations

import os
import sys

from hyperparallel.kernels import native
from hyperparallel.parallel.mesh import MeshShape, describe_groups
from hyperparallel.parallel.tensor_parallel import tensor_parallel_state
from hyperparallel.train import data, preflight
from hyperparallel.train.config import ParallelSection, TrainConfig
from hyperparallel.train.peak_flops import Peak


def describe_layout(p: ParallelSection, shape: MeshShape, waves: int | None = None) -> str:
    """The ranks as they run: `1 rank`; `N ranks, replicated (DDP)`; or the mesh's dimensions above
    1 (pp x dp_replicate x dp_shard x cp x tp, ep borrowed from dp_shard x cp), with FSDP's geometry only
    where it shards over more than one rank (its group is dp_shard x cp: tp alone shards nothing)."""
    world = shape.world
    if world == 1:
        return "1 rank"
    if shape.ddp:
        return f"{world} ranks, replicated (DDP)"
    stages = ""
    if shape.pp_enabled:
        per_rank = f", {p.pp_virtual_stages} stages a rank" if p.pp_virtual_stages > 1 else ""
        stages = f"pp {shape.pp} ({p.pp_schedule}{per_rank})"
    dims = [stages, f"dp_replicate {shape.dp_replicate} (HSDP)" if shape.hsdp_enabled else "",
            f"dp_shard {shape.dp_shard}" if shape.dp_shard > 1 else "",
            f"cp {shape.cp} ({p.cp_mode} attention)" if shape.cp_enabled else "",
            f"tp {shape.tp}" + (" (sequence parallel)" if p.sequence_parallel else "") if shape.tp_enabled else ""]
    text = f"{world} ranks: " + " x ".join(d for d in dims if d)
    if shape.ep_enabled:
        text += f", ep {shape.ep}" + (f" (MegaMoE, {waves} waves)" if waves else "")
    if shape.shard_size > 1:
        text += f"; FSDP over {shape.shard_size} ranks ({p.shard_geometry}, align {p.align})"
    return text


def _validation(cfg: TrainConfig, dataset) -> str:
    if dataset.validation is None:
        return "validation: none (data.validation)"
    steps = cfg.training.eval_every
    every = "every step and " if steps == 1 else f"every {steps} steps and " if steps else ""
    return f"validation: {len(dataset.validation):,} sequences held out, evaluated {every}at the end"


def announce(console: Console, cfg: TrainConfig, built, dataset, accumulation: int, peak: Peak) -> None:
    """The run summary: what trains, on what, how (`built`: train.build's BuiltModel)."""
    p = cfg.parallel
    console.print(f"{cfg.model.family}: {built.n_params / 1e6:.1f}M parameters, {dataset.num_tokens:,} corpus tokens, "
                  f"{len(dataset.train):,} sequences of {cfg.data.seq_len}")
    console.print(_validation(cfg, dataset))
    console.print("layout: " + describe_layout(p, built.mesh.shape, waves=built.waves))
    if built.pipeline is not None:
        bounds = built.pipeline.layout.layers
        console.print("pipeline stages (decoder layers): " + " | ".join(
            f"{start}" if stop - start == 1 else f"{start}-{stop - 1}" for start, stop in bounds))
    console.print(f"grad accumulation {accumulation}, recompute {p.recompute}, mixed precision "
                  f"{cfg.training.mixed_precision}, compile {cfg.training.compile}")
    console.print(f"MFU against {peak.tflops:.3g} TFLOP/s: {peak.source}")
    # HSDP's groups; shard groups that span machines (torchrun's ranks per machine)
    for line in describe_groups(built.mesh.shape, int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None):
        console.print(line)
    console.print(data.describe(dataset, cfg.data, preflight.document_mask(cfg)[1]))
    tp_state = tensor_parallel_state(built.model)
    if tp_state is not None:  # the plan, by placement: "q_proj, ...: column-parallel over heads; ..."
        by_placement: dict[str, set[str]] = {}
        for module, placement in tp_state.plan:
            by_placement.setdefault(placement, set()).add(module.rsplit(".", 1)[-1])
        console.print("tensor parallel: " + "; ".join(f"{', '.join(sorted(names))}: {placement}"
                                                     for placement, names in by_placement.items()))
    if built.conversion_summary:
        console.print(built.conversion_summary)
    if built.kernels:  # (none for a model without routers or hyper-connections)
        console.print(built.kernels)
    if missing := native.not_built():
        console.print(f"the native CPU kernels are not built ({', '.join(m.split('.')[-1] for m in missing)}; "
                      "no C compiler where this was installed): the portable torch paths run instead")
    if built.balancer is not None:
        b = built.balancer
        how = {"aux_loss": f"auxiliary loss x {b.aux_loss_coef:g}", "bias": f"correction bias, rate {b.bias_update_rate:g}",
               "none": "none"}[b.mode]
        console.print(f"MoE: {len(b.layers)} layers, load balancing {how}")


# ------------------------------------------------------------------------------- step lines


def _rate(x: float) -> str:
    """Tokens/s in at most 5 characters: 812, 9,876 -> 9.88k, 1.23M."""
    if x < 1e4:
        return f"{x:,.0f}"
    if x < 1e6:
        return f"{x / 1e3:.3g}k"
    return f"{x / 1e6:.3g}M"


def _percent(fraction: float) -> str:
    """MFU: whole percents, and two digits below 10% (a CPU's 0.4% is not 0%)."""
    percent = fraction * 100
    return f"{percent:.0f}%" if percent >= 9.95 else f"{percent:.2g}%"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}ms" if seconds < 10 else f"{seconds:.3g}s" if seconds < 1000 else f"{seconds:.0f}s"


def step_line(step: int, record: dict, *, width: int | None = None, total_steps: int = 0) -> str:
    """A logged step's line: whole (for files, pipes and wide terminals), or compact when it would
    not fit `width` columns: the step padded to the run's last step, shorter labels and units, and
    no lr (metrics.jsonl has every step's): 80 columns hold it at any size of run."""
    wide = (f"step {step:>6}  loss {record['loss']:.4f}  lr {record['lr']:.1e}  gnorm {record['grad_norm']:.2f}  "
            f"{record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1e3:.0f} ms  "
            f"mfu {record['mfu'] * 100:.0f}%  {record['peak_mem_bytes'] / 2**30:.2f} GiB")
    if "moe_imbalance" in record:
        wide += f"  moe imbalance {record['moe_imbalance']:.2f}"
    if width is None or len(wide) <= width:
        return wide
    compact = (f"step {step:>{len(str(total_steps))}} loss {record['loss']:.4f} gn {record['grad_norm']:.3g} {_rate(record['tokens_per_s'])} tok/s {_duration(record['step_time_s'])} "
               f"mfu {_percent(record['mfu'])} {record['peak_mem_bytes'] / 2**30:.3g}GiB")
    if "moe_imbalance" in record:
        compact += f" imb {record['moe_imbalance']:.2f}"
    return compact


def validation_line(step: int, record: dict, *, width: int | None = None, total_steps: int = 0) -> str:
    wide = (f"step {step:>6}  validation loss {record['val_loss']:.4f}  perplexity {record['val_perplexity']:.2f}  "
            f"({record['val_tokens']:,} tokens)")
    if width is None or len(wide) <= width:
        return wide
    return (f"step {step:>{len(str(total_steps))}} val loss {record['val_loss']:.4f} "
            f"ppl {record['val_perplexity']:.4g} ({record['val_tokens']:,} tokens)")


# --------------------------------------------------------------------------------- the console


class Console:
    """Rank 0's console (`enabled`): lines, and in a terminal with `progress` the bar of the steps."""

    def __init__(self, *, enabled: bool, progress: bool):
        self.enabled, self.progress = enabled, progress
        self.rich = None
        self.bar = None
        self.total_steps = 0
        if enabled:
            from rich.console import Console as RichConsole

            self.rich = RichConsole(file=sys.stdout)

    @property
    def width(self) -> int | None:
        """The terminal's columns; None for a file or a pipe (whose lines are never cut)."""
        return self.rich.width if self.rich is not None and self.rich.is_terminal else None

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self.width is not None:  # (above the bar, wrapped at words)
            self.rich.print(message, markup=False)
        else:
            print(message, flush=True)

    def phase(self, doing: str) -> None:
        """A setup phase, said before it runs: `building the model ...`."""
        self.print(f"{doing} ...")

    def start_steps(self, total: int, done: int, doing: str = "") -> None:
        """The bar of the steps (in a terminal, with logging.progress), from `done` of `total`."""
        self.total_steps = total
        if not self.enabled or not self.progress or self.width is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # "train " + bar + " 150/150 0:00:00 " + "loss 12.3456": the bar takes what 80 columns leave
        bar_width = max(10, min(40, self.width - 2 * len(str(total)) - 36))
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(bar_width=bar_width), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("{task.description}"), console=self.rich,
                            transient=False)
        self.task = self.bar.add_task(doing, total=total, completed=done)
        self.bar.start()

    def step(self, step: int, record: dict | None) -> None:
        """Step `step` done; `record` (a logged step's) printed as a line and its loss on the bar."""
        if not self.enabled:
            return
        if record is not None:
            self.print(step_line(step, record, width=self.width, total_steps=self.total_steps))
        if self.bar is not None:
            described = {"description": f"loss {record['loss']:.4f}"} if record is not None else {}
            self.bar.update(self.task, completed=step, **described)

    def evaluation(self, step: int, record: dict) -> None:
        self.print(validation_line(step, record, width=self.width, total_steps=self.total_steps))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# ----------------------------------------------------------------------------- setup phases


def data_phase(cfg: TrainConfig) -> str:
    return f"preparing the data (token shards in {data.cache_root(cfg.data, cfg.logging.run_dir)})"


def model_phase(cfg: TrainConfig, resume_from) -> str:
    weights = ("its weights from the checkpoint" if resume_from is not None else
               f"loading its weights from model.path {cfg.model.path}" if cfg.model.path is not None else
               "its weights from the seeded init")
    return f"building the model ({cfg.model.family}, {weights})"


def compile_phase(cfg: TrainConfig, first_step: int) -> str | None:
    if cfg.training.compile == "none":
        return None
    return f"compiling the decoder layers ({cfg.training.compile}) in step {first_step + 1}"


def describe_traffic(comm: dict) -> str:
    """The first step's bytes sent through collectives (the busiest rank's), by mesh dimension and kind."""
    parts = ", ".join(f"{key} {nbytes / 2**20:.2f}" for key, nbytes in comm["by_dimension_and_kind"].items())
    return (f"sent per step by rank {comm['rank']}: {comm['total'] / 2**20:.2f} MiB"
            + (f" ({parts} MiB)" if parts else ""))

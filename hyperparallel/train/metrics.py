"""What a run records: metrics.jsonl, TensorBoard events, a W&B run (`train.wandb_log`) and
loss.png (rank 0 only), with each record's line on the console (`train.console`), and the peak
memory figures.

metrics.jsonl holds one JSON object per logged step with at least
``step, loss, lr, grad_norm, tokens_per_s, step_time_s, peak_mem_bytes`` (plus ``tflops``,
``mfu``, ``lrs`` and ``window``; for MoE models ``moe_imbalance``, the most tokens an expert got
over the mean per expert, the largest over the MoE layers, ``moe_imbalance_per_layer``, and with
the auxiliary loss on ``aux_loss``, its mean over the layers before the coefficient), and one per
evaluation with ``step, val_loss, val_perplexity, val_tokens``; each start of the trainer first writes
one for the model's build, ``step, build_peak_mem_bytes, build_grown_mem_bytes,
build_host_peak_mem_bytes, build_s, weights_from`` (the largest rank's peak memory, the device's
on GPUs and otherwise the host's, its rise while building, and the host's peak in any case).
A logged step's figures are means over the steps since the previous log (its ``window``), as
the Hugging Face Trainer logs them; ``lrs`` is the learning rate of each of those steps. Only
rank 0 writes; step times are the slowest rank's.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hyperparallel.train.plot import draw_loss

if TYPE_CHECKING:
    from hyperparallel.train.console import Console


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # the process's peak resident set: on CPU that is what the run really used. VmHWM, not
    # ru_maxrss: a process started straight from a larger one (the launcher, pytest) reports
    # that one's peak as its own ru_maxrss until it passes it
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LogWindow:
    """The steps since the last log, summed, for the window means of the next record."""

    def __init__(self):
        self.losses: list[float] = []
        self.grad_norms: list[torch.Tensor] = []  # device tensors, read at take(): no host read per step
        self.lrs: list[float] = []
        self.moe: list[dict] = []
        self.seconds = 0.0

    def add(self, loss: float, grad_norm: torch.Tensor, lr: float, step_time_s: float, moe: dict | None = None) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.lrs.append(lr)
        self.seconds += step_time_s
        if moe:
            self.moe.append(moe)

    def _moe_means(self) -> dict:
        from hyperparallel.moe.balance import read_figures

        figures = [read_figures(m) for m in self.moe]
        means = {}
        for key in ("moe_imbalance", "aux_loss"):
            values = [m[key] for m in figures if key in m]
            if values:
                means[key] = sum(values) / len(values)
        layers = [m["moe_imbalance_per_layer"] for m in figures if "moe_imbalance_per_layer" in m]
        if layers:
            means["moe_imbalance_per_layer"] = [round(sum(v) / len(v), 4) for v in zip(*layers, strict=True)]
        return means

    def take(self, step: int, *, tokens_per_step: int, flops_per_step: float, world: int, peak_tflops: float,
             peak_mem_bytes: int) -> dict:
        """The record of `step` (means over the window), and an empty window after it."""
        n = len(self.losses)
        step_time = self.seconds / n
        tflops = flops_per_step / step_time / 1e12 / world
        record = {
            "step": step, "loss": sum(self.losses) / n, "lr": self.lrs[-1], "grad_norm": torch.stack(self.grad_norms).double().mean().item(),
            "tokens_per_s": tokens_per_step * n / self.seconds, "step_time_s": step_time, "tflops": tflops,
            "mfu": tflops / peak_tflops, "peak_mem_bytes": peak_mem_bytes, "window": n, "lrs": list(self.lrs),
            **self._moe_means(),
        }
        self.__init__()
        return record


def scalars(record: dict) -> dict[str, float]:
    """A record's figures as TensorBoard and W&B plot them: every number but the step and window,
    and each MoE layer's imbalance as its own (moe_imbalance/layer_N)."""
    out = {key: value for key, value in record.items()
           if key not in ("step", "window") and isinstance(value, (int, float)) and not isinstance(value, bool)}
    for layer, value in enumerate(record.get("moe_imbalance_per_layer", ())):
        out[f"moe_imbalance/layer_{layer}"] = value
    return out


class MetricsLog:
    """metrics.jsonl, TensorBoard, W&B and the console of rank 0 (other ranks write nothing).
    `wandb`: logging.wandb (a WandbSection), with `config` the resolved config it records."""

    def __init__(self, run_dir: Path, console: Console, *, tensorboard: bool, first_step: int, wandb=None,
                 config: dict | None = None):
        self.console = console
        self.enabled = console.enabled
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.records: list[dict] = []
        self.writer = None
        self.wandb = None
        if not self.enabled:
            return
        self._keep_up_to(first_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step + 1)
        if wandb is not None and wandb.enabled():
            from hyperparallel.train.wandb_log import WandbRun

            self.wandb = WandbRun(wandb, run_dir, config or {})

    def _keep_up_to(self, step: int) -> None:
        """A resumed run continues the file: records past the checkpoint's step are dropped."""
        if not self.path.is_file():
            return
        kept = [r for r in map(json.loads, self.path.read_text().splitlines()) if r["step"] <= step]
        self.records = kept
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def print(self, message: str) -> None:
        self.console.print(message)

    def _write(self, step: int, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        figures = scalars(record)
        if self.writer is not None:
            for key, value in figures.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(step, figures)

    def step(self, step: int, record: dict | None) -> None:
        """Advance the bar to `step`; `record` (a logged step) goes to every sink."""
        if not self.enabled:
            return
        if record is not None:
            self._write(step, record)
        self.console.step(step, record)

    def build(self, step: int, memory, device: torch.device) -> None:
        """The model build's record (`build_peak_mem_bytes`: the largest rank's peak; `build_s`)
        and its line in the run summary; `memory` is train.build's BuildMemory."""
        if not self.enabled:
            return
        self._write(step, {"step": step, "build_peak_mem_bytes": memory.peak_bytes,
                           "build_grown_mem_bytes": memory.grown_bytes, "build_host_peak_mem_bytes":
                           memory.host_peak_bytes, "build_s": round(memory.seconds, 3),
                           "weights_from": memory.weights_from})
        self.print(memory.describe(device))

    def evaluation(self, step: int, record: dict) -> None:
        """A validation loss (`val_loss`, `val_perplexity`, `val_tokens`) after `step`."""
        if not self.enabled:
            return
        self._write(step, {"step": step, **record})
        self.console.evaluation(step, record)

    def close(self) -> None:
        if not self.enabled:
            return
        self.console.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.records:
            draw_loss(self.records, self.run_dir / "loss.png")

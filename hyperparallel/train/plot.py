"""loss.png from metrics.jsonl (`hyperparallel plot RUN_DIR`, and at the end of every run)."""

from __future__ import annotations

import json
from pathlib import Path

from hyperparallel.errors import ConfigError


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} holds no metrics.jsonl: is it a run directory?")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON lines ({error})") from None


def draw_loss(records: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1))
    logged = [r for r in records if "loss" in r]
    evaluated = [r for r in records if "val_loss" in r]
    loss_ax.plot([r["step"] for r in logged], [r["loss"] for r in logged], color="tab:blue", marker=".",
                 label="training (mean since the previous point)")
    if evaluated:
        loss_ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], color="tab:green",
                     marker="o", label="validation")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    lr_ax.plot(*_lr_per_step(logged), color="tab:orange")
    lr_ax.set_ylabel("lr")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out


def _lr_per_step(records: list[dict]) -> tuple[list[int], list[float]]:
    """Every step's lr: each record holds those of its window (`lrs`; older runs: its own only)."""
    steps, lrs = [], []
    for r in records:
        window = r.get("lrs") or [r["lr"]]
        steps += range(r["step"] - len(window) + 1, r["step"] + 1)
        lrs += window
    return steps, lrs


def plot_run(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ConfigError(f"{run_dir}/metrics.jsonl is empty: nothing to plot")
    return draw_loss(records, run_dir / "loss.png")

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
    steps = [r["step"] for r in records]
    loss_ax.plot(steps, [r["loss"] for r in records], color="tab:blue")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    lr_ax.plot(steps, [r["lr"] for r in records], color="tab:orange")
    lr_ax.set_ylabel("lr")
    lr_ax.set_xlabel("step")
    lr_ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out


def plot_run(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ConfigError(f"{run_dir}/metrics.jsonl is empty: nothing to plot")
    return draw_loss(records, run_dir / "loss.png")

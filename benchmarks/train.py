"""Training throughput: `hyperparallel train` vs the Hugging Face Trainer, side by side.

    python benchmarks/train.py                      # configs/default.yaml, 16 steps per round
    python benchmarks/train.py --steps 8 --rounds 1 # quicker

Both train the same model (the same family, inline config and seeded weights), on the same
packed sequences, with the same micro-batch, gradient accumulation, AdamW settings, cosine
schedule and clipping, in fp32, in this one process. The Trainer runs as a user gets it: its
default fused AdamW and transformers' default experts implementation ("grouped_mm" since
transformers 5; also timed with "eager", the per-expert loop that earlier versions ran). Rounds
alternate the contenders so that drift of the machine falls on all; the first steps of each
round are warm-up and not counted. Prints a table and writes JSON (--json PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hyperparallel.models import build_model
from hyperparallel.train import data
from hyperparallel.train.config import load_config
from hyperparallel.train.loop import inline_model_config, train


def ours(cfg, steps: int, workdir: Path) -> tuple[list[float], list[float]]:
    run = cfg.model_copy(deep=True)
    run.training.steps = steps
    run.scheduler.warmup_steps = min(run.scheduler.warmup_steps, steps)
    run.logging.run_dir = str(workdir / f"ours-{time.monotonic_ns()}")
    run.logging.every = 1
    run.logging.progress = False
    run.checkpoint.every = 0
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the table is the output here
        summary = train(run, stop_after=steps)
    return [r["step_time_s"] for r in summary["records"]], [r["loss"] for r in summary["records"]]


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        return {"input_ids": self.sequences[i], "labels": self.sequences[i]}


def hf_trainer(cfg, dataset, steps: int, workdir: Path, experts: str | None) -> tuple[list[float], list[float]]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    model = build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, dataset.tokenizer.vocab_size),
                        dtype=torch.float32, attn_implementation=cfg.model.attn_implementation,
                        seed=cfg.training.seed, grouped_experts=False)
    if experts is not None:
        model.set_experts_implementation(experts)
    times, losses, started = [], [], [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - started[0])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    t, o, s = cfg.training, cfg.optimizer, cfg.scheduler
    args = TrainingArguments(
        output_dir=str(workdir / "hf"), per_device_train_batch_size=t.micro_batch,
        gradient_accumulation_steps=cfg.grad_accumulation(1), max_steps=steps, learning_rate=o.lr,
        weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        lr_scheduler_type="cosine", warmup_steps=min(s.warmup_steps, steps), max_grad_norm=t.max_grad_norm or 0.0,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0, seed=t.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_Sequences(dataset.sequences), callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    trainer.train()
    return times, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a trainer YAML (default: configs/default.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per round and trainer")
    parser.add_argument("--warmup", type=int, default=3, help="steps of each round left out of the timing")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    dataset = data.prepare(cfg.data)
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    contenders = {
        "hyperparallel": lambda tmp: ours(cfg, args.steps, tmp),
        "HF Trainer": lambda tmp: hf_trainer(cfg, dataset, args.steps, tmp, None),
    }
    if "moe" in cfg.model.family or cfg.model.family in ("deepseek_v3", "kimi_k2"):
        contenders["HF Trainer, eager experts"] = lambda tmp: hf_trainer(cfg, dataset, args.steps, tmp, "eager")
    results = {name: ([], []) for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                times, losses = fn(Path(tmp))
                results[name][0].extend(times[args.warmup:])
                results[name][1].append(losses)
    rows = []
    for name, (times, losses) in results.items():
        step = statistics.median(times)
        rows.append({"trainer": name, "step_ms": step * 1e3, "tokens_per_s": tokens_per_step / step,
                     "first_loss": losses[0][0], "last_loss": losses[0][-1]})
    print(f"Training throughput, {cfg.model.family} (1 process, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads): global batch {cfg.training.global_batch} x seq {cfg.data.seq_len}, "
          f"micro-batch {cfg.training.micro_batch}, {args.rounds} rounds of {args.steps} steps "
          f"({args.warmup} warm-up each)")
    print(f"| {'trainer':<25} | {'ms/step':>8} | {'tokens/s':>9} | {'loss (round 1)':<16} | {'hyperparallel is':>16} |")
    print(f"|{'-' * 27}|{'-' * 10}|{'-' * 11}|{'-' * 18}|{'-' * 18}|")
    ours_rate = rows[0]["tokens_per_s"]
    for r in rows:
        loss = f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"
        ratio = "" if r is rows[0] else f"{ours_rate / r['tokens_per_s']:.2f}x faster"
        r["hyperparallel_speedup"] = ours_rate / r["tokens_per_s"]
        print(f"| {r['trainer']:<25} | {r['step_ms']:>8.1f} | {r['tokens_per_s']:>9,.0f} | {loss:<16} | {ratio:>16} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput: `hyperparallel train` vs the Hugging Face Trainer, side by side.

    python benchmarks/train.py                      # configs/default.yaml, fp32 and bf16, 16 steps per round
    python benchmarks/train.py --steps 8 --rounds 1 # quicker

Both train the same model (the same family, inline config and seeded weights), on the same
packed sequences, with the same micro-batch, gradient accumulation, AdamW settings, cosine
schedule and clipping, in this one process, at the same precision:
- fp32: everything in float32 (the Trainer's default);
- bf16: float32 parameters, gradients and optimizer state, forward under bf16 autocast (the
  Trainer's `bf16=True`; ours `training.mixed_precision: bf16`).
hyperparallel runs as its config says (configs/default.yaml: fused loss, Inductor per decoder
layer), and again with each other `training.compile` setting (--ours-compile). The Trainer runs as a user gets it: its default fused AdamW and transformers' default
experts implementation ("grouped_mm" since transformers 5); it is also timed with its own
`torch_compile=True`, and with "eager" experts (the per-expert loop of earlier versions). Each
row's ratio is against hyperparallel at the same precision. Rounds alternate the contenders so
that drift of the machine falls on all; the first steps of each round (compilation included)
are warm-up and not counted. Prints a table and writes JSON (--json PATH).
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


def ours(cfg, steps: int, workdir: Path, precision: str, compile: str | None = None) -> tuple[list[float], list[float]]:
    run = cfg.model_copy(deep=True)
    run.training.steps = steps
    run.training.mixed_precision = "bf16" if precision == "bf16" else "none"
    if compile is not None:
        run.training.compile = compile
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


def hf_trainer(cfg, dataset, steps: int, workdir: Path, precision: str, experts: str | None = None,
               compile: bool = False) -> tuple[list[float], list[float]]:
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
        dataloader_num_workers=0, seed=t.seed, disable_tqdm=True, bf16=precision == "bf16", torch_compile=compile,
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
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both (comma-separated)")
    parser.add_argument("--ours-compile", default="none,dvm",
                        help="also time hyperparallel with these training.compile settings (comma-separated; '' for none)")
    parser.add_argument("--no-hf-compile", dest="hf_compile", action="store_false",
                        help="leave out the HF Trainer with torch_compile=True")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    dataset = data.prepare(cfg.data)
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    contenders = {}
    moe = "moe" in cfg.model.family or cfg.model.family in ("deepseek_v3", "kimi_k2")
    for precision in args.precision.split(","):
        contenders[(precision, "hyperparallel")] = lambda tmp, p=precision: ours(cfg, args.steps, tmp, p)
        for other in args.ours_compile.split(",") if args.ours_compile else ():
            if other != cfg.training.compile:
                contenders[(precision, f"hyperparallel, compile {other}")] = \
                    lambda tmp, p=precision, c=other: ours(cfg, args.steps, tmp, p, c)
        contenders[(precision, "HF Trainer")] = lambda tmp, p=precision: hf_trainer(cfg, dataset, args.steps, tmp, p)
        if args.hf_compile:
            contenders[(precision, "HF Trainer, torch_compile")] = \
                lambda tmp, p=precision: hf_trainer(cfg, dataset, args.steps, tmp, p, compile=True)
        if moe and precision == "fp32":
            contenders[(precision, "HF Trainer, eager experts")] = \
                lambda tmp, p=precision: hf_trainer(cfg, dataset, args.steps, tmp, p, experts="eager")
    results = {name: ([], [], None) for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, fn in contenders.items():
                if results[name][2] is not None:
                    continue
                try:
                    times, losses = fn(Path(tmp))
                except Exception as error:  # a contender that cannot run here is reported, not hidden
                    results[name] = ([], [], f"{type(error).__name__}: {str(error).splitlines()[0][:80]}")
                    continue
                results[name][0].extend(times[args.warmup:])
                results[name][1].append(losses)
    rows = []
    for (precision, name), (times, losses, failed) in results.items():
        if failed:
            rows.append({"precision": precision, "trainer": name, "failed": failed})
            continue
        step = statistics.median(times)
        # the loss of one step is noisy (bf16 especially): the last 4 steps' mean says where a run got to
        rows.append({"precision": precision, "trainer": name, "step_ms": step * 1e3, "tokens_per_s": tokens_per_step / step,
                     "first_loss": losses[0][0], "last_loss": statistics.mean(losses[0][-4:])})
    print(f"Training throughput, {cfg.model.family} (1 process, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads): global batch {cfg.training.global_batch} x seq {cfg.data.seq_len}, "
          f"micro-batch {cfg.training.micro_batch}, {args.rounds} rounds of {args.steps} steps "
          f"({args.warmup} warm-up each); hyperparallel: compile {cfg.training.compile}, "
          f"fused loss {'on' if cfg.training.fused_loss else 'off'}")
    print(f"| {'precision':<9} | {'trainer':<30} | {'ms/step':>8} | {'tokens/s':>9} | {'loss: 1st -> last 4':<19} | "
          f"{'hyperparallel is':>16} |")
    print(f"|{'-' * 11}|{'-' * 32}|{'-' * 10}|{'-' * 11}|{'-' * 21}|{'-' * 18}|")
    ours_rate = {r["precision"]: r["tokens_per_s"] for r in rows if r["trainer"] == "hyperparallel" and "failed" not in r}
    for r in rows:
        if "failed" in r:
            print(f"| {r['precision']:<9} | {r['trainer']:<30} | {'failed':>8} | {'':>9} | {r['failed'][:19]:<19} | {'':>16} |")
            continue
        loss = f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"
        mine = ours_rate.get(r["precision"])
        ratio = "" if r["trainer"] == "hyperparallel" or mine is None else f"{mine / r['tokens_per_s']:.2f}x faster"
        if mine is not None:
            r["hyperparallel_speedup"] = mine / r["tokens_per_s"]
        print(f"| {r['precision']:<9} | {r['trainer']:<30} | {r['step_ms']:>8.1f} | {r['tokens_per_s']:>9,.0f} | {loss:<19} | "
              f"{ratio:>16} |")
    for r in rows:
        if "failed" in r:
            print(f"{r['precision']} {r['trainer']}: {r['failed']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput: `hyperparallel train` vs the Hugging Face Trainer, side by side.

    python benchmarks/train.py                      # configs/default.yaml, fp32 and bf16, 24 steps each
    python benchmarks/train.py --steps 10           # quicker

Both train the same model (the same family, inline config and seeded weights), on the same
packed sequences, with the same micro-batch, gradient accumulation, AdamW settings, cosine
schedule and clipping, at the same precision:
- fp32: everything in float32 (the Trainer's default);
- bf16: float32 parameters, gradients and optimizer state, forward under bf16 autocast (the
  Trainer's `bf16=True`; ours `training.mixed_precision: bf16`).
hyperparallel runs as its config says (configs/default.yaml: fused loss, Inductor per decoder
layer), and with `--ours-compile none,dvm` also with those `training.compile` settings. The
Trainer runs as a user gets it: its default fused AdamW and transformers' default experts
implementation ("grouped_mm" since transformers 5); it is also timed with its own
`torch_compile=True`, and with "eager" experts (the per-expert loop of earlier versions).
With the MoE auxiliary loss on in the config (Qwen3-MoE's default), the Trainer's model computes
transformers' own (`output_router_logits`), so both do that work.

Each contender trains in a process of its own, all started together, and they take turns one
optimizer step at a time (the others wait, idle, on a pipe): every contender sees the same
machine, step for step, however its speed drifts. Each row's ratio is against hyperparallel at
the same precision; the first steps (compilation included) are warm-up and not counted. Prints
a table and writes JSON (--json PATH). With --one-process, hyperparallel's contenders (no HF
Trainer) are built in this one process from the trainer's parts and their steps called in turns:
one allocator, OpenMP team and set of caches for all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hyperparallel.models import build_model
from hyperparallel.optim.schedules import build_scheduler
from hyperparallel.train import data
from hyperparallel.train.build import inline_model_config
from hyperparallel.train.config import load_config
from hyperparallel.train.loop import train
from hyperparallel.train.preflight import document_mask


def ours(cfg, steps: int, workdir: Path, precision: str, step_done, compile: str | None = None) -> list[float]:
    run = cfg.model_copy(deep=True)
    run.training.steps = steps
    run.training.mixed_precision = "bf16" if precision == "bf16" else "none"
    if compile is not None:
        run.training.compile = compile
    run.scheduler.warmup_steps = min(cfg.warmup_steps(), steps)
    run.data.cache_dir = str(data.cache_root(cfg.data))  # (main's tokenized corpus, not one beside the run)
    run.logging.run_dir = str(workdir / f"ours-{time.monotonic_ns()}")
    run.logging.every = 1
    run.logging.progress = False
    run.checkpoint.every = 0
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the table is the output here
        summary = train(run, stop_after=steps, on_step=lambda step, record: step_done(record["step_time_s"]))
    return [r["loss"] for r in summary["records"] if "loss" in r]  # (not the validation records)


def _ours_on_meta(cfg, vocab_size: int):
    """The model as hyperparallel trains it, on the meta device (its MoE layers swapped)."""
    return build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, vocab_size),
                       materialize=False)


def _load_balance(cfg, vocab_size: int) -> str:
    """moe.load_balance, or the model's rule (what hyperparallel's run balances by)."""
    from hyperparallel.models import get_family
    from hyperparallel.models.families import load_balance_rule

    return cfg.moe.load_balance or load_balance_rule(get_family(cfg.model.family), _ours_on_meta(cfg, vocab_size))


class _Sequences(torch.utils.data.Dataset):
    """The trainer's rows as HF Trainer examples: its ids, labels and (with document masks) position
    ids restarting at each packed document, which transformers' masks then keep apart as ours; in
    the order hyperparallel trains them, epoch after epoch, for `length` rows (read sequentially,
    both see the same batch at every step)."""

    def __init__(self, rows, seed: int, length: int):
        self.rows, self.length = rows, length
        self.order = data.SequenceOrder(len(rows), seed)

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        ids, labels, positions = self.rows.row(self.order.index(i))
        example = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        return example if positions is None else {**example, "position_ids": torch.from_numpy(positions)}


def hf_trainer(cfg, dataset, steps: int, workdir: Path, precision: str, step_done, experts: str | None = None,
               compile: bool = False) -> list[float]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    model = build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, dataset.tokenizer.vocab_size),
                        dtype=torch.float32, attn_implementation=cfg.model.attention(),
                        seed=cfg.training.seed, grouped_experts=False)
    if experts is not None:
        model.set_experts_implementation(experts)
    if _load_balance(cfg, dataset.tokenizer.vocab_size) == "aux_loss":
        # ours adds the MoE auxiliary loss (moe.load_balance); the Trainer then does its own too
        model.config.output_router_logits = True
        if cfg.moe.aux_loss_coef is not None:
            model.router_aux_loss_coef = cfg.moe.aux_loss_coef
    losses, started = [], [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            started[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_done(time.perf_counter() - started[0])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    schedule = cfg.scheduler.model_copy(update={"warmup_steps": min(cfg.warmup_steps(), steps)})

    class SameSchedule(Trainer):
        """The Trainer with hyperparallel's lr at every step (its own "cosine" starts from lr 0 and
        ends at 0, ours at min_lr_ratio): the loss columns then compare like for like."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = build_scheduler(optimizer or self.optimizer, schedule, total_steps=num_training_steps)
            return self.lr_scheduler

    t, o = cfg.training, cfg.optimizer
    args = TrainingArguments(
        output_dir=str(workdir / "hf"), per_device_train_batch_size=t.micro_batch,
        gradient_accumulation_steps=cfg.grad_accumulation(1), max_steps=steps, learning_rate=o.lr,
        weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        max_grad_norm=t.max_grad_norm or 0.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=t.seed,
        train_sampling_strategy="sequential", disable_tqdm=True, bf16=precision == "bf16", torch_compile=compile,
    )
    rows = _Sequences(dataset.train, t.seed, steps * t.global_batch)
    trainer = SameSchedule(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # its per-step dicts would bury the table
    trainer.train()
    return losses


def _contender(kind: str, options: dict, config: str | None, overrides: list[str],
               steps: int, workdir: str, conn) -> None:
    """One contender in its own process: set up, then one step per "go" from the parent."""
    torch.set_num_threads(options.pop("threads"))
    try:
        cfg = load_config(config, overrides)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            dataset = data.prepare(cfg.data, document_mask=document_mask(cfg)[0])  # (the rows ours trains on)
        conn.send(("ready",))
        conn.recv()

        def step_done(seconds: float) -> None:
            conn.send(("step", seconds))
            conn.recv()  # wait for the turn of the next step

        if kind == "ours":
            losses = ours(cfg, steps, Path(workdir), step_done=step_done, **options)
        else:
            losses = hf_trainer(cfg, dataset, steps, Path(workdir), step_done=step_done, **options)
        conn.send(("done", losses))
    except Exception as error:  # a contender that cannot run here is reported, not hidden
        conn.send(("failed", f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"))


def _processes(contenders: dict, results: dict, args, tmp: str) -> None:
    """Each contender in a process of its own, taking turns one step at a time."""
    spawn = multiprocessing.get_context("spawn")
    pipes = {}
    for name, (kind, options) in contenders.items():
        mine, theirs = spawn.Pipe()
        options = {**options, "threads": torch.get_num_threads()}
        spawn.Process(target=_contender, args=(kind, options, args.config, args.set, args.steps, tmp, theirs),
                      daemon=True).start()
        pipes[name] = mine
    for name, pipe in pipes.items():  # every set-up done before the first timed step
        message = pipe.recv()
        if message[0] == "failed":
            results[name]["failed"] = message[1]
    running = [name for name in pipes if results[name]["failed"] is None]
    while running:
        for name in list(running):
            pipes[name].send("go")
            message = pipes[name].recv()
            if message[0] == "step":
                results[name]["times"].append(message[1])
                continue
            running.remove(name)
            if message[0] == "done":
                results[name]["losses"] = message[1]
            else:
                results[name]["failed"] = message[1]


def _one_process(cfg, contenders: dict, results: dict, steps: int) -> None:
    """hyperparallel's contenders built in this process from the trainer's own parts (model,
    optimizer, schedule, batches, TrainStep), their steps called in turns from this thread: one
    allocator, OpenMP team and set of caches for all (no run directory, logging or validation)."""
    from hyperparallel.train.build import build_batches, build_data, build_optimization, build_trained_model
    from hyperparallel.train.distributed import init_distributed
    from hyperparallel.train.step import TrainStep

    rt = init_distributed(cfg.training.collective_timeout_s("cpu"))
    trainers = {}
    for name, (_, options) in contenders.items():
        run = cfg.model_copy(deep=True)
        run.training.mixed_precision = "bf16" if options["precision"] == "bf16" else "none"
        run.training.compile = options.get("compile", run.training.compile)
        torch.manual_seed(run.training.seed)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            dataset = build_data(run, rt)
        built = build_trained_model(run, rt, dataset.tokenizer.vocab_size)
        optimizer, scheduler = build_optimization(run, built.model)
        step = TrainStep(built, optimizer, scheduler, accumulation=run.grad_accumulation(1), device=rt.device,
                         autocast_bf16=run.training.mixed_precision == "bf16", max_grad_norm=run.training.max_grad_norm)
        trainers[name] = (step, build_batches(run, dataset, built))
    for i in range(steps):
        for name, (step, batches) in trainers.items():
            t0 = time.perf_counter()
            result = step(batches.micro_batches(i))
            results[name]["times"].append(time.perf_counter() - t0)
            results[name]["losses"].append(result.loss)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="a trainer YAML (default: configs/default.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of each contender")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the timing")
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both (comma-separated)")
    parser.add_argument("--ours-compile", default="",
                        help="also time hyperparallel with these training.compile settings (comma-separated; '' for none)")
    parser.add_argument("--no-hf-compile", dest="hf_compile", action="store_false",
                        help="leave out the HF Trainer with torch_compile=True")
    parser.add_argument("--one-process", action="store_true",
                        help="hyperparallel's contenders only, in this one process, taking turns step by step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    dataset = data.prepare(cfg.data, document_mask=document_mask(cfg)[0])  # tokenized once here; the contenders read it
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    contenders = {}
    from hyperparallel.moe import GroupedExperts

    moe = any(isinstance(m, GroupedExperts) for m in _ours_on_meta(cfg, dataset.tokenizer.vocab_size).modules())
    for precision in args.precision.split(","):
        contenders[(precision, "hyperparallel")] = ("ours", {"precision": precision})
        for other in args.ours_compile.split(",") if args.ours_compile else ():
            if other != cfg.training.compile:
                contenders[(precision, f"hyperparallel, compile {other}")] = \
                    ("ours", {"precision": precision, "compile": other})
        contenders[(precision, "HF Trainer")] = ("hf", {"precision": precision})
        if args.hf_compile:
            contenders[(precision, "HF Trainer, torch_compile")] = ("hf", {"precision": precision, "compile": True})
        if moe and precision == "fp32":
            contenders[(precision, "HF Trainer, eager experts")] = ("hf", {"precision": precision, "experts": "eager"})
    if args.one_process:
        contenders = {name: c for name, c in contenders.items() if c[0] == "ours"}
    results = {name: {"times": [], "losses": [], "failed": None} for name in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        if args.one_process:
            _one_process(cfg, contenders, results, args.steps)
        else:
            _processes(contenders, results, args, tmp)
    rows = []
    for (precision, name), result in results.items():
        times, losses, failed = result["times"][args.warmup:], result["losses"], result["failed"]
        if failed:
            rows.append({"precision": precision, "trainer": name, "failed": failed})
            continue
        step = statistics.median(times)
        # the loss of one step is noisy (bf16 especially): the last 4 steps' mean says where a run got to
        rows.append({"precision": precision, "trainer": name, "step_ms": step * 1e3, "tokens_per_s": tokens_per_step / step,
                     "first_loss": losses[0], "last_loss": statistics.mean(losses[-4:])})
    print(f"Training throughput, {cfg.model.family} (each trainer in a process of its own, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads): global batch {cfg.training.global_batch} x seq {cfg.data.seq_len}, "
          f"micro-batch {cfg.training.micro_batch}, {args.steps} steps each, in turns ({args.warmup} warm-up); "
          f"hyperparallel: compile {cfg.training.compile}, "
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

"""The training loop: `train(cfg)` from a validated config to a finished run directory, built
from the components beside it (distributed, build, step, checkpointing, metrics, preemption).

Everything a user can get wrong is checked before anything is written (`preflight`, then the
checkpoint to resume and whether the run directory already holds another run), all of it on
rank 0, whose answer every rank takes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from hyperparallel import traffic
from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.checkpoint.model_card import KEY as MODEL_CARD
from hyperparallel.errors import ConfigError
from hyperparallel.train import checkpointing, elastic, preflight, roll_call, run_dir
from hyperparallel.train.build import build_batches, build_data, build_optimization, build_trained_model
from hyperparallel.train.checkpointing import Checkpointer
from hyperparallel.train.config import TrainConfig, dump
from hyperparallel.train.console import Console, announce, compile_phase, data_phase, describe_traffic, model_phase
from hyperparallel.train.distributed import (
    agree,
    background_group,
    check_restartable,
    decided_by_rank0,
    device_for_this_rank,
    joined,
    max_restarts,
    restart_count,
    traffic_over_ranks,
)
from hyperparallel.train.evaluate import Evaluator
from hyperparallel.train.metrics import LogWindow, MetricsLog, peak_memory_bytes
from hyperparallel.train.peak_flops import mfu_peak
from hyperparallel.train.preemption import StopRequests
from hyperparallel.train.quiet import LOG_FILE as LIBRARIES_LOG
from hyperparallel.train.quiet import LibraryOutput
from hyperparallel.train.step import TrainStep
from hyperparallel.train.tracing import StepTrace


def _decide_start(cfg: TrainConfig, world: int, restarted: bool) -> dict:
    """Rank 0's look before any work: the run directory (the one to continue, with `resume:
    latest`), every problem of the config found at once, and the checkpoint to start from."""
    directory = run_dir.resolve(cfg)
    preflight.check(cfg, world, directory)
    if not restarted:  # a restart continues this run's own directory
        run_dir.check_not_another_run(directory, cfg.checkpoint.resume)
    root = run_dir.checkpoint_root(directory, cfg.checkpoint.dir)
    resume = checkpointing.resolve(cfg.checkpoint.resume, root, restarted=restarted)
    if resume is not None:
        step = checkpointing.check_matches(resume, cfg)["step"]
        if step >= cfg.training.steps and not restarted:
            raise ConfigError(f"checkpoint {resume} is at step {step} and training.steps is {cfg.training.steps}: "
                              f"nothing is left to train; raise training.steps to go on")
    return {"run_dir": str(directory), "resume": None if resume is None else str(resume)}


def _follow_new_schedule(cfg: TrainConfig, state: dict, optimizer, scheduler) -> str | None:
    """A resumed run with another training.steps: the schedule is rebuilt for it (LambdaLR keeps
    no function in its state); the lr of the next step follows it at once. What changed, said."""
    saved = state.get("steps")
    if saved is None or saved == cfg.training.steps:
        return None
    before = optimizer.param_groups[0]["lr"]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    return (f"training.steps {saved} -> {cfg.training.steps}: the {cfg.scheduler.kind} schedule is rebuilt for "
            f"{cfg.training.steps} steps (warmup {cfg.warmup_steps()}); the lr at step {state['step'] + 1} is "
            f"{optimizer.param_groups[0]['lr']:.3g} instead of {before:.3g}")


def _write_run_files(cfg: TrainConfig, run_dir: Path, tokenizer) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(dump(cfg))
    tmp.replace(run_dir / "config.yaml")
    tokenizer.save(run_dir)  # (tokenizer.json, and tokenizer_config.json with the chat template)


def logged(done: int, start: int, last: int, every: int) -> bool:
    """Whether the step that makes `done` steps writes a record (or a stop request does)."""
    return done % every == 0 or done == last or done == start + 1


def train(cfg: TrainConfig, *, stop_after: int | None = None,
          on_step: Callable[[int, dict | None], None] | None = None) -> dict:
    """Train as `cfg` says; returns a summary (steps run, first and last loss, run dir, and
    `stopped_by`: the signal that stopped it early, or None).

    `stop_after` ends the run after that step, as a job that is killed or runs out of its time
    slot would (after writing a checkpoint there); the schedule stays that of training.steps.
    `on_step(step, record)` is called after each step, outside its timing (record: the metrics
    logged at that step, or None); tools such as benchmarks hook in there.

    What the libraries log, warn and draw meanwhile goes to RUN_DIR/libraries.log (`quiet`).
    """
    with LibraryOutput(int(os.environ.get("RANK", 0))) as libraries:
        return _train(cfg, libraries, stop_after, on_step)


def _train(cfg: TrainConfig, libraries: LibraryOutput, stop_after: int | None,
           on_step: Callable[[int, dict | None], None] | None) -> dict:
    check_restartable(cfg.logging.run_dir, elastic.launched_by_hyperparallel())
    timeout_s = cfg.training.collective_timeout_s(device_for_this_rank().type)
    with joined(timeout_s) as rt:
        if elastic.launched_by_hyperparallel():  # (its launcher names a stuck rank from the roll call)
            roll_call.prepare(timeout_s)
        return _train_on(cfg, rt, timeout_s, libraries, stop_after, on_step)


def _train_on(cfg: TrainConfig, rt, timeout_s: int, libraries: LibraryOutput, stop_after: int | None,
              on_step: Callable[[int, dict | None], None] | None) -> dict:
    restarted = restart_count() > 0
    decided = decided_by_rank0(lambda: _decide_start(cfg, rt.world, restarted))
    run_dir_path = Path(decided["run_dir"])
    libraries.keep_in(run_dir_path / LIBRARIES_LOG)
    console = Console(enabled=rt.is_main, progress=cfg.logging.progress)
    resume_from = None if decided["resume"] is None else Path(decided["resume"])
    ckpt_root = run_dir.checkpoint_root(run_dir_path, cfg.checkpoint.dir)
    accumulation = cfg.grad_accumulation(rt.world)

    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    console.phase(data_phase(cfg))
    dataset = build_data(cfg, rt)
    # resuming fills every tensor from the checkpoint: the init or model.path's files are not read
    console.phase(model_phase(cfg, resume_from))
    built = build_trained_model(cfg, rt, dataset.tokenizer.vocab_size, fill=resume_from is None)
    optimizer, scheduler = build_optimization(cfg, built.model)
    start, rng_restored, saved_world, schedule_change = 0, True, rt.world, None
    if resume_from is not None:
        console.phase(f"loading checkpoint {resume_from}")
        state = checkpointing.load(resume_from, built.model, optimizer, cfg)
        scheduler.load_state_dict(state["scheduler"])
        start, rng_restored, saved_world = state["step"], state["rng_restored"], state["world_size"]
        schedule_change = _follow_new_schedule(cfg, state, optimizer, scheduler)
    batches = build_batches(cfg, dataset, built)
    autocast_bf16 = cfg.training.mixed_precision == "bf16"
    evaluate = None
    if dataset.validation is not None:
        evaluate = Evaluator(built, dataset.validation, global_batch=cfg.training.global_batch,
                             micro_batch=cfg.training.micro_batch, eval_batches=cfg.training.eval_batches, rt=rt,
                             autocast_bf16=autocast_bf16)
    if rt.is_main:
        _write_run_files(cfg, run_dir_path, dataset.tokenizer)
        run_dir.point_latest(cfg.logging.run_dir, run_dir_path)

    log = MetricsLog(run_dir_path, console, tensorboard=cfg.logging.tensorboard, first_step=start,
                     wandb=cfg.logging.wandb, config=cfg.model_dump(mode="json", by_alias=True))
    compute_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]
    peak = mfu_peak(rt.device, compute_dtype, cfg.logging.peak_tflops)
    announce(console, cfg, built, dataset, accumulation, peak)
    log.build(start, built.memory, rt.device)
    if restarted:
        where = f"resumed from {resume_from} at step {start}" if resume_from else "no checkpoint yet: from step 0"
        log.print(f"restart {restart_count()} of {max_restarts()} after a failure: {where}")
    elif start:
        log.print(f"resumed from {resume_from} at step {start}")
    if schedule_change:
        log.print(schedule_change)
    if start and not rng_restored:
        log.print(f"the checkpoint was saved by {saved_world} rank(s), this run has {rt.world}: parameters and "
                  f"optimizer state are resharded; RNG states start from training.seed")

    step_fn = TrainStep(built, optimizer, scheduler, accumulation=accumulation, device=rt.device,
                        autocast_bf16=autocast_bf16, max_grad_norm=cfg.training.max_grad_norm,
                        sync_every_micro_batch=cfg.parallel.sync_every_micro_batch)
    checkpointer = Checkpointer(ckpt_root, every=cfg.checkpoint.every, keep_last=cfg.checkpoint.keep_last,
                                background=cfg.checkpoint.async_, is_main=rt.is_main,
                                background_group=background_group(timeout_s) if cfg.checkpoint.async_ else None)
    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    flops_per_step = built.flops_per_token * tokens_per_step
    first_loss = last_loss = stopped_by = comm = None
    last = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    window = LogWindow()
    launched = elastic.launched_by_hyperparallel()  # (then the launcher announces a stop, and forwards it)
    tracer = StepTrace(run_dir_path / "trace.json", first_step=start, last_step=last, steps=cfg.logging.trace_steps,
                       enabled=cfg.logging.trace)
    compiling = compile_phase(cfg, start)
    if compiling:
        console.phase(compiling)
    console.start_steps(cfg.training.steps, start, "compiling" if compiling else "")
    with StopRequests(announce=rt.is_main and not launched, forwarded=launched) as stop:
        try:
            for step in range(start, last):
                t0 = time.perf_counter()
                # the first step's collectives counted where they are issued (hyperparallel.traffic)
                with tracer.step(step), traffic.counting() if step == start else nullcontext() as counted:
                    result = step_fn(batches.micro_batches(step))
                if rt.device.type == "cuda" and logged(step + 1, start, last, cfg.logging.every):
                    # every stream's work done before a logged step's time is read (the loss read
                    # already waits for the current stream's: docs/train.md "Host reads")
                    torch.cuda.synchronize(rt.device)
                agreed = agree(result.loss, time.perf_counter() - t0, stop.requested is not None)
                if counted is not None:
                    comm = traffic_over_ranks(counted)
                    log.print(describe_traffic(comm))
                tracer.after_step(step)
                first_loss = agreed.loss if first_loss is None else first_loss
                last_loss = agreed.loss
                done = step + 1
                window.add(agreed.loss, result.grad_norm, result.lr, agreed.step_time_s, result.moe)
                record = None
                if logged(done, start, last, cfg.logging.every) or agreed.stop:
                    record = window.take(done, tokens_per_step=tokens_per_step, flops_per_step=flops_per_step,
                                         world=rt.world, peak_tflops=peak.tflops, peak_mem_bytes=peak_memory_bytes(rt.device))
                    if counted is not None:  # (the first step's record: always written)
                        record["comm_bytes"] = comm
                log.step(done, record)
                if evaluate is not None and not agreed.stop and (done == last or (
                        cfg.training.eval_every and done % cfg.training.eval_every == 0)):
                    log.evaluation(done, evaluate())
                if on_step is not None:
                    on_step(done, record)
                _log_saved(log, checkpointer.poll())
                if checkpointer.due(done, last) or agreed.stop:
                    state = {"fingerprint": cfg.fingerprint(), "config": cfg.fingerprinted(), "run_dir": str(run_dir_path),
                             "steps": cfg.training.steps, "scheduler": scheduler.state_dict(), "world_size": rt.world,
                             MODEL_CARD: built.card.to_json(), "sequences_consumed": done * cfg.training.global_batch,
                             "loss": agreed.loss}
                    _log_saved(log, checkpointer.save(done, built.model, optimizer, state))
                if agreed.stop:
                    stopped_by = stop.requested or "SIGTERM"  # (None here: another rank was signalled)
                    break
            tracer.close()  # (a run stopped early, inside the traced steps: every rank agreed to stop here)
            path = checkpointer.finish()
            _log_saved(log, path)
            if stopped_by is not None:
                newest = checkpointing.complete_checkpoints(ckpt_root)
                log.print(f"stopped by {stopped_by} after step {done}: checkpoint {newest[-1] if newest else 'none'}; "
                          f"continue with --set checkpoint.resume=latest")
        finally:
            log.close()
    if rt.is_main:
        elastic.write_result({"stopped_by": stopped_by, "run_dir": str(run_dir_path)})
    return {"run_dir": str(run_dir_path), "first_step": start, "steps": cfg.training.steps, "first_loss": first_loss,
            "last_loss": last_loss, "records": log.records, "stopped_by": stopped_by, "data": dataset.stats,
            "comm_bytes": comm}


def _log_saved(log: MetricsLog, path: Path | None) -> None:
    if path is not None:
        log.print(f"checkpoint {path}")

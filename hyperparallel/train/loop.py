"""The training loop: one function from a validated config to a finished run directory.

Everything a user can get wrong is checked before anything is written: the config, the batch
split, the data, the model, the checkpoint to resume, and whether the run directory already
holds another run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from hyperparallel import fsdp
from hyperparallel.errors import ConfigError
from hyperparallel.lowp import convert
from hyperparallel.models import build_model, compile_layers, fused_loss, install_fused_loss, training_flops_per_token
from hyperparallel.optim import build_optimizer, build_scheduler
from hyperparallel.parallel import apply_recompute, shard_model
from hyperparallel.train import checkpointing, data
from hyperparallel.train.config import TrainConfig, dump
from hyperparallel.train.metrics import MetricsLog, peak_memory_bytes, peak_tflops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _init_distributed() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def _expand_run_dir(template: str) -> Path:
    """logging.run_dir with {time} filled in, the same on every rank (rank 0's clock)."""
    now = torch.tensor([int(time.time())], dtype=torch.int64)
    if dist.is_initialized():
        dist.broadcast(now, src=0)
    return Path(template.format(time=time.strftime("%Y%m%d-%H%M%S", time.localtime(now.item()))))


def _check_run_dir(run_dir: Path, resume: str) -> None:
    """A run directory that holds another run is never written into, unless resuming it."""
    if (run_dir / "metrics.jsonl").exists() and resume == "none":
        raise ConfigError(
            f"logging.run_dir {run_dir} already holds a run; choose another run_dir, or set checkpoint.resume: latest "
            f"to continue it"
        )


def inline_model_config(cfg: TrainConfig, vocab_size: int) -> dict | None:
    """The inline model config, its vocabulary sized to the tokenizer when it does not say."""
    if cfg.model.config is None:
        return None
    inline = dict(cfg.model.config)
    given = inline.setdefault("vocab_size", vocab_size)
    if given < vocab_size:
        raise ConfigError(f"model.config.vocab_size ({given}) is smaller than the tokenizer's vocabulary "
                          f"({vocab_size})")
    return inline


def _reduce(value: float, op) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def train(cfg: TrainConfig, *, stop_after: int | None = None,
          on_step: Callable[[int, dict | None], None] | None = None) -> dict:
    """Train as `cfg` says; returns a summary (steps run, first and last loss, run dir).

    `stop_after` ends the run after that step, as a job that is killed or runs out of its time
    slot would (after writing a checkpoint there); the schedule stays that of training.steps.
    `on_step(step, record)` is called after each step, outside its timing (record: the metrics
    logged at that step, or None); tools such as benchmarks hook in there.
    """
    rank, world, device = _init_distributed()
    sharded = cfg.parallel.dp_shard > 1
    if sharded and cfg.parallel.dp_shard != world:
        raise ConfigError(f"parallel.dp_shard = {cfg.parallel.dp_shard} shards the model over that many ranks, but this "
                          f"run has {world}; launch it with hyperparallel train --nproc {cfg.parallel.dp_shard}")
    accumulation = cfg.grad_accumulation(world)
    run_dir = _expand_run_dir(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    _check_run_dir(run_dir, cfg.checkpoint.resume)
    resume_from = checkpointing.resolve(cfg.checkpoint.resume, ckpt_root)

    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    # rank 0 builds the tokenizer and token caches; the others then read them
    if rank == 0:
        dataset = data.prepare(cfg.data)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        dataset = data.prepare(cfg.data)

    dtype = DTYPES[cfg.model.dtype]
    model = build_model(
        cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, dataset.tokenizer.vocab_size), dtype=dtype,
        attn_implementation=cfg.model.attn_implementation, seed=cfg.training.seed,
    ).to(device)
    if cfg.model.path is not None and model.config.vocab_size < dataset.tokenizer.vocab_size:
        raise ConfigError(f"model.path {cfg.model.path}: its vocabulary ({model.config.vocab_size}) is smaller than "
                          f"the tokenizer's ({dataset.tokenizer.vocab_size}); give data.tokenizer the model's own")
    conversion = convert(model, cfg.low_precision)  # before parallel plans and sharding, as they expect
    if cfg.training.fused_loss:
        install_fused_loss(model, cfg.training.compile)  # an lm_head that is not a plain bias-free Linear keeps HF's loss
    apply_recompute(model, cfg.parallel.recompute)
    compile_layers(model, cfg.training.compile)
    n_params = sum(p.numel() for p in model.parameters())
    trained = model
    if sharded:
        shard_model(model, geometry=cfg.parallel.shard_geometry, align=cfg.parallel.align)
    elif world > 1:  # ranks beyond the parallel plans replicate the model
        trained = torch.nn.parallel.DistributedDataParallel(model)

    o = cfg.optimizer
    optimizer = build_optimizer(
        model, name=o.name, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, muon_lr=o.muon_lr,
        momentum=o.momentum, nesterov=o.nesterov, ns_steps=o.ns_steps,
    )
    s = cfg.scheduler
    scheduler = build_scheduler(optimizer, kind=s.kind, warmup_steps=s.warmup_steps, total_steps=cfg.training.steps,
                                min_lr_ratio=s.min_lr_ratio)
    fingerprint = cfg.fingerprint()
    # what `hyperparallel export` needs to rebuild the model from a checkpoint alone
    model_card = {"family": cfg.model.family, "dtype": cfg.model.dtype,
                  "hf_config": json.loads(model.config.to_json_string(use_diff=False))}
    start, rng_restored, saved_world = 0, True, world
    if resume_from is not None:
        state = checkpointing.load(resume_from, model, optimizer, fingerprint)
        scheduler.load_state_dict(state["scheduler"])
        start, rng_restored, saved_world = state["step"], state["rng_restored"], state["world_size"]

    batches = data.Batches(dataset.sequences, data.SequenceOrder(len(dataset.sequences), cfg.training.seed),
                           cfg.training.global_batch, cfg.training.micro_batch, rank, world,
                           dataset.tokenizer.pad_id, cfg.data.packing)
    is_main = rank == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "config.yaml.tmp"
        tmp.write_text(dump(cfg))
        tmp.replace(run_dir / "config.yaml")
        dataset.tokenizer.save(run_dir / "tokenizer.json")

    tokens_per_step = cfg.training.global_batch * cfg.data.seq_len
    flops_per_step = training_flops_per_token(model.config, cfg.data.seq_len) * tokens_per_step
    compute_dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else dtype
    peak, peak_source = peak_tflops(device, compute_dtype, cfg.logging.peak_tflops)
    log = MetricsLog(run_dir, enabled=is_main, tensorboard=cfg.logging.tensorboard, progress=cfg.logging.progress,
                     total_steps=cfg.training.steps, first_step=start)
    layout = f"sharded ({cfg.parallel.shard_geometry}, align {cfg.parallel.align})" if sharded else "replicated"
    log.print(f"{cfg.model.family}: {n_params / 1e6:.1f}M parameters, {dataset.num_tokens:,} corpus tokens, "
              f"{len(dataset.sequences):,} sequences of {cfg.data.seq_len}; {world} rank(s) {layout}, grad accumulation "
              f"{accumulation}, recompute {cfg.parallel.recompute}, mixed precision {cfg.training.mixed_precision}, compile "
              f"{cfg.training.compile}; MFU against {peak:.2f} TFLOP/s ({peak_source})")
    if cfg.low_precision.enabled:
        log.print(conversion.summary())
    if start:
        log.print(f"resumed from {resume_from} at step {start}")
        if not rng_restored:
            log.print(f"the checkpoint was saved by {saved_world} rank(s), this run has {world}: parameters and "
                      f"optimizer state are resharded; RNG states start from training.seed")

    params = [p for p in model.parameters() if p.requires_grad]
    first_loss = last_loss = None
    try:
        last = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
        for step in range(start, last):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, (ids, labels) in enumerate(batches.micro_batches(step)):
                last_micro = i == accumulation - 1
                if sharded:
                    fsdp.set_requires_gradient_sync(model, last_micro)
                sync = trained.no_sync() if world > 1 and not sharded and not last_micro else nullcontext()
                autocast = torch.autocast(device.type, dtype=torch.bfloat16) if compute_dtype != dtype else nullcontext()
                with sync, fused_loss(model):
                    with autocast:
                        loss = trained(input_ids=ids.to(device), labels=labels.to(device)).loss
                    (loss / accumulation).backward()
                loss_sum += loss.detach().double().cpu()
            max_norm = cfg.training.max_grad_norm or math.inf
            if sharded:
                grad_norm = fsdp.clip_grad_norm_(model, max_norm).item()
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = _reduce(time.perf_counter() - t0, dist.ReduceOp.MAX)
            loss_value = _reduce(loss_sum.item() / accumulation, dist.ReduceOp.SUM) / world
            first_loss = loss_value if first_loss is None else first_loss
            last_loss = loss_value
            done = step + 1
            record = None
            if done % cfg.logging.every == 0 or done == cfg.training.steps or done == start + 1:
                record = {
                    "step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                    "tflops": flops_per_step / step_time / 1e12 / world,
                    "mfu": flops_per_step / step_time / 1e12 / world / peak,
                    "peak_mem_bytes": peak_memory_bytes(device),
                }
            log.step(done, record)
            if on_step is not None:
                on_step(done, record)
            every = cfg.checkpoint.every
            if (every and done % every == 0) or done == last:
                state = {"fingerprint": fingerprint, "scheduler": scheduler.state_dict(), "world_size": world,
                         "model": model_card,
                         "sequences_consumed": done * cfg.training.global_batch, "loss": loss_value}
                path = checkpointing.save(ckpt_root, done, model, optimizer, state, cfg.checkpoint.keep_last)
                log.print(f"checkpoint {path}")
    finally:
        log.close()
    return {"run_dir": str(run_dir), "first_step": start, "steps": cfg.training.steps, "first_loss": first_loss,
            "last_loss": last_loss, "records": log.records}

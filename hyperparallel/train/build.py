"""Building a run from its config: the data, the model with its low-precision recipes and
parallel plans, and the optimizer with its schedule. Each function is one stage of DESIGN.md's
training step; `train.loop` calls them in order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.checkpoint import ModelCard
from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import MixedPrecision, run_as_pipeline_stage
from hyperparallel.lowp import convert
from hyperparallel.models import build_model, compile_layers, get_family, install_fused_loss, training_flops_per_token
from hyperparallel.models.build import declared_config_keys
from hyperparallel.models.families import load_balance_rule, tensor_parallel_plan
from hyperparallel.models.kernels import use_kernels
from hyperparallel.models.layers import layer_list
from hyperparallel.moe import LoadBalancer, default_waves
from hyperparallel.moe.balance import balanced_layers, routers
from hyperparallel.multicore import COST_MODELS, EXECUTORS
from hyperparallel.optim import build_optimizer, build_scheduler
from hyperparallel.parallel import (
    MeshShape,
    ParallelMesh,
    apply_expert_parallel,
    apply_recompute,
    build_mesh,
    shard_model,
)
from hyperparallel.parallel.expert_parallel import expert_layout_of, moe_shape
from hyperparallel.parallel.mixed_precision import (
    attach_mx_gather,
    keep_float32_outside_products,
    round_embedding_outputs,
)
from hyperparallel.parallel.pipeline import Pipeline, hold_stages, stage_layout, tied_embedding_groups, tied_head
from hyperparallel.parallel.tensor_parallel import apply_tensor_parallel, make_head_vocab_parallel
from hyperparallel.train import data
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime, decided_by_rank0
from hyperparallel.train.metrics import peak_memory_bytes
from hyperparallel.train.preflight import document_mask
from hyperparallel.train.weights import fill_from_hf, fill_from_init, local_targets, materialize_meta

if TYPE_CHECKING:
    from hyperparallel.parallel.context_parallel import ContextParallel

# Preparing a corpus can take hours (its first run; `hyperparallel prepare` does it ahead): the
# other ranks wait for rank 0 that long, on a group of their own, before the collective timeout.
PREPARE_TIMEOUT_S = 24 * 3600


def build_data(cfg: TrainConfig, rt: Runtime) -> data.Dataset:
    """Rank 0 tokenizes what the cache lacks (under a lock: one writer per cache, whoever runs)
    while the others wait; then each opens the shards, memory-mapped, and reads its own rows."""
    options = {"model_path": cfg.model.path, "cache": data.cache_root(cfg.data, cfg.logging.run_dir),
               "document_mask": document_mask(cfg)[0]}
    if rt.world == 1:  # (no one to wait)
        return data.prepare(cfg.data, progress=True, **options)
    made = {}

    def prepare() -> None:
        made["dataset"] = data.prepare(cfg.data, progress=True, **options)

    waiting = dist.new_group(backend="gloo", timeout=timedelta(seconds=PREPARE_TIMEOUT_S))
    try:
        decided_by_rank0(prepare, group=waiting)
    finally:
        dist.destroy_process_group(waiting)
    return made["dataset"] if rt.is_main else data.open_prepared(cfg.data, **options)


def build_batches(cfg: TrainConfig, dataset: data.Dataset, built: BuiltModel) -> data.Batches:
    """This rank's micro-batches: its data-parallel rank's share (the ranks of one tp x cp group
    read one batch)."""
    order = data.SequenceOrder(len(dataset.train), cfg.training.seed)
    mesh = built.mesh
    return data.Batches(dataset.train, order, cfg.training.global_batch, cfg.training.micro_batch, mesh.dp_rank,
                        mesh.dp_size)


def inline_model_config(cfg: TrainConfig, vocab_size: int) -> dict | None:
    """The inline model config, its vocabulary sized to the tokenizer when it does not say."""
    if cfg.model.config is None:
        return None
    inline = dict(cfg.model.config)
    holder, declared = inline, declared_config_keys(get_family(cfg.model.family).config_class)
    if "vocab_size" not in declared and "text_config" in declared:  # (Fuyu keeps it in its text model's config)
        holder = inline["text_config"] = dict(inline.get("text_config") or {})
    given = holder.setdefault("vocab_size", vocab_size)
    if given < vocab_size:
        raise ConfigError(f"model.config.vocab_size ({given}) is smaller than the tokenizer's vocabulary "
                          f"({vocab_size}); leave vocab_size out of the model config to follow the tokenizer")
    return inline


@dataclass
class BuiltModel:
    model: nn.Module  # the model itself: parameters, state dicts, checkpoints
    trained: nn.Module  # what forward runs through (the model, or DDP around it)
    card: ModelCard
    n_params: int
    conversion_summary: str | None  # what low_precision converted, when on
    mesh: ParallelMesh  # the ranks' layout and groups (every axis; size 1 where unused)
    balancer: LoadBalancer | None = None  # the MoE layers' load balancing (None: no MoE layers)
    waves: int | None = None  # MegaMoE's expert waves (None: the sequential EP layer, or no EP)
    context_parallel: ContextParallel | None = None  # what apply_context_parallel returned (cp enabled)
    kernels: str = ""  # the run summary's line on the fused kernels
    memory: BuildMemory | None = None  # what the build cost (peak memory, time)
    flops_per_token: float = 0.0  # training FLOPs per token at data.seq_len (of the whole model: MFU's numerator)
    # transformers' model adds its own auxiliary loss (MoE layers with transformers' routers under
    # moe.load_balance aux_loss): forward asks for it (output_router_logits)
    transformers_aux_loss: bool = False
    pipeline: Pipeline | None = None  # this rank's pipeline stages and their schedule (parallel.pp > 1)

    @property
    def sharded(self) -> bool:
        """FSDP holds the parameters (else each rank has them whole: one rank, or DDP)."""
        return self.mesh.fsdp_enabled


def build_trained_model(cfg: TrainConfig, rt: Runtime, vocab_size: int, *, fill: bool = True) -> BuiltModel:
    """The HF model on the meta device, its tensor-parallel split, then MXFP8 recipes, expert
    parallelism, the fused loss, context parallelism, recompute and compilation (all before
    sharding, as they expect), then FSDP or DDP over the ranks; only then does this rank's part
    get memory and values: the seeded init, or its blocks of `model.path`'s files (weights.py).

    `fill=False` leaves the values uninitialized (a run about to load a checkpoint into every
    tensor: reading `model.path` or drawing the init would be work thrown away)."""
    p = cfg.parallel
    mesh = build_mesh(MeshShape.of(p, rt.world))
    start_s, start_mem = time.perf_counter(), peak_memory_bytes(rt.device)
    model = _meta_model(cfg, vocab_size)
    shadow = _meta_model(cfg, vocab_size)  # whole shapes, no plans: what the init and the file reader see
    hf_plan = None
    if fill and cfg.model.path is not None:  # the files checked against the model before any memory is given
        from hyperparallel.checkpoint.hf_files import plan_hf_read

        hf_plan = plan_hf_read(cfg.model.path, shadow)
    if cfg.model.path is not None and model.config.vocab_size < vocab_size:
        raise ConfigError(f"model.path {cfg.model.path}: its vocabulary ({model.config.vocab_size}) is smaller than "
                          f"the tokenizer's ({vocab_size}); give data.tokenizer the model's own")
    n_params = sum(t.numel() for t in model.parameters())  # (whole: before TP and EP keep a rank's part)
    flops_per_token = training_flops_per_token(shadow, cfg.data.seq_len)
    layout_of_stages, stages, tied = None, (), None
    # (the MoE balancing's rule, and whether our routers run it, found on the whole model: a
    # pipeline rank whose stages hold no MoE layer balances with the others all the same)
    balancing = moe_balancing(cfg, model)
    if mesh.pp_enabled:  # this rank keeps its stages' layers alone, before anything gets memory
        layout_of_stages = stage_layout(model, p.pp, p.pp_virtual_stages, p.pp_schedule, p.pp_layers)
        ties = tied_head(model)
        stages = tuple(hold_stages(model, layout_of_stages, mesh.pp_rank))
        if ties:  # (the first and last stages each hold the weight, under the embedding's name)
            group = tied_embedding_groups(mesh.shape.stage_world, p.pp, mesh.rank)
            if group is not None:
                weight = model.get_input_embeddings().weight
                tied = (next(n for n, q in model.named_parameters() if q is weight), group)
    k = cfg.kernels
    kernels = use_kernels(model, mega_gate=k.mega_gate, mega_mhc=k.mega_mhc).summary(mega_gate=k.mega_gate,
                                                                                   mega_mhc=k.mega_mhc)
    family = get_family(cfg.model.family)
    if mesh.tp_enabled:
        plan = tensor_parallel_plan(family, model)
        if isinstance(plan, str):
            raise ConfigError(f"parallel.tp: {cfg.model.family!r}: {plan}")
        apply_tensor_parallel(model, mesh.tp_group, sequence_parallel=p.sequence_parallel, plan=plan)
    conversion = convert(model, cfg.low_precision)
    balancer = build_balancer(cfg, model, balancing)
    transformers_aux = balancer is not None and balancer.mode == "aux_loss" and not balancing[1]
    layout, waves = None, None
    if mesh.ep_enabled:
        layout = expert_layout_of(mesh)
        waves = moe_waves(cfg, model, rt.device) if cfg.moe.implementation == "megamoe" else None
        apply_expert_parallel(model, layout, implementation=cfg.moe.implementation, waves=waves or 1,
                              dispatch=cfg.moe.dispatch)
    if cfg.training.fused_loss:
        install_fused_loss(model, cfg.training.compile)  # an lm_head that is not a plain bias-free Linear keeps HF's loss
    if mesh.tp_enabled:
        make_head_vocab_parallel(model)
    context = None
    if mesh.cp_enabled:
        from hyperparallel.parallel.context_parallel import apply_context_parallel

        context = apply_context_parallel(model, mesh.cp_group, p.cp_mode, cfg.data.seq_len)
    apply_recompute(model, cfg.parallel.recompute)
    compile_layers(model, cfg.training.compile)
    card = ModelCard.of(cfg.model.family, cfg.model.dtype, model.config)  # (the config: whole shapes)
    bf16 = cfg.training.mixed_precision == "bf16"
    if bf16:  # [Note: bf16 parameters], parallel/mixed_precision.py
        keep_float32_outside_products(model)
        round_embedding_outputs(model, torch.bfloat16)
    if mesh.fsdp_enabled:
        # FSDP over dp_shard x cp within a replica (the ranks holding the same TP-local weights; the
        # world without TP or HSDP), replicated over dp_replicate (HSDP; a group of one without).
        # The shards get their memory here, uninitialized; nothing whole is ever allocated.
        # MXFP8 weights gather as MX data (their shards then of whole 32-row blocks: lowp/gather.py)
        if cfg.low_precision.enabled:
            attach_mx_gather(model)
        shard_model(model, geometry=p.shard_geometry, align=p.align, process_group=mesh.fsdp_group,
                    replicate_group=mesh.replicate_group, experts=layout, device=rt.device,
                    mp_policy=MixedPrecision(torch.bfloat16 if bf16 else None, DTYPES[p.reduce_dtype]))
    materialize_meta(model, rt.device)  # what FSDP did not shard: buffers, or everything of an unsharded run
    if hf_plan is not None:
        fill_from_hf(model, shadow, hf_plan, cfg.training.seed, rt.device)
    elif fill:
        fill_from_init(model, shadow, cfg.training.seed, rt.device)
    else:  # a checkpoint fills every parameter and persistent buffer; the rest is computed
        fill_from_init(model, shadow, cfg.training.seed, rt.device,
                       only=set(local_targets(model)) - set(model.state_dict(keep_vars=True)))
    pipeline = None
    if layout_of_stages is not None:
        layers = layer_list(model)  # (several forwards run before their backwards, each of one stage's layers)
        run_as_pipeline_stage(model, {s: [layers[i] for i in range(*layout_of_stages.layers[s])] for s in stages})
        dtype = next(q.dtype for q in model.parameters() if q.is_floating_point())
        forward_kwargs = ({"output_router_logits": transformers_aux}
                          if hasattr(model.config, "output_router_logits") else {})
        n = cfg.grad_accumulation(rt.world)
        if balancer is not None:  # (each balanced layer's decoder layer: the figures in the model's order)
            where = {id(m): i for i, layer in enumerate(layer_list(model)) for m in layer.modules()}
            balancer.for_pipeline([where[id(layer.counter)] for layer in balancer.layers], mesh.stage_group,
                                  mesh.pp_group, n, rt.device)
        pipeline = Pipeline(model, layout_of_stages, list(stages), mesh.pp_group, n, dtype, forward_kwargs,
                            balancer=balancer, tied=tied, context=context)
    trained = model
    if mesh.ddp_enabled:  # a layout that names no dimension: every rank holds the model whole
        trained = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.replicate_group)
        if p.reduce_dtype == "bfloat16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            trained.register_comm_hook(mesh.replicate_group, bf16_compress_hook)
    summary = conversion.summary() if cfg.low_precision.enabled else None
    memory = BuildMemory.measure(rt, mesh.world_group, start_mem, time.perf_counter() - start_s,
                                 "init" if hf_plan is None and fill else f"model.path {cfg.model.path}" if fill
                                 else "checkpoint")
    return BuiltModel(model=model, trained=trained, card=card, n_params=n_params, conversion_summary=summary, mesh=mesh,
                      balancer=balancer, waves=waves, context_parallel=context, kernels=kernels, memory=memory,
                      flops_per_token=flops_per_token, transformers_aux_loss=transformers_aux,
                      pipeline=pipeline)


def _meta_model(cfg: TrainConfig, vocab_size: int) -> nn.Module:
    return build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, vocab_size),
                       dtype=DTYPES[cfg.model.dtype], attn_implementation=cfg.model.attention(), materialize=False)


@dataclass(frozen=True)
class BuildMemory:
    """What building the model cost: the largest rank's peak memory (the device's on GPUs, as the
    step records report it; the host's, the resident set, always), and how long it took; the
    trainer prints it and logs it to metrics.jsonl."""

    peak_bytes: int  # the largest rank's peak (device on GPUs, else host), from the start of the process
    grown_bytes: int  # the largest rank's rise of that peak during the build
    seconds: float
    weights_from: str  # "init", "model.path DIR" or "checkpoint" (filled by the resume that follows)
    host_peak_bytes: int = 0  # the largest rank's host peak resident set (the same as peak_bytes on the CPU)

    @classmethod
    def measure(cls, rt: Runtime, group: dist.ProcessGroup, start_peak: int, seconds: float,
                weights_from: str) -> BuildMemory:
        """The largest rank's figures over `group` (the mesh's ranks)."""
        peak = peak_memory_bytes(rt.device)
        host = peak_memory_bytes(torch.device("cpu"))
        numbers = torch.tensor([peak, peak - start_peak, host], dtype=torch.int64)
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
        return cls(int(numbers[0]), int(numbers[1]), seconds, weights_from, int(numbers[2]))

    def describe(self, device: torch.device) -> str:
        where = "device" if device.type == "cuda" else "host"
        host = f", host {self.host_peak_bytes / 2**30:.2f} GiB" if device.type == "cuda" else ""
        return (f"model built in {self.seconds:.1f} s, weights from {self.weights_from}: peak {where} memory "
                f"{self.peak_bytes / 2**30:.2f} GiB on the largest rank (+{self.grown_bytes / 2**30:.2f} GiB while "
                f"building){host}")


def moe_waves(cfg: TrainConfig, model: nn.Module, device: torch.device) -> int:
    """moe.waves, or the count the device's cost model predicts fastest for the first MoE layer at
    this run's micro-batch (the same on every rank: it depends on the config alone)."""
    if cfg.moe.waves is not None:
        return cfg.moe.waves
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]
    shape = moe_shape(model, cfg.training.micro_batch * cfg.data.seq_len, torch.empty((), dtype=dtype).element_size())
    return default_waves(shape, cfg.parallel.ep, COST_MODELS[device.type], **EXECUTORS[device.type])


def moe_balancing(cfg: TrainConfig, model: nn.Module) -> tuple[str, bool] | None:
    """(the family's load-balancing rule, whether our routers run it) of `model`'s MoE layers, or
    None without any."""
    if not balanced_layers(model):
        return None
    return load_balance_rule(get_family(cfg.model.family), model), bool(routers(model))


def build_balancer(cfg: TrainConfig, model: nn.Module, balancing: tuple[str, bool] | None = None) -> LoadBalancer | None:
    """The MoE load balancing `moe:` asks for (the family's rule by default), over every rank. Where
    the MoE layers keep transformers' routers and the rule is aux_loss, transformers' model adds
    its own auxiliary loss (at moe.aux_loss_coef when that is given). `balancing`: (the family's
    rule, whether our routers run it) of the whole model, found before a pipeline cut it (a rank
    may then hold none of its MoE layers, and balance with the other ranks all the same)."""
    balancing = balancing or moe_balancing(cfg, model)
    if balancing is None:
        return None
    rule, ours = balancing
    balancer = LoadBalancer.from_config(model, cfg.moe, family_rule=rule)
    if balancer.mode == "aux_loss" and not ours and cfg.moe.aux_loss_coef is not None:
        model.router_aux_loss_coef = cfg.moe.aux_loss_coef  # (what its forward multiplies the loss by)
    return balancer


def build_optimization(cfg: TrainConfig, model: nn.Module):
    """The optimizer over this rank's (sharded) parameters, and its learning-rate schedule."""
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, total_steps=cfg.training.steps)
    return optimizer, scheduler

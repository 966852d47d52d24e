"""`hyperparallel plan`: what one rank of a training run holds in memory and sends per step, from
its config alone, without allocating the model, for any layout and number of ranks; with a
device model, its step time (plan_time.py). `plan` assembles the pieces beside this file: the
fake model (model.py), one recorded micro-batch (timeline.py), the bytes held (memory.py) and
sent (communication.py); report.py prints the result.

[Note: how the plan is made]
The model is built as the trainer builds it (the family's class from its config on the meta
device, the experts swapped, the fused loss, recompute), its tensors then made fake (torch's
FakeTensorMode: a shape, a dtype, a device, meta storage, no bytes). One micro-batch's forward
and backward run on it while a dispatch mode records every tensor storage an operator makes and
when it is freed (autograd frees them as in a real eager run), with marks at each decoder
layer's forward and each parameter's gradient. Nothing is estimated per architecture: what
autograd saves, what backward works with, the fused loss's chunks, autocast's bf16 copies of
the weights and recompute's replays are whatever the code really does (on real tensors the same
recording gives the same bytes, tested). From that timeline:

- activations: the most bytes alive at once that are neither parameters nor their gradients;
- replicated: gradients whole (all alive from the first micro-batch on when the step
  accumulates; else as backward makes them), and with more than one rank DDP's buckets (a
  second copy of the gradients, gradient_as_bucket_view being off);
- sharded (`hyperparallel.fsdp`): parameter, gradient and optimizer shards from fsdp's own shard
  geometry (`shard_ranges`, `padded_rows`; an MXFP8 weight's shards on 32-row blocks, as fsdp
  aligns them: the model is tagged as the build tags it, `tag_as_built`, once its micro-batch is
  recorded), its collectives' slots from fsdp's own pieces; during a micro-batch the root's full
  parameters, a layer's full parameters from its forward to its end and again in its backward (as
  gathered: under bf16 mixed precision the products' in bf16, of which autocast then makes no
  copies: `Timeline.without_casts_of`), the next
  group's all-gather buffers (prefetched), the unsharded gradients of the groups still in
  backward (all of them, accumulated, when the step accumulates: no_sync keeps them whole, unless
  parallel.sync_every_micro_batch), the reduce-scatter inputs of the two groups that finished
  last ([ranks x slot]; fsdp frees one when the next group has launched its own, and gloo works
  on a copy of it), and every finished group's output (the gradient shard);
- the optimizer step: gradients and state, plus Muon's Newton-Schulz temporaries and exchange
  buffers (clipping, fsdp's or torch's, makes foreach norms only).

The model run is one rank's part of the layout (`parallel.mesh.MeshShape`): with tp one TP rank's
part of it, split by the plan the trainer runs (`split_tensor_parallel`), with cp each sequence's
seq_len / cp tokens, with ep the first
expert-parallel rank's experts (`keep_local_experts`), every routed row computed as a rank
receiving its share under uniform routing does; FSDP shards over dp_shard x cp (a layer's
experts over the ranks holding the same experts), and HSDP's replicas hold the same shards.

The total is the largest sum over that timeline and the optimizer step, not the sum of each
part's own maximum. On the CPU the trainer's peak is the process's peak resident set, so the
plan adds a `runtime` term there: this process's resident memory after importing what the
trainer imports (`memory.RUN_MODULES`; a measurement, not a model). Not accounted (listed in
`Plan.unaccounted`): the dataset held in memory, the allocator's own slack (glibc keeps freed
blocks), Inductor's smaller set of saved tensors (the plan is eager's), and MXFP8's quantized
copies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperparallel.errors import ConfigError
from hyperparallel.optim import split_for_muon
from hyperparallel.parallel.expert_parallel import routed_experts
from hyperparallel.parallel.mesh import MeshShape
from hyperparallel.parallel.pipeline import StageInput, StageLayout
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.communication import COMM_FORMULA, megamoe_exposed_s, step_collectives
from hyperparallel.train.planning.device_model import DeviceModel
from hyperparallel.train.planning.memory import (
    build_transient,
    fsdp_groups,
    muon_exchange,
    muon_matrices,
    nbytes,
    optimizer_state,
    optimizer_step_transient,
    runtime_bytes,
    shard_bytes,
    timeline_peak,
)
from hyperparallel.train.planning.model import fake_model, meta_model, pipeline_stages, tag_as_built
from hyperparallel.train.planning.pipeline import (
    StageWork,
    pipeline_buffers,
    pipeline_step_s,
    stage_calls,
    stage_peak,
    stage_sends,
)
from hyperparallel.train.planning.plan_time import (
    Collective,
    OpCosts,
    StepTime,
    gathered_in_bf16,
    predict,
    spans_nodes,
)
from hyperparallel.train.planning.timeline import simulate
from hyperparallel.train.preflight import layout_problems


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds (the rank holding the most) and sends per optimizer step."""

    family: str
    n_params: int
    world: int
    layout: str  # replicated (one rank) | replicated (DDP) | sharded (FSDP ...)
    rank: int  # the rank the figures are of
    device: str
    micro_batch: int
    seq_len: int
    accumulation: int
    recompute: str
    mixed_precision: str
    fused_loss: bool
    compile: str
    optimizer_name: str
    params: int  # this rank's parameters (its shards when sharded)
    grads: int  # gradients that live to the optimizer step (sharded: fsdp's padded gradient shards)
    optimizer: int  # optimizer state
    activations: int  # the most bytes alive at once in a micro-batch's forward and backward, beyond the above
    buffers: int  # FSDP's unsharded parameters and gradients and collective buffers, or DDP's buckets, at their peak
    tensors: int  # all tensors at the step's peak (the largest sum over its timeline), or the build's if larger
    runtime: int  # CPU: resident memory of the process besides tensors (measured); CUDA: 0
    comm_bytes_per_step: int
    # the model's build: this rank's parameters and the buffers, plus what filling them holds
    # whole at once (the init: the largest module's own tensors; model.path: the largest block read)
    build: int = 0
    comm: dict[str, int] = field(default_factory=dict)
    unaccounted: tuple[str, ...] = ()
    mesh: dict[str, int] = field(default_factory=dict)  # dp_replicate, dp_shard, cp, tp, ep
    comm_by_dimension: dict[str, int] = field(default_factory=dict)  # bytes sent per step, by mesh dimension
    # and by "dimension/kind" of collective: the keys of the counter's (a run's metrics.jsonl, comm_bytes)
    comm_by_dimension_and_kind: dict[str, int] = field(default_factory=dict)
    time: StepTime | None = None  # the predicted step time (with a device model)
    # pipeline parallelism: the schedule, each stage's decoder layers, the rank whose memory is
    # figured (pp_rank), every pipeline rank's total, the rank whose bytes sent are (comm_pp_rank)
    pipeline: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.tensors + self.runtime

    def to_json(self) -> dict:
        data = asdict(self)
        parts = ("params", "grads", "optimizer", "activations", "buffers", "build", "tensors", "runtime")
        data["per_rank_bytes"] = {key: data.pop(key) for key in parts} | {"total": self.total}
        data["comm_formula"] = COMM_FORMULA
        data["unaccounted"] = list(self.unaccounted)
        return data


def plan(cfg: TrainConfig, world: int, *, runtime: int | None = None, device: torch.device | str | None = None,
         device_model: DeviceModel | None = None, layers: int | None = None, simulations: dict | None = None,
         _stages: tuple[StageLayout, int] | None = None) -> Plan:
    """The memory and communication plan of one rank of `cfg` run over `world` ranks, and with
    `device_model` its predicted step time (plan_time.py).

    `runtime`: on the CPU, the resident bytes besides tensors; None measures this process
    (`runtime_bytes`), right in a fresh process only. `device`: where the model is simulated
    (default: where the trainer would, a GPU when there is one). The plan is of a GPU run when
    `device` is CUDA or `device_model` is a GPU's: its runtime term is then 0, as
    max_memory_allocated counts tensors only. `layers`: plan the model's first layers only (what
    `plan_search` extrapolates from); `simulations`: a cache of simulated micro-batches, shared by
    plans of one config that differ in their layout only (their expert-parallel timelines are one
    simulation's with every expert, its expert gradients cut to a rank's).

    With pipeline parallelism the plan is of the pipeline rank holding the most (its stages' own
    model, micro-batches in flight and the schedule's buffers: planning/pipeline.py), its time the
    pipeline's (the slowest rank's, and the bubble), `Plan.pipeline` every rank's total; with
    `layers` (screening) of a first stage holding them all, every stage taken as it.
    `_stages`: (the stages, the pipeline rank) of one rank's plan, made here.
    """
    from hyperparallel.train.distributed import device_for_this_rank

    if world < 1:
        raise ConfigError(f"the number of ranks must be at least 1, got {world}")
    problems = layout_problems(cfg, world)
    if problems:
        raise ConfigError("\n".join(problems))
    layout = MeshShape.of(cfg.parallel, world)
    if layout.pp_enabled and _stages is None:  # each pipeline rank's plan, then the pipeline's
        stages = pipeline_stages(cfg, layers)
        options = {"runtime": runtime, "device": device, "device_model": device_model, "layers": layers,
                   "simulations": simulations}
        ranks = range(1 if layers is not None else layout.pp)
        return _pipeline_plan(cfg, stages, [plan(cfg, world, **options, _stages=(stages, r)) for r in ranks])
    stages, pp_rank = _stages if _stages is not None else (None, 0)
    accumulation = cfg.grad_accumulation(world)
    device = torch.device(device) if device is not None else device_for_this_rank()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    on_gpu = device.type == "cuda" or (device_model is not None and device_model.name != "cpu")
    if on_gpu:  # (the trainer's peak there is the CUDA allocator's: tensors only)
        runtime = 0
    elif runtime is None:
        runtime = runtime_bytes(cfg.training.compile)
    sharded = layout.fsdp_enabled
    seq_len = cfg.data.seq_len // layout.cp

    if simulations is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the meta model's tensors become fake ones)
        model = fake_model(cfg, mode, device, tp=layout.tp, ep=layout.ep, layers=layers, stages=stages,
                           pp_rank=pp_rank)
        timeline = simulate(model, mode, cfg, device, seq_len, gpu_attention=on_gpu and device.type == "cpu",
                            stages=stages, pp_rank=pp_rank)
        whole_config = _whole_config(cfg, model, layout, layers)
    else:  # (screening: one simulation with every expert per micro-batch shape, shared by every ep)
        # (a screened first stage of the pipeline is the same model at any pp: the first layers, no head)
        cut = {"stages": stages, "pp_rank": pp_rank}
        staged = tuple(stages.layers[s] for s in stages.stages_of(pp_rank)) if stages is not None else None
        key = (layout.tp, layers, seq_len, cfg.training.micro_batch, cfg.parallel.recompute, staged)
        if key not in simulations:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            model = fake_model(cfg, mode, device, tp=layout.tp, layers=layers, **cut)
            simulations[key] = (simulate(model, mode, cfg, device, seq_len, gpu_attention=on_gpu and device.type == "cpu",
                                         **cut), _whole_config(cfg, model, MeshShape(tp=layout.tp, pp=layout.pp), layers))
        timeline, whole_config = simulations[key]
        shapes = ("model", layout.tp, layout.ep, layers, staged)  # (only its parameters' shapes are read)
        if shapes not in simulations:
            simulations[shapes] = fake_model(cfg, FakeTensorMode(allow_non_fake_inputs=True), device, tp=layout.tp,
                                             ep=layout.ep, layers=layers, **cut)
        model = simulations[shapes]
        if layout.ep_enabled:
            timeline = timeline.with_gradients_of(list(model.parameters()))
    tag_as_built(cfg, model, layout.fsdp_enabled)  # (what its gathers and dispatches carry)
    params = list(model.parameters())
    # FSDP under bf16 mixed precision gathers the products' weights in bf16: autocast makes no
    # copies of them, and their gradients are bf16 until the reduce-scatter
    bf16 = gathered_in_bf16(model, sharded and cfg.training.mixed_precision == "bf16")
    timeline = timeline.without_casts_of({j: params[j].numel() * torch.bfloat16.itemsize for j in bf16})
    whole = {id(p): nbytes(p) for p in params}
    grads_whole = sum(whole[id(p)] for p in params if p.requires_grad)
    experts = ({id(p) for module, _ in routed_experts(model) for p in module.parameters()} if layout.ep_enabled
               else set())

    if sharded:
        world_of = {id(p): layout.expert_shard if id(p) in experts else layout.shard_size for p in params}
        groups = fsdp_groups(model, params, world_of, cfg)
        per_rank = {id(p): shard_bytes(p, world_of[id(p)], cfg) for p in params}
        matrices = muon_matrices(cfg, model, layout.shard_size)
        candidates = []
        for r in range(layout.shard_size):  # (an expert's shards: rank r is expert-shard rank r // ep)
            shard = {key: sizes[r // layout.ep if key in experts else r] for key, sizes in per_rank.items()}
            candidates.append((sum(shard.values()) + optimizer_state(cfg, model, shard), r, shard))
        _, rank, shard = max(candidates, key=lambda c: (c[0], -c[1]))
        params_bytes = sum(shard.values())
        optimizer_bytes = optimizer_state(cfg, model, shard)
        grads = sum(g.slot for g in groups if g.trainable)
        # [Note: gloo's reduce-scatter] ProcessGroupGloo reduce-scatters a clone of its input
        # (measured: an aten::clone of [ranks x slot] inside c10d::_reduce_scatter_base_), which
        # the work holds until fsdp settles it (the next group's reduce-scatter): two copies on the CPU
        copies = 1 if on_gpu else 2
        if stages is None:
            activations, buffers, peak = timeline_peak(timeline, groups, layout.shard_size, accumulation, grads_whole,
                                                       copies, cfg.parallel.sync_every_micro_batch, layout.hsdp_enabled)
        else:  # (a pipeline's: always sharded, if over one rank)
            activations, buffers, peak = stage_peak(timeline, groups, layout.shard_size, accumulation, grads_whole,
                                                    copies, stages, pp_rank)
        muon_sent, muon_buffers = muon_exchange(matrices, rank)
        geometry = f"FSDP {cfg.parallel.shard_geometry}, align {cfg.parallel.align}"
        description = f"sharded ({describe_shape(layout)}; {geometry})"
    else:
        rank, shard, groups, matrices, muon_sent = 0, whole, [], [], 0
        params_bytes, grads = sum(whole.values()), grads_whole
        optimizer_bytes = optimizer_state(cfg, model, shard)
        activations, _, peak = timeline_peak(timeline, None, world, accumulation, grads_whole)
        buffers = grads_whole if layout.ddp else 0  # DDP's buckets
        muon_buffers = 0
        description = describe_shape(layout)
    if not sharded:
        peak += buffers
    if stages is not None:  # the schedule's receive buffers (planning/pipeline.py)
        n, rows, hidden = accumulation, cfg.training.micro_batch, whole_config["config"].get_text_config(decoder=True).hidden_size
        element = next(q.element_size() for q in params if q.is_floating_point())
        received = pipeline_buffers(stages, pp_rank, n, rows, seq_len, hidden, element, layout.cp_enabled)
        buffers, peak = buffers + received, peak + received
    target = torch.device("cuda") if on_gpu else device  # (where the run trains: clipping's transient)
    optimizer_step = grads + optimizer_step_transient(cfg, model, shard, sharded, muon_buffers, target)
    optimizer_step += 0 if sharded else buffers
    tensors = params_bytes + optimizer_bytes + max(peak, optimizer_step)
    build = params_bytes + sum(nbytes(b) for b in model.buffers()) + build_transient(cfg, model)
    tensors = max(tensors, build)

    ranks_per_node = device_model.ranks_per_node if device_model is not None else world
    collectives = step_collectives(cfg, layout, model, whole_config["config"], groups, grads_whole, accumulation,
                                   muon_sent, experts, ranks_per_node,
                                   None if stages is None else stage_calls(stages, pp_rank, accumulation, not isinstance(
                                       model.get_input_embeddings(), StageInput)))
    if stages is not None:
        collectives += stage_sends(stages, pp_rank, n, rows, seq_len, hidden, element,
                                   spans_nodes(layout.stage_world, 2, ranks_per_node), layout.cp_enabled)
    comm: dict[str, int] = {}
    by_dimension: dict[str, int] = {}
    by_kind: dict[str, int] = {}  # "dimension/kind", as the trainer's first step record has them (traffic.py)
    for c in collectives:
        comm[c.name] = comm.get(c.name, 0) + c.sent()
        by_dimension[c.dimension] = by_dimension.get(c.dimension, 0) + c.sent()
        by_kind[f"{c.dimension}/{c.kind}"] = by_kind.get(f"{c.dimension}/{c.kind}", 0) + c.sent()
    comm = {name: sent for name, sent in comm.items() if sent}
    by_dimension = {name: sent for name, sent in by_dimension.items() if sent}
    by_kind = {name: sent for name, sent in sorted(by_kind.items()) if sent}

    step_time = None
    if device_model is not None:
        step_time = _step_time(cfg, layout, model, whole_config, timeline.costs, accumulation, collectives, shard,
                               matrices, rank, sharded, device_model)

    unaccounted = []
    if not on_gpu:
        unaccounted += ["the dataset in memory (about 8 bytes per corpus token)",
                        "the allocator's slack (glibc keeps freed blocks resident)"]
    if cfg.training.compile != "none":
        unaccounted.append(f"training.compile {cfg.training.compile}: activations are eager's "
                           f"(a compiled layer keeps fewer)")
    if cfg.checkpoint.async_ and not on_gpu:
        unaccounted.append("checkpoint.async: a copy of parameters and optimizer state while a save is in flight")
    if cfg.low_precision.enabled:
        unaccounted.append("low_precision (MXFP8): activations planned as the unconverted model's; MXFP8 keeps fp8 "
                           "copies of inputs and weights instead (docs/lowp.md); its products timed at the device's MX "
                           "rate (its gathers and expert dispatch planned as MX data)")
    if layout.tp_enabled and cfg.parallel.sequence_parallel:
        unaccounted.append("sequence_parallel: activations planned as without it (the residual stream whole on "
                           "every tp rank: an overestimate)")
    if timeline.padded_attention:
        unaccounted.append("attention with value heads narrower than the query's (MLA): simulated as a fused kernel "
                           "on zero-padded values (what a GPU's memory-efficient kernel keeps, plus the padded output; "
                           "the value product counted at the padded width)")
    if layout.ep_enabled:
        unaccounted.append("expert parallelism: routing planned uniform (each rank receives its own tokens' share); "
                           "an imbalanced layer receives more")
    if layout.cp_enabled:
        unaccounted.append(f"context parallelism ({cfg.parallel.cp_mode}): the attention's exchange buffers")
    return Plan(
        family=cfg.model.family, n_params=whole_config["n_params"], world=world, layout=description, rank=rank,
        device=device_model.name if device_model is not None else device.type, micro_batch=cfg.training.micro_batch,
        seq_len=cfg.data.seq_len, accumulation=accumulation, recompute=cfg.parallel.recompute,
        mixed_precision=cfg.training.mixed_precision, fused_loss=cfg.training.fused_loss, compile=cfg.training.compile,
        optimizer_name=cfg.optimizer.name, params=params_bytes, grads=grads, optimizer=optimizer_bytes,
        activations=activations, buffers=buffers, tensors=tensors, runtime=runtime,
        comm_bytes_per_step=sum(comm.values()), build=build, comm=comm, unaccounted=tuple(unaccounted),
        mesh=layout.dims(), comm_by_dimension=by_dimension, comm_by_dimension_and_kind=by_kind, time=step_time,
        pipeline={} if stages is None else {"schedule": stages.schedule, "pp_rank": pp_rank,
                                            "stages": [list(bounds) for bounds in stages.layers],
                                            "stages_of_rank": stages.stages_of(pp_rank)},
    )


def _pipeline_plan(cfg: TrainConfig, stages: StageLayout, plans: list[Plan]) -> Plan:
    """The pipeline's plan from each pipeline rank's (one: a screened first stage, every stage
    taken as it): the memory of the rank holding the most, every rank's total beside them, the
    bytes of the rank sending the most, and the pipeline's step (planning/pipeline.py)."""
    figured = max(plans, key=lambda p: p.total)
    pipeline = {**figured.pipeline, "totals": [p.total for p in plans]}
    # (what is sent: the rank sending the most, as the trainer's counter reports it)
    sending = max(plans, key=lambda p: p.comm_bytes_per_step)
    figured = replace(figured, comm=sending.comm, comm_bytes_per_step=sending.comm_bytes_per_step,
                      comm_by_dimension=sending.comm_by_dimension,
                      comm_by_dimension_and_kind=sending.comm_by_dimension_and_kind)
    pipeline["comm_pp_rank"] = sending.pipeline["pp_rank"]
    if figured.time is None:
        return replace(figured, pipeline=pipeline)
    ranks = plans if len(plans) > 1 else plans * stages.pp
    work = [StageWork(p.time.predicted_step_s, p.time.compute_s / p.accumulation) for p in ranks]
    step, bubble = pipeline_step_s(work, stages.per_rank)
    slowest = max(ranks, key=lambda p: p.time.predicted_step_s).time
    tokens_per_s = cfg.training.global_batch * cfg.data.seq_len / step
    time = replace(slowest, predicted_step_s=step, bubble_s=bubble, tokens_per_s=tokens_per_s,
                   mfu=slowest.mfu * slowest.predicted_step_s / step)
    return replace(figured, pipeline=pipeline, time=time)


def _whole_config(cfg: TrainConfig, model: nn.Module, layout: MeshShape, layers: int | None) -> dict:
    """The whole model's parameter count, HF config and training FLOPs per token (the fake model is
    one rank's part)."""
    from hyperparallel.models.flops import training_flops_per_token

    whole = (model if not layout.tp_enabled and not layout.ep_enabled and not layout.pp_enabled and layers is None
             else meta_model(cfg))
    return {"n_params": sum(p.numel() for p in whole.parameters()), "config": whole.config,
            "flops_per_token": training_flops_per_token(whole, cfg.data.seq_len)}


def _step_time(cfg: TrainConfig, layout: MeshShape, model: nn.Module, whole: dict, costs: OpCosts, accumulation: int,
               collectives: list[Collective], shard: dict[int, int], matrices, rank: int, sharded: bool,
               device: DeviceModel) -> StepTime:
    trainable = [q for q in model.parameters() if q.requires_grad]
    shard_bytes = sum(shard[id(q)] for q in trainable)
    state = optimizer_state(cfg, model, shard)
    moved = 2 * shard_bytes + 3 * shard_bytes + 2 * state  # parameters r/w; gradients read, clipped (r/w); state r/w
    ns_flops = 0.0
    if cfg.optimizer.name == "muon":  # Newton-Schulz on the matrices this rank orthogonalizes
        owners = {id(q): owner for q, _, owner in matrices}  # (fsdp's row-split 2-D matrices: one owner each)
        for _, q in split_for_muon(model)[0]:
            small, large = sorted(q.shape[-2:])
            per_matrix = cfg.optimizer.ns_steps * (4 * small * small * large + 2 * small**3)
            if q.dim() == 2:
                ns_flops += per_matrix if owners.get(id(q), rank) == rank else 0
            else:  # a stack (the experts): each rank its shard's matrices
                ns_flops += per_matrix * (q.numel() // (small * large)) * shard[id(q)] / max(nbytes(q), 1)
    flops_per_token = whole["flops_per_token"]
    # (on the CPU nothing overlaps in the model: MegaMoE's all-to-alls count whole, as critical)
    megamoe = cfg.moe.implementation == "megamoe" and device.overlap
    moe_exposed = megamoe_exposed_s(cfg, layout, model, device) if megamoe else 0.0
    return predict(device=device, ops=costs, accumulation=accumulation, collectives=collectives,
                   optimizer_bytes_moved=moved, optimizer_flops=ns_flops, optimizer_ops=2 * len(trainable),
                   attention_factor=float(layout.cp), mx=cfg.low_precision.enabled, moe_exposed_s=moe_exposed,
                   tokens_per_step=cfg.training.global_batch * cfg.data.seq_len, model_flops_per_token=flops_per_token,
                   world=layout.world, compiled=cfg.training.compile != "none")


def describe_shape(shape: MeshShape) -> str:
    """The plan's name for a layout: `replicated`, `replicated (DDP)`, or its dimensions above 1."""
    if not shape.fsdp_enabled:
        return "replicated (DDP)" if shape.ddp else "replicated"
    return " x ".join(f"{name} {size}" for name, size in shape.dims().items() if size > 1)


def plan_total_bytes(cfg: TrainConfig, world: int, *, runtime: int | None = None) -> int:
    """The plan's total for one rank: what the trainer's peak_mem_bytes is compared with. A
    trainer passes `runtime` measured at its start (`runtime_bytes(cfg.training.compile)`)."""
    return plan(cfg, world, runtime=runtime).total

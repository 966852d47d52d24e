"""The model a plan runs: the trainer's model on the meta device (`meta_model`), its config cut
to its first layers for `plan_search`'s screening (`first_layers_config`), and the same model
with fake tensors, one rank's part of its layout (`fake_model`), which `timeline.simulate` runs
([Note: how the plan is made], planner.py); then its parameters tagged as the trainer's build
tags them for FSDP (`tag_as_built`), for the bytes their collectives move.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import set_gather_codec
from hyperparallel.lowp import convert
from hyperparallel.models import build_model, get_family, install_fused_loss
from hyperparallel.models.families import tensor_parallel_plan
from hyperparallel.models.kernels import use_kernels
from hyperparallel.parallel import apply_recompute
from hyperparallel.parallel.expert_parallel import keep_local_experts, routed_experts
from hyperparallel.parallel.mixed_precision import attach_mx_gather, keep_float32_outside_products
from hyperparallel.parallel.pipeline import StageLayout, hold_stages, stage_layout, tied_head
from hyperparallel.parallel.tensor_parallel import split_tensor_parallel
from hyperparallel.train.build import inline_model_config
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.data import tokenizer_vocab_size
from hyperparallel.train.preflight import model_problems


def meta_model(cfg: TrainConfig, tp: int = 1, layers: int | None = None) -> nn.Module:
    """The trainer's model on the meta device: shapes and dtypes, nothing allocated or initialized.
    Its config and vocabulary are checked as a run's are (`preflight.model_problems`). With `tp`
    > 1: one tensor-parallel rank's part, split by the plan the trainer runs
    (`parallel.tensor_parallel.split_tensor_parallel`); with `layers`: its first `layers` decoder
    layers only (`first_layers_config`)."""
    vocab = tokenizer_vocab_size(cfg.data, cfg.model.path)
    problems = model_problems(cfg, vocab)
    if problems:
        raise ConfigError("\n".join(problems))
    options = {"dtype": DTYPES[cfg.model.dtype], "attn_implementation": cfg.model.attention(), "materialize": False}
    if layers is None:
        model = build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, vocab), **options)
    else:
        whole = whole_model_config(cfg, vocab)
        first = first_layers_config(whole, layers, layer_count_key(cfg.model.family, whole))
        model = build_model(cfg.model.family, config=first, **options)
    if tp > 1:
        plan = tensor_parallel_plan(get_family(cfg.model.family), model)
        if isinstance(plan, str):
            raise ConfigError(f"parallel.tp: {cfg.model.family!r}: {plan}")
        split_tensor_parallel(model, plan, tp, 0, sequence_parallel=cfg.parallel.sequence_parallel)
    return model


def layer_count_key(family: str, config: dict) -> str:
    """The key of `config` (a model config's keys) that holds the decoder layer count:
    num_hidden_layers, or the config class's own name for it (GPT-2's n_layer)."""
    from hyperparallel.models import get_family

    if "num_hidden_layers" in config:
        return "num_hidden_layers"
    own = (getattr(get_family(family).config_class, "attribute_map", None) or {}).get("num_hidden_layers")
    return own if own in config else "num_hidden_layers"


def first_layers_config(config: dict, layers: int, key: str = "num_hidden_layers") -> dict:
    """The config of the model's first `layers` decoder layers (their per-layer lists cut to match;
    `key`: the layer count's, `layer_count_key`)."""
    whole = config.get(key)
    local = {**config, key: layers}
    for key, value in config.items():
        if isinstance(value, list) and len(value) == whole:  # (layer_types, mlp_layer_types, ...)
            local[key] = value[:layers]
    if isinstance(local.get("mlp_only_layers"), list):
        local["mlp_only_layers"] = [i for i in local["mlp_only_layers"] if i < layers]
    return local


def whole_model_config(cfg: TrainConfig, vocab: int) -> dict:
    """The model's config keys: the inline config, or model.path's."""
    if cfg.model.path is None:
        return inline_model_config(cfg, vocab)
    from hyperparallel.models.build import pretrained_config

    config = pretrained_config(cfg.model.family, cfg.model.path).to_dict()
    return {key: value for key, value in config.items() if key not in ("transformers_version", "architectures")}


def fake_model(cfg: TrainConfig, mode: FakeTensorMode, device: torch.device, tp: int = 1, ep: int = 1,
               layers: int | None = None, stages: StageLayout | None = None, pp_rank: int = 0) -> nn.Module:
    """The model the trainer trains, its tensors fake tensors of `mode` on `device` (meta storage:
    no bytes), with the fused kernels, the fused loss and recompute applied (MXFP8 and compilation
    are not). With `tp` and `ep`: one rank's part (the first expert-parallel rank's experts, the most
    when they do not divide), its MoE layers computing every routed row as a rank receiving its
    share under uniform routing does. With `stages`: what pipeline rank `pp_rank` holds of it, cut
    as the trainer cuts it (`parallel.pipeline.hold_stages`)."""
    model = meta_model(cfg, tp, layers)
    tied = tied_head(model)
    if stages is not None:
        held = hold_stages(model, stages, pp_rank)
    use_kernels(model, mega_gate=cfg.kernels.mega_gate, mega_mhc=cfg.kernels.mega_mhc)
    with mode:
        model.to_empty(device=device)
    # (to_empty made new Parameters: tied again, where this rank holds both the head and the embedding)
    if stages is None:
        model.tie_weights()
    elif tied and stages.stages - 1 in held:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if ep > 1:
        with mode:
            for experts, _ in routed_experts(model):
                keep_local_experts(experts, ep, 0)
    if cfg.training.fused_loss:
        install_fused_loss(model)  # (its element-wise work eager: compiled it keeps the same tensors)
    apply_recompute(model, cfg.parallel.recompute)
    return model


def pipeline_stages(cfg: TrainConfig, layers: int | None = None) -> StageLayout:
    """The pipeline's stages as the trainer splits the model (`parallel.pipeline.stage_layout`).
    With `layers` (plan_search's screening of the model's first layers): one first stage of them
    all, the others empty, which is what `planner.plan` screens every stage as."""
    p = cfg.parallel
    if layers is None:
        return stage_layout(meta_model(cfg), p.pp, p.pp_virtual_stages, p.pp_schedule, p.pp_layers)
    stages = p.pp * p.pp_virtual_stages
    return StageLayout(p.pp, p.pp_virtual_stages, p.pp_schedule, ((0, layers),) + ((layers, layers),) * (stages - 1))


def tag_as_built(cfg: TrainConfig, model: nn.Module, sharded: bool) -> nn.Module:
    """`model` (a fake model, its micro-batch already recorded) converted and tagged as
    train/build.py converts and tags the trainer's before sharding, so that its gathers and
    dispatches are planned in the forms the trainer's take: MXFP8's conversion (`lowp.convert`:
    the same Parameters, MXLinears and the experts' recipe, which decides their dispatch format;
    the recorded timeline stays the unconverted model's), under bf16 the products' parameters
    gathered in bf16 and the others in their own dtype (`keep_float32_outside_products`), and
    when `sharded` MXFP8 weights gathered as MX data (`attach_mx_gather`), but for a parameter
    held in more than one place (tied), which fsdp gives no codec (fsdp's ShardedParam.of).
    Safe to call again on the same model (plan_search's plans share one)."""
    convert(model, cfg.low_precision)
    if cfg.training.mixed_precision == "bf16":
        keep_float32_outside_products(model)
    if sharded and cfg.low_precision.enabled:
        attach_mx_gather(model)
        places: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            places[id(p)] = places.get(id(p), 0) + 1
        for p in model.parameters():
            if places[id(p)] > 1:
                set_gather_codec(p, None)  # (gathered as its values)
    return model

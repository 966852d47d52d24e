"""The Hugging Face model families hyperparallel builds, and what it needs to know about each.

A family ties a name (what a user writes in YAML) to the transformers config and model classes, the
`model_type` values a checkpoint's config.json may carry, the module classes that hold the MoE
experts and routers, so that other code can find them without matching on parameter names, and
the parallel plans it supports: its tensor-parallel plan as data (parallel_plan.py), which
`hyperparallel.parallel` applies, and whether context parallelism runs its attention.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from hyperparallel.kernels.router_groups import group_problem
from hyperparallel.moe import TopKRouter

from ..errors import ConfigError
from .parallel_plan import HEADS, KV_HEADS, REPLICATED, TensorParallelPlan, column, row
from .standins import stand_in

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig


@functools.cache
def _load(module: str, name: str) -> type:
    """transformers.models.MODULE's class NAME (its config from configuration_MODULE, every other
    class from modeling_MODULE), imported on first use."""
    kind = "configuration" if name.endswith("Config") else "modeling"
    return getattr(importlib.import_module(f"transformers.models.{module}.{kind}_{module}"), name)


@dataclass(frozen=True)
class ModelFamily:
    """The transformers classes are named (in the family's module, transformers.models.MODULE)
    and imported the first time one is asked for: names, model types and everything else here are
    known without importing transformers, so validating a config does not."""

    name: str
    model_types: tuple[str, ...]  # config.json `model_type` values this family loads
    module: str  # transformers.models.MODULE: where its classes are
    config: str  # the config class
    model: str  # the causal-LM class
    experts: tuple[str, ...] = ()  # hold 3-D gate_up_proj [E,2I,H] / down_proj [E,H,I]
    routers: tuple[str, ...] = ()  # `.weight` [E,H]; pick top-k experts per token
    moe_blocks: tuple[str, ...] = ()  # `gate`, `experts` (+ `shared_experts`): become MoEBlocks
    default_load_balance: str = "none"  # moe.load_balance when a config does not say
    check: Callable[[PretrainedConfig], None] | None = None  # raises ConfigError for shapes HF accepts but cannot run
    # Keys the modeling code reads with getattr although the config class declares no such field.
    extra_config_keys: tuple[str, ...] = ()
    attn_implementations: tuple[str, ...] = ("sdpa", "eager")  # what transformers' modeling code supports
    tensor_parallel: TensorParallelPlan | None = None  # how parallel.tp splits it; None: it has no TP plan
    context_parallel: bool = False  # its attention runs as parallel.cp's ring / Ulysses attention
    # None: packed documents whose position_ids restart at each one get each the loss it has alone
    # (transformers' masking_utils reads the restarts as a block-diagonal causal mask); else why
    # not, which the trainer gives when it refuses data.document_mask (tests/train/test_document_mask.py)
    document_mask: str | None = None

    @property
    def parallel_plans(self) -> tuple[str, ...]:
        """The layouts beyond FSDP and EP that it supports ("tp", "cp"), which a layout is checked against."""
        return ("tp",) * (self.tensor_parallel is not None) + ("cp",) * self.context_parallel

    @property
    def config_class(self) -> type[PretrainedConfig]:
        return _load(self.module, self.config)

    @property
    def model_class(self) -> type[PreTrainedModel]:
        return _load(self.module, self.model)

    @property
    def experts_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(_load(self.module, name) for name in self.experts)

    @property
    def router_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(_load(self.module, name) for name in self.routers)

    @property
    def moe_block_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(_load(self.module, name) for name in self.moe_blocks)


def _check_attention_heads(config: PretrainedConfig) -> None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads is not None and (kv_heads <= 0 or heads % kv_heads):
        raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")


def _check_qwen3_moe(config: Qwen3MoeConfig) -> None:
    _check_attention_heads(config)
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ConfigError(
            f"num_experts_per_tok ({config.num_experts_per_tok}) must be in 1..num_experts ({config.num_experts})"
        )


def _check_deepseek_v3(config: DeepseekV3Config) -> None:
    _check_attention_heads(config)
    problem = group_problem(config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok,
                            ("n_routed_experts", "n_group", "topk_group", "num_experts_per_tok"))
    if problem is not None:
        raise ConfigError(problem)


def _check_deepseek_v4(config: DeepseekV4Config) -> None:
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok ({top_k}) must be in 1..n_routed_experts ({experts})")
    heads, groups = config.num_attention_heads, config.o_groups
    if groups <= 0 or heads % groups:
        raise ConfigError(f"o_groups ({groups}) must divide num_attention_heads ({heads}): the grouped output "
                          f"projection splits the heads into o_groups groups")
    if config.hc_mult < 1 or config.hc_sinkhorn_iters < 1:
        raise ConfigError(f"hc_mult ({config.hc_mult}) and hc_sinkhorn_iters ({config.hc_sinkhorn_iters}) must be >= 1")


# Grouped-query attention (Qwen3, Qwen3-MoE): query heads split over tp, each rank holding the
# key/value heads its query heads use (shared over ranks when there are fewer than tp); the
# per-head q_norm / k_norm whole on every rank.
_GROUPED_QUERY_PLAN = TensorParallelPlan(
    attention=(
        ("q_proj", column(HEADS, "head_dim")),
        ("k_proj", column(KV_HEADS, "head_dim")),
        ("v_proj", column(KV_HEADS, "head_dim")),
        ("o_proj", row(HEADS, "head_dim")),
        ("q_norm", REPLICATED),
        ("k_norm", REPLICATED),
    ),
    kv_groups="num_key_value_groups",
)

# Multi-head latent attention (DeepSeek-V3, Kimi K2): the up-projections split by heads (the
# query's, and each head's nope-key and value rows); the low-rank down-projections, their norms
# and the shared rotary key whole on every rank. Dense MLPs and the shared experts split alike.
_LATENT_ATTENTION_PLAN = TensorParallelPlan(
    attention=(
        ("q_b_proj|q_proj", column(HEADS, "qk_head_dim")),  # q_proj without a query LoRA (q_lora_rank None)
        ("kv_b_proj", column(HEADS, "qk_nope_head_dim", "v_head_dim")),
        ("o_proj", row(HEADS, "v_head_dim")),
        ("q_a_proj", REPLICATED),
        ("q_a_layernorm", REPLICATED),
        ("kv_a_proj_with_mqa", REPLICATED),
        ("kv_a_layernorm", REPLICATED),
    ),
    shared_experts="shared_experts",
)

FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        model_types=("qwen3",),
        module="qwen3",
        config="Qwen3Config",
        model="Qwen3ForCausalLM",
        check=_check_attention_heads,
        tensor_parallel=_GROUPED_QUERY_PLAN,
        context_parallel=True,
    ),
    "qwen3_moe": ModelFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        module="qwen3_moe",
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",
        experts=("Qwen3MoeExperts",),
        routers=("Qwen3MoeTopKRouter",),
        moe_blocks=("Qwen3MoeSparseMoeBlock",),
        default_load_balance="aux_loss",
        check=_check_qwen3_moe,
        # Qwen3-MoE checkpoints set head_dim (128 in Qwen3-30B-A3B, not hidden / heads = 64).
        extra_config_keys=("head_dim",),
        tensor_parallel=_GROUPED_QUERY_PLAN,
        context_parallel=True,
    ),
    # Kimi K2 is the DeepSeek-V3 architecture with other sizes; its config.json says "kimi_k2".
    "deepseek_v3": ModelFamily(
        name="deepseek_v3",
        model_types=("deepseek_v3", "kimi_k2"),
        module="deepseek_v3",
        config="DeepseekV3Config",
        model="DeepseekV3ForCausalLM",
        experts=("DeepseekV3Experts",),
        routers=("DeepseekV3TopkRouter",),
        moe_blocks=("DeepseekV3MoE",),
        default_load_balance="bias",
        check=_check_deepseek_v3,
        tensor_parallel=_LATENT_ATTENTION_PLAN,
        context_parallel=True,
    ),
    # Manifold-constrained hyper-connections, sqrt-softplus routers (the first layers hash-routed),
    # clamped SwiGLU experts, compressed sparse attention with sinks (eager attention only).
    "deepseek_v4": ModelFamily(
        name="deepseek_v4",
        model_types=("deepseek_v4",),
        module="deepseek_v4",
        config="DeepseekV4Config",
        model="DeepseekV4ForCausalLM",
        experts=("DeepseekV4Experts",),
        routers=("DeepseekV4TopKRouter", "DeepseekV4HashRouter"),
        moe_blocks=("DeepseekV4SparseMoeBlock",),
        default_load_balance="bias",
        check=_check_deepseek_v4,
        attn_implementations=("eager",),  # (no TP or CP plan: its attention is transformers' eager code alone)
        document_mask=(
            "its compressed attention (the compressed_sparse_attention and heavily_compressed_attention "
            "layers) compresses a row in windows counted from the row's first token and lets a token see "
            "the compressed entries 0 .. (position_id + 1) // compress_rate - 1, so with positions "
            "restarting at each document a later document reads the first one's entries (and windows "
            "straddle documents)"
        ),
    ),
}

ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def family_names() -> list[str]:
    """Every name `get_family` accepts, aliases included."""
    return sorted([*FAMILIES, *ALIASES])


def get_family(name: str) -> ModelFamily:
    """The family of that name; an alias gets its target's entry under the alias's name (for messages)."""
    family = FAMILIES.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if family is None:
        raise ConfigError(f"unknown model family {name!r}; expected one of {', '.join(family_names())}")
    return family if family.name == name else replace(family, name=name)


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """The family whose checkpoints carry this config.json `model_type`, or None."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def all_experts_classes() -> tuple[type[nn.Module], ...]:
    return tuple(cls for family in FAMILIES.values() for cls in family.experts_classes)


def all_router_classes() -> tuple[type[nn.Module], ...]:
    return tuple(cls for family in FAMILIES.values() for cls in family.router_classes)


def all_moe_block_classes() -> tuple[type[nn.Module], ...]:
    return tuple(cls for family in FAMILIES.values() for cls in family.moe_block_classes)


def router_from_hf(router: nn.Module) -> TopKRouter:
    """Our TopKRouter holding a transformers router's weight (and correction bias) objects."""
    if isinstance(router, TopKRouter):
        return router
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if isinstance(router, Qwen3MoeTopKRouter):
        options = {"score": "softmax", "norm_topk_prob": router.norm_topk_prob}
    elif isinstance(router, DeepseekV3TopkRouter):
        options = {"score": "sigmoid", "norm_topk_prob": router.norm_topk_prob, "num_groups": router.num_group,
                   "top_groups": router.topk_group, "routed_scaling_factor": router.routed_scaling_factor,
                   "correction_bias": True, "float32_logits": True}
    elif isinstance(router, DeepseekV4TopKRouter):  # always renormalized, with the 1e-20 of sigmoid's
        options = {"score": "sqrtsoftplus", "routed_scaling_factor": router.routed_scaling_factor,
                   "correction_bias": True}
    elif isinstance(router, DeepseekV4HashRouter):
        options = {"score": "sqrtsoftplus", "routed_scaling_factor": router.routed_scaling_factor,
                   "hash_vocab_size": router.tid2eid.shape[0]}
    else:
        raise NotImplementedError(f"no TopKRouter for {type(router).__name__}")
    with torch.device("meta"):
        ours = TopKRouter(router.hidden_dim, router.num_experts, router.top_k, **options)
    ours.weight = router.weight
    if options.get("correction_bias"):
        ours.e_score_correction_bias = router.e_score_correction_bias
    if "hash_vocab_size" in options:
        ours.tid2eid = router.tid2eid
    return stand_in(ours, router)

"""The Hugging Face causal LMs hyperparallel trains, and what it needs to know about each.

Every text decoder-only type of transformers' causal-LM mapping is a family (models/catalog.py
says which types those are): its name is its `model_type`, its config and causal-LM classes are
the ones transformers' Auto classes map it to, and everything else is read from the model itself
where it is used: its decoder layers (layers.py), its `@use_experts_implementation` experts
(swapped for hyperparallel.moe's GroupedExperts, moe_blocks.py), transformers' own
tensor-parallel plan, the attention implementations its class supports. A new architecture
trains the day transformers ships it.

Four families are tuned beyond that, each an entry of FAMILIES that adds what transformers does
not declare or what makes it faster: Qwen3, Qwen3-MoE, DeepSeek-V3 (Kimi K2) and DeepSeek-V4. An
entry names its MoE blocks and routers (which become hyperparallel.moe's MoEBlock and TopKRouter:
MegaGate, our load balancing), its config checks, its tensor-parallel plan's additions where
transformers' does not cover its attention, and what it cannot do, with the reason.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import nn

from hyperparallel.kernels.router_groups import group_problem

from ..errors import ConfigError
from .catalog import causal_lm_types, left_out
from .layers import layer_configs

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

# A tuned family's router class -> the options of the TopKRouter that computes what it computes.
RouterOptions = Callable[[nn.Module], dict]


@dataclass(frozen=True)
class ModelFamily:
    """The transformers classes are named and imported the first time one is asked for: names,
    model types and everything else here are known without importing transformers' models."""

    name: str  # what model.family says: the model_type (or an alias: kimi_k2)
    model_types: tuple[str, ...]  # config.json `model_type` values this family loads
    config: str  # the config class (a name transformers exports)
    model: str  # the causal-LM class (a name transformers exports)
    module: str | None = None  # transformers.models.MODULE: where a tuned family's MoE classes are
    routers: tuple[tuple[str, RouterOptions], ...] = ()  # (router class, our TopKRouter's options for it)
    moe_blocks: tuple[str, ...] = ()  # `gate`, `experts` (+ `shared_experts`): become MoEBlocks
    default_load_balance: str | None = None  # moe.load_balance when a config does not say (None: the model's)
    check: Callable[[PretrainedConfig], None] | None = None  # raises ConfigError for shapes HF accepts but cannot run
    # Keys the modeling code reads with getattr although the config class declares no such field.
    extra_config_keys: tuple[str, ...] = ()
    attn_implementations: tuple[str, ...] | None = None  # what its modeling code supports (None: its class says)
    # parallel.tp's plan, in transformers' style names by module pattern (base_model_tp_plan's form):
    # None: transformers' own; a dict: entries added to it (what its attention needs, say); a str:
    # why it has none
    tensor_parallel: dict[str, str] | str | None = None
    # why its attention cannot run as parallel.cp's ring / Ulysses attention (None: the model decides:
    # parallel.context_parallel's `context_parallel_problem`)
    context_parallel: str | None = None
    # None: packed documents whose position_ids restart at each one get each the loss it has alone
    # (transformers' masking_utils reads the restarts as a block-diagonal causal mask); else why
    # not, which the trainer gives when it refuses data.document_mask (tests/train/test_document_mask.py)
    document_mask: str | None = None
    # why its training forward is random by design (runs over different ranks, each its own random
    # stream, cannot give one process's losses), or None
    random_in_training: str | None = None
    hyper_connected: bool = False  # its decoder layers are DeepSeek-V4's hyper-connected ones (MegaMHC runs them)

    @property
    def config_class(self) -> type[PretrainedConfig]:
        return _exported(self.config)

    @property
    def model_class(self) -> type[PreTrainedModel]:
        return _exported(self.model)

    @property
    def attention_implementations(self) -> tuple[str, ...]:
        """What its modeling code runs, the first the default: sdpa where the class supports it."""
        if self.attn_implementations is not None:
            return self.attn_implementations
        return ("sdpa", "eager") if getattr(self.model_class, "_supports_sdpa", False) else ("eager",)

    @property
    def router_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(_load(self.module, name) for name, _ in self.routers)

    @property
    def moe_block_classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(_load(self.module, name) for name in self.moe_blocks)


def _exported(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def _load(module: str, name: str) -> type:
    """transformers.models.MODULE's modeling class NAME, imported on first use."""
    import importlib

    return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)


def _check_attention_heads(config: PretrainedConfig) -> None:
    """Grouped-query attention's heads fit together (transformers builds a model where they do
    not, which fails only at its first forward); per layer where the config lets them vary."""
    for layer in layer_configs(config.get_text_config(decoder=True)):
        heads, kv_heads = getattr(layer, "num_attention_heads", None), getattr(layer, "num_key_value_heads", None)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (heads, kv_heads)):
            continue  # (a model without grouped-query attention, or one that derives the counts itself)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads "
                              f"({kv_heads})")


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


def _softmax_router(router: nn.Module) -> dict:  # Qwen3-MoE
    return {"score": "softmax", "norm_topk_prob": router.norm_topk_prob}


def _grouped_sigmoid_router(router: nn.Module) -> dict:  # DeepSeek-V3, Kimi K2
    return {"score": "sigmoid", "norm_topk_prob": router.norm_topk_prob, "num_groups": router.num_group,
            "top_groups": router.topk_group, "routed_scaling_factor": router.routed_scaling_factor,
            "correction_bias": True, "float32_logits": True}


def _sqrt_softplus_router(router: nn.Module) -> dict:  # DeepSeek-V4: always renormalized, with sigmoid's 1e-20
    return {"score": "sqrtsoftplus", "routed_scaling_factor": router.routed_scaling_factor, "correction_bias": True}


def _hash_router(router: nn.Module) -> dict:  # DeepSeek-V4's first layers
    return {"score": "sqrtsoftplus", "routed_scaling_factor": router.routed_scaling_factor,
            "hash_vocab_size": router.tid2eid.shape[0]}


# Multi-head latent attention (DeepSeek-V3, Kimi K2), which transformers' plan leaves out (up to
# 5.24; from 5.25 it has these entries, with "mla_kv_a_proj": replicated, and its own win): the
# up-projections split by heads (the query's, and each head's nope-key and value rows); the
# low-rank down-projections, their norms and the shared rotary key whole on every rank.
# (transformers' plan splits the dense MLPs and the shared experts.)
_LATENT_ATTENTION_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",  # without a query LoRA (q_lora_rank None)
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.q_a_proj": "replicated_with_grad_allreduce",
    "layers.*.self_attn.q_a_layernorm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.kv_a_proj_with_mqa": "replicated_with_grad_allreduce",
    "layers.*.self_attn.kv_a_layernorm": "replicated_with_grad_allreduce",
}

FAMILIES: dict[str, ModelFamily] = {
    "qwen3": ModelFamily(
        name="qwen3",
        model_types=("qwen3",),
        config="Qwen3Config",
        model="Qwen3ForCausalLM",
        check=_check_attention_heads,
    ),
    "qwen3_moe": ModelFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        module="qwen3_moe",
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",
        routers=(("Qwen3MoeTopKRouter", _softmax_router),),
        moe_blocks=("Qwen3MoeSparseMoeBlock",),
        default_load_balance="aux_loss",
        check=_check_qwen3_moe,
        # Qwen3-MoE checkpoints set head_dim (128 in Qwen3-30B-A3B, not hidden / heads = 64).
        extra_config_keys=("head_dim",),
    ),
    # Kimi K2 is the DeepSeek-V3 architecture with other sizes; its config.json says "kimi_k2".
    "deepseek_v3": ModelFamily(
        name="deepseek_v3",
        model_types=("deepseek_v3", "kimi_k2"),
        module="deepseek_v3",
        config="DeepseekV3Config",
        model="DeepseekV3ForCausalLM",
        routers=(("DeepseekV3TopkRouter", _grouped_sigmoid_router),),
        moe_blocks=("DeepseekV3MoE",),
        default_load_balance="bias",
        check=_check_deepseek_v3,
        tensor_parallel=_LATENT_ATTENTION_PLAN,
    ),
    # Manifold-constrained hyper-connections, sqrt-softplus routers (the first layers hash-routed),
    # clamped SwiGLU experts, compressed sparse attention with sinks (eager attention only).
    "deepseek_v4": ModelFamily(
        name="deepseek_v4",
        model_types=("deepseek_v4",),
        module="deepseek_v4",
        config="DeepseekV4Config",
        model="DeepseekV4ForCausalLM",
        routers=(("DeepseekV4TopKRouter", _sqrt_softplus_router), ("DeepseekV4HashRouter", _hash_router)),
        moe_blocks=("DeepseekV4SparseMoeBlock",),
        default_load_balance="bias",
        check=_check_deepseek_v4,
        attn_implementations=("eager",),
        tensor_parallel=("its compressed sparse attention and hyper-connections have no tensor-parallel plan "
                         "(transformers' covers its experts only)"),
        context_parallel="its compressed sparse attention with sinks is transformers' eager code alone",
        hyper_connected=True,
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

# What transformers does not declare about a generic family: a training forward that is random by
# design (ModelFamily.random_in_training)
RANDOM_IN_TRAINING: dict[str, str] = {
    "phimoe": "its training-time routing samples the experts (sparsemixer's Gumbel sampling)",
}


def family_names() -> list[str]:
    """The tuned families' names, aliases included (every text decoder-only model_type of
    transformers is a family too: `catalog.text_decoder_types()`)."""
    return sorted([*FAMILIES, *ALIASES])


def get_family(name: str) -> ModelFamily:
    """The family of that name: a tuned entry (an alias gets its target's entry under the alias's
    name, for messages), or the generic family of that transformers model_type."""
    if not isinstance(name, str):
        raise ConfigError(f"model.family must be a model_type name; got {name!r}")
    family = FAMILIES.get(ALIASES.get(name, name))
    if family is not None:
        return family if family.name == name else replace(family, name=name)
    if name not in causal_lm_types():
        known = sorted({*family_names(), *causal_lm_types()})
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"model type {name!r} is no causal LM transformers knows{hint} (model.family names a "
                          f"model_type of transformers' causal-LM classes, such as llama, mixtral or qwen3_moe)")
    reason = left_out(name)
    if reason is not None:
        raise ConfigError(f"model type {name!r} is {reason}: the trainer trains text decoder-only causal LMs")
    config, model = causal_lm_types()[name]
    # (a type may share another's config class: gpt-sw3's config.json says gpt2)
    own = getattr(_exported(config), "model_type", name)
    return ModelFamily(name=name, model_types=tuple(dict.fromkeys((name, own))), config=config, model=model,
                       check=_check_attention_heads, random_in_training=RANDOM_IN_TRAINING.get(name))


def family_for_model_type(model_type: str) -> ModelFamily | None:
    """The family whose checkpoints carry this config.json `model_type` (a tuned entry first), or
    None where it is no text decoder-only causal LM of transformers."""
    tuned = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if tuned is not None:
        return tuned
    if isinstance(model_type, str) and model_type in causal_lm_types() and left_out(model_type) is None:
        return get_family(model_type)
    return None


def all_moe_block_classes() -> tuple[type[nn.Module], ...]:
    return tuple(cls for family in FAMILIES.values() for cls in family.moe_block_classes)



def computes_aux_loss(model: nn.Module) -> bool:
    """Whether transformers' model adds an auxiliary load-balancing loss of its own to the loss it
    returns when asked (`output_router_logits`): its config declares `router_aux_loss_coef`."""
    config = getattr(model, "config", None)
    return config is not None and "router_aux_loss_coef" in getattr(type(config), "__dataclass_fields__", {}) \
        and hasattr(model, "router_aux_loss_coef")


def load_balance_rule(family: ModelFamily, model: nn.Module) -> str:
    """moe.load_balance when a config does not say: the tuned family's rule; for any other MoE
    model, transformers' auxiliary loss where its model computes one, DeepSeek-V3's bias update
    where its routers carry a correction bias, none otherwise."""
    from hyperparallel.moe.balance import balanced_layers

    if family.default_load_balance is not None:
        return family.default_load_balance
    layers = balanced_layers(model)
    if layers and computes_aux_loss(model):
        return "aux_loss"
    if layers and all(layer.bias_owner is not None for layer in layers):
        return "bias"
    return "none"


def tensor_parallel_plan(family: ModelFamily, model: nn.Module) -> dict[str, str] | str:
    """`model`'s tensor-parallel plan (module name pattern -> transformers' style, as the model's
    `_tp_plan` names them), or why it has none: transformers' own plan, with the family's additions
    where it has no entry (transformers 5.25 declares DeepSeek-V3's latent attention itself)."""
    if isinstance(family.tensor_parallel, str):
        return family.tensor_parallel
    plan = dict(getattr(model, "_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    for key, style in (family.tensor_parallel or {}).items():
        plan.setdefault(f"{prefix}.{key}" if prefix else key, style)
    if not plan:
        return "transformers declares no tensor-parallel plan for it"
    return plan

"""Training FLOPs per token of a causal LM, read from its modules: the denominator-free half of MFU.

The model is whole (not sharded) and usually on the meta device: only module attributes,
parameter shapes and the config are read; nothing is allocated and nothing runs.

Counted, x6 (2 for the forward multiply-add, 4 for the two backward matmuls), each matrix a token
passes through, by its number of multiply-accumulates:
- every nn.Linear (subclasses too), every module that is one in all but name (`in_features`,
  `out_features` and a 2-D `weight`: lowp's MXLinear, the fused loss's FusedLossHead), and
  transformers' Conv1D (GPT-2's [in, out] weight); the lm_head included, tied to the embedding or not;
- routed experts, modules holding 3-D expert weights ([E, ...]: transformers' experts classes,
  `is_transposed` or not, and moe's GroupedExperts): their 3-D weights x top_k / E, as a token
  uses top_k of the E experts; top_k is the router's (or the MoE block's), else the config's;
- routers kept as a bare [E, H] `weight` Parameter beside the experts (a Linear router is a Linear);
  shared experts are ordinary Linears, counted whole;
- raw projection Parameters that modules apply with F.linear, named per class in `_RAW_PROJECTIONS`
  (DeepSeek-V4's hyper-connections).
Not counted: embeddings, norms, biases, activations, rotary embedding, softmax, depthwise
convolutions and state-space scans (element-wise, a small fraction), and the idle experts.

Attention scores (Q K^T) and values (P V) add, per attention layer, 2 x (qk width + v width) per
attended key in the forward, x3 for training, where a width is heads x head dim. With `causal` a
query attends on average to half the keys, so that term is halved (the work a causal kernel does;
PaLM's 12·L·T·width omits the halving). A sliding-window layer attends to min(seq_len, window)
keys, halved the same way. Attention layers are the innermost modules whose class name ends with
"Attention" or that a layer holds as `self_attn` (or `attn`, `attention`), but for linear attention
(layer type "linear_attention") and modules whose heads neither they nor the config state (RWKV's
time mixing): those have no quadratic term, nor do state-space layers (Mamba), which are not named
so. Heads and head dims are the module's (`num_heads`, `head_dim`, MLA's `qk_head_dim` and
`v_head_dim`), else the config's (`num_attention_heads`, `head_dim`, else hidden / heads). The
window is the one the module hands its kernel (`sliding_window`, per layer), else the config's for
its layer type. Extra keys a class attends to beyond its window are in `_EXTRA_KEYS` (DeepSeek-V4's
compressed entries).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from torch import nn
from transformers import PretrainedConfig
from transformers.pytorch_utils import Conv1D

from ..errors import ConfigError
from .layers import attention_window, config_value, layer_type, positive_int, text_config

# The spellings of "experts per token" in transformers' configs, read when neither the router nor
# the MoE block holds top_k (most configs map theirs to num_experts_per_tok in attribute_map).
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "num_experts_per_token", "moe_k", "top_k")
# Layer types whose token mixing is linear in the sequence (gated delta nets, lightning attention, Mamba).
_LINEAR_LAYER_TYPES = frozenset({"linear_attention"})
# Where transformers' decoder layers keep their attention, whatever its class is called.
_ATTENTION_NAMES = frozenset({"self_attn", "attn", "attention", "self_attention"})


def training_flops_per_token(model: nn.Module, seq_len: int, *, causal: bool = True) -> float:
    """6 x matmul parameters a token passes through + attention score/value FLOPs, for sequences of
    seq_len, of a whole causal LM (meta device is enough: shapes only)."""
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive; got {seq_len}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"training_flops_per_token reads a model's modules (an nn.Module, on the meta device is "
                          f"enough); got {type(model).__name__}")
    config = text_config(model)
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    matmuls = sum(_matmul_parameters(module, parents, config) for module in model.modules())
    per_query = 0.5 if causal else 1.0
    attention = sum(_attention_flops(module, config, seq_len, per_query) for module in _attention_modules(model))
    return 6.0 * matmuls + attention


# ---- matmul parameters -------------------------------------------------------------------------


def _matmul_parameters(module: nn.Module, parents: dict, config: PretrainedConfig | None) -> float:
    """Multiply-accumulates per token of this module's own weights (not its children's)."""
    if _is_linear(module):
        return module.weight.numel()
    if _is_routed_experts(module):
        weights = _expert_weights(module)
        return sum(w.numel() for w in weights) * _top_k(module, parents, config) / weights[0].shape[0]
    if _is_router(module, parents):
        return module.weight.numel()
    return sum(getattr(module, name).numel() for name in _class_rule(_RAW_PROJECTIONS, module, ()))


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, (nn.Linear, Conv1D)):
        return True
    # lowp's MXLinear and the fused loss's head hold a Linear's Parameters without subclassing it
    weight = getattr(module, "weight", None)
    sized = all(isinstance(getattr(module, name, None), int) for name in ("in_features", "out_features"))
    return sized and isinstance(weight, nn.Parameter) and weight.dim() == 2


def _expert_weights(module: nn.Module) -> list[nn.Parameter]:
    # [E, out, in] or, transposed, [E, in, out]; the experts' biases are 2-D and not counted
    return [p for p in module.parameters(recurse=False) if p.dim() == 3]


def _is_routed_experts(module: nn.Module) -> bool:
    # transformers' @use_experts_implementation sets is_transposed; GroupedExperts has num_experts
    # (3-D shared experts, which every token uses, have neither and are counted by a class rule)
    return bool(_expert_weights(module)) and (hasattr(module, "num_experts") or hasattr(module, "is_transposed"))


def _is_router(module: nn.Module, parents: dict) -> bool:
    """A bare [E, H] weight beside routed experts (its MoE block's gate or router)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or module not in parents:
        return False
    return any(_is_routed_experts(sibling) for sibling in parents[module].children())


def top_k_of(model: nn.Module, experts: nn.Module) -> int:
    """How many of `experts` (a routed experts module of `model`) a token uses."""
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    return _top_k(experts, parents, text_config(model))


def _top_k(experts: nn.Module, parents: dict, config: PretrainedConfig | None) -> int:
    """How many of `experts` a token uses: its router's, its MoE block's, its own, or the config's."""
    block = parents.get(experts)
    holders = [experts] if block is None else [*block.children(), block, experts]
    for holder, name in itertools.product(holders, ("top_k", "num_experts_per_tok")):
        value = positive_int(getattr(holder, name, None))
        if value is not None:
            return value
    for holder in (getattr(experts, "config", None), config):
        for key in _TOP_K_KEYS:
            value = positive_int(getattr(holder, key, None))
            if value is not None:
                return value
    raise ConfigError(f"cannot tell how many of {type(experts).__name__}'s experts a token uses: neither its "
                      f"router nor its MoE block has top_k, and the config has none of {', '.join(_TOP_K_KEYS)}")


# ---- attention scores and values ---------------------------------------------------------------


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules of a class named *Attention or held as a layer's `self_attn` (or its list's items:
    LongCat-Flash's two MLAs), the innermost where they nest (BERT-style wrappers hold the real one)."""
    found = {}
    for name, module in model.named_modules():
        *above, last = name.split(".")
        held = last in _ATTENTION_NAMES or (last.isdigit() and bool(above) and above[-1] in _ATTENTION_NAMES)
        held = held and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if type(module).__name__.endswith("Attention") or held:
            found[id(module)] = module
    nests = {id(m): any(id(inner) in found for inner in itertools.islice(m.modules(), 1, None)) for m in found.values()}
    return [m for m in found.values() if not nests[id(m)]]


def _attention_flops(module: nn.Module, config: PretrainedConfig | None, seq_len: int, per_query: float) -> float:
    config = _module_config(module, config)
    if layer_type(module, config) in _LINEAR_LAYER_TYPES:
        return 0.0
    widths = _widths(module, config)
    if widths is None:
        return 0.0
    window = attention_window(module, config)
    keys = (seq_len if window is None else min(seq_len, window)) * per_query
    extra = _class_rule(_EXTRA_KEYS, module, None)
    if extra is not None:
        keys += extra(module, seq_len, per_query)
    return 6.0 * keys * sum(widths)


def _widths(module: nn.Module, config: PretrainedConfig | None) -> tuple[int, int] | None:
    """(heads x qk head dim, heads x v head dim): the module's own figures, else the config's; None
    when neither states the heads."""
    heads = _first_int(module, "num_heads", "num_attention_heads") or _first_int(config, "num_attention_heads")
    if heads is None:
        return None
    hidden = _first_int(config, "hidden_size")
    even = hidden // heads if hidden else None
    # multi-head latent attention states qk_head_dim (nope + rope) and v_head_dim apart
    qk = _first_int(module, "qk_head_dim", "head_dim") or _first_int(config, "head_dim") or even
    v = _first_int(module, "v_head_dim", "head_dim") or _first_int(config, "v_head_dim", "head_dim") or even
    if qk is None or v is None:
        return None
    return heads * qk, heads * v


# ---- per-class rules ---------------------------------------------------------------------------
# What the shapes alone do not say, keyed by class name (matched along the MRO, so subclasses and
# moe's stand-ins follow their class); never by model_type. A family module may own its entries.


def _deepseek_v4_compressed_entries(attention: nn.Module, seq_len: int, per_query: float) -> float:
    """DeepSeek-V4: beyond its window a query attends to compressed KV entries, one per
    compress_rate tokens: all of them (causally, half) in HCA layers, at most the indexer's
    index_topk in CSA layers. The indexer's own scores over the entries are not counted."""
    compressor = getattr(attention, "compressor", None)
    if compressor is None:  # a sliding-only layer
        return 0.0
    entries = seq_len / compressor.compress_rate * per_query
    indexer = getattr(compressor, "indexer", None)
    return entries if indexer is None else min(indexer.index_topk, entries)


# Raw Parameters a class applies as matmuls: the hyper-connections' projections of the hc_mult
# streams to their pre / post / comb weights, and the head's collapse (MegaMHC's keep the names);
# shared experts kept as 3-D stacks.
_RAW_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "DeepseekV4HyperConnection": ("fn",),
    "DeepseekV4HyperHead": ("hc_fn",),
    "MegaHyperConnection": ("fn",),
    "MegaHyperHead": ("hc_fn",),
    "HYV4HyperConnection": ("fn",),
    "HYV4HyperHead": ("hc_fn",),
    "InklingSharedExperts": ("gate_proj", "up_proj", "down_proj"),  # [n_shared, ...], every token through all
}
# Keys an attention class attends to beyond its window: f(module, seq_len, per_query).
_EXTRA_KEYS: dict[str, Callable[[nn.Module, int, float], float]] = {
    "DeepseekV4Attention": _deepseek_v4_compressed_entries,
}


def _class_rule(table: dict, module: nn.Module, default):
    for cls in type(module).__mro__:
        if cls.__name__ in table:
            return table[cls.__name__]
    return default


# ---- reading configs and attributes ------------------------------------------------------------


def _module_config(module: nn.Module, config: PretrainedConfig | None) -> PretrainedConfig | None:
    # a module's own config is its layer's (a multimodal model's text config, a per-layer config)
    own = getattr(module, "config", None)
    return own if isinstance(own, PretrainedConfig) else config


def _first_int(holder, *names: str) -> int | None:
    if holder is None:
        return None
    for name in names:
        value = positive_int(config_value(holder, name))
        if value is not None:
            return value
    return None

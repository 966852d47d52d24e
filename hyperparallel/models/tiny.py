"""A tiny config of any causal-LM type transformers ships: what the coverage sweep
(scripts/model_coverage.py) and the tests of the generic families build.

The sizes are set by their common names (hidden_size, num_hidden_layers, ...) and given by the
config class's own field names (a class that spells one otherwise maps it in its `attribute_map`;
the field is what its `__post_init__` reads), so one table serves every type. Per-layer lists
(layer_types, mlp_layer_types, ...) keep one layer of each kind the full model has, in their order
(a hybrid stays hybrid: sliding and full attention, linear and full, mamba and attention, dense
and MoE), and `num_hidden_layers` becomes that count (at least the table's two). Multi-head
latent attention has a key/value head per query head. Sub-configs (a nested text, attention or
FFN config) are made tiny the same way and given as dicts. Sliding windows and attention chunks
are shorter than a test batch, every dropout is off (so that a tiny run's numbers are the same on
any layout) and token ids stay in the vocabulary. What a family's config needs beyond the table
(its own validators' relations, layer patterns it derives from other keys) is in `_OVERRIDES`, by
model_type. Nothing here is read by training itself.
"""

from __future__ import annotations

from .build import declared_config_keys

# Small but not degenerate: 4 heads over 2 key/value heads (TP 2 splits both), 8 experts of
# which 2 chosen (EP 2 holds 4 each), two layers (FSDP shards two decoder groups).
SIZES: dict[str, object] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "dim_head": 16,  # (CPM-Ant's)
    "intermediate_size": 128,
    "ffn_dim": 128,  # (the MLP's width by other names: OPT and XGLM, CTRL, CPM-Ant, Llama 4's dense layers)
    "dff": 128,
    "dim_ff": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "max_position_embeddings": 512,
    "rotary_dim": 8,  # partial rotary (half of a 16-wide head), as GPT-J and CodeGen have it
    # MoE
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    # multi-head latent attention (DeepSeek-V2/V3 and kin) and its sparse-attention indexer
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,  # under the 32 tokens of a test batch, so that the top-k selection selects
    # sliding-window layers with heads of their own (Inkling)
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    # per-layer input embeddings (Gemma 3n / 4)
    "hidden_size_per_layer_input": 16,
    # state-space and linear-attention layers (Mamba-2 heads: 2 * hidden = heads * head dim)
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "mamba_d_ssm": 128,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
}

# Where a config has a sliding window or attention chunks: half the sequence of a test batch (32
# tokens), so that the window slides.
SLIDING_WINDOW = 16
_WINDOWS = ("sliding_window", "attention_chunk_size")

# Sizes that equal the vocabulary (a second embedding table's rows).
_VOCAB_SIZED = ("vocab_size_per_layer_input", "unpadded_vocab_size")

_OVERRIDES: dict[str, dict[str, object]] = {
    # the local encoder's and decoder's cross-attention read the global transformer's width; the
    # byte-group hash embeddings have 500k rows by default; transformers' BLT cannot build its KV
    # cache (BltConfig has no num_hidden_layers), and training reads none
    "blt": {"encoder_hash_byte_group_vocab": 64, "encoder_config": {"hidden_size_global": 64},
            "decoder_config": {"hidden_size_global": 64}, "use_cache": False},
    # mamba layers but one attention layer (attn_layer_indices; layers_block_type is derived from it)
    "bamba": {"attn_layer_indices": [1]},
    # the rotary embedding reads rope_parameters by layer type (the default's flat one fails); a
    # sliding layer beside the full one
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # DBRX's attention reads rope_theta from its attention sub-config and clamps q/k/v at clip_qkv
    # (None fails in torch.clamp); experts and width from the FFN one
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 8, "moe_top_k": 2}},
    # transformers' Dory with a KV cache cuts a looped layer's keys to the window plus the queries,
    # which fails where the window is shorter than the sequence: a window over a test batch
    "dory": {"sliding_window": 64},
    # configs/models/deepseek_v4_tiny.yaml's shape in three layers: one of each attention kind
    # (sliding window, compressed sparse, heavily compressed), the first routed by token-id hash;
    # one shared key/value head; grouped output projection (o_groups divides the heads)
    "deepseek_v4": {"num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.25,
                    "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                    "mlp_layer_types": ["hash_moe", "moe", "moe"]},
    # the sliding-window layers' attention is sized by per_layer_config (its own heads and ranks);
    # the indexed layers' by the table
    "dots3_note_text": {"per_layer_config": {1: {"num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
                                                 "kv_lora_rank": 32, "head_dim": 16, "qk_nope_head_dim": 8,
                                                 "qk_rope_head_dim": 8, "v_head_dim": 16}}},
    # the last layers reuse the KV of the last earlier layer of their kind (num_kv_shared_layers):
    # two layers of each kind, the second two sharing; the first two with sparse activations
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "laurel_rank": 16,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0]},
    # the full-attention layers' wider heads (512 by default) are set per layer
    "gemma4_text": {"per_layer_config": {1: {"head_dim": 32}}},
    "gemma4_unified_text": {"per_layer_config": {1: {"head_dim": 32}}},
    # a mamba layer then an attention layer, a dense MLP then experts (periods of two)
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # a short convolution layer then an attention layer; the first layer's MLP dense, the second's MoE
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # a short convolution layer then an attention layer (all attention by default)
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # a mamba layer then an attention layer (all mamba by default)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # local then global attention (attention_types: [[pattern], repeats])
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Mamba-2's heads: hidden_size * expand (128) = num_heads * head_dim; groups divide the heads
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "chunk_size": 16},
    # recurrent (RG-LRU) then local attention: block_types is the pattern cycled over the layers
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Mamba-2 groups divide the heads (8)
    "nemotron_h": {"n_groups": 2, "chunk_size": 16},
    # two decoder layers (num_layers: each has two attention sublayers); zero-computation experts
    # beside the routed ones
    "longcat_flash": {"num_layers": 2, "zero_expert_num": 4},
    # QSA (the indexed layers' query-sparse attention) sized whole: its indexer's heads (one key
    # head), a budget of 8 of the 32 tokens in blocks of 2; the hyper-connections' low rank
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2, "hc_lowrank": 16},
    # the hybrid layers share one transformer block (its weights tied across them): two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # mLSTM's q/k and v widths round up to multiples of 64: hidden 128 keeps them whole per head
    "xlstm": {"hidden_size": 128, "num_heads": 4},
    # ZAYA routes each token to one expert only (its validator); a sliding-window layer and a full one
    "zaya": {"num_experts_per_tok": 1, "layer_types": ["hybrid_sliding", "hybrid"], "sliding_window": 16},
}


def tiny_config_values(model_type: str, vocab_size: int = 512) -> dict:
    """The keys that make `model_type`'s config tiny (an inline `model.config` for the trainer)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    return _tiny_values(config_class, _default_config(config_class), vocab_size, _OVERRIDES.get(model_type, {}))


def tiny_config(model_type: str, vocab_size: int = 512):
    """`model_type`'s transformers config at a tiny size."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**tiny_config_values(model_type, vocab_size))


def _tiny_values(config_class, default, vocab_size: int, overrides: dict) -> dict:
    """The tiny keys of one config class (`default`: its default instance, or None where its
    defaults alone do not validate), sub-configs included as dicts."""
    aliases = getattr(config_class, "attribute_map", {}) or {}
    keys = {key for key in declared_config_keys(config_class) if _settable(config_class, key)}
    keys -= {alias for alias, target in aliases.items() if target in keys}

    def field(name: str) -> str:  # each key by the field's own name: a field that __post_init__
        target = aliases.get(name, name)  # derives from another reads that field, not its alias
        return target if target in keys else name

    values = {field(k): v for k, v in SIZES.items() if field(k) in keys}
    overrides = {field(k): v for k, v in overrides.items()}
    if "vocab_size" in keys:
        values[field("vocab_size")] = vocab_size
    values.update({key: vocab_size for key in _VOCAB_SIZED if key in keys})
    heads, kv_heads = field("num_attention_heads"), field("num_key_value_heads")
    if "kv_lora_rank" in values:  # multi-head latent attention: a key and value decompressed per head,
        if heads in values and kv_heads in keys:  # and head_dim names the rotary part (what the rotary
            values[kv_heads] = values[heads]  # embedding is built for)
        if "head_dim" in keys:
            values["head_dim"] = values["qk_rope_head_dim"]
    layers = field("num_hidden_layers")
    if layers in keys:
        per_layer = _per_layer_values(default, keys, layers, overrides.get(layers, values.get(layers, 2)))
        for key, value in per_layer.items():  # (a size the table sets that varies per layer: the table's on each)
            values[key] = [values[key]] * len(value) if key in values and key != layers else value
    for window in map(field, _WINDOWS):
        if window in keys and isinstance(_get(default, window), int) and _get(default, window) > SLIDING_WINDOW:
            values[window] = SLIDING_WINDOW
    for key in keys:  # dropout off: a run's numbers then depend on its data and weights alone, on any layout
        if ("dropout" in key or "pdrop" in key) and isinstance(_get(default, key), float):
            values[key] = 0.0
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = _get(default, key) if key in keys else None
        if isinstance(token, int) and token >= vocab_size:
            values[key] = vocab_size - 1
        elif isinstance(token, list | tuple) and any(isinstance(t, int) and t >= vocab_size for t in token):
            values[key] = [t if t < vocab_size else vocab_size - 1 for t in token]
    subs = {}
    specs = getattr(config_class, "sub_configs_defaults", None) or {}
    for key in {**(getattr(config_class, "sub_configs", None) or {}), **specs}:
        sub_default = _get(default, key)
        sub_class = _sub_config_class(specs.get(key), sub_default)
        if sub_class is None or key not in keys:
            continue
        sub = _tiny_values(sub_class, sub_default or _default_config(sub_class), vocab_size, {})
        if key in specs and sub_class.model_type != getattr(specs[key].config_class, "model_type", None):
            sub["model_type"] = sub_class.model_type  # (an AutoConfig sub-config is told its type)
        if sub:
            subs[key] = values[key] = sub
    for key, value in overrides.items():  # (a sub-config's overrides join its table's keys)
        values[key] = {**subs[key], **value} if key in subs else value
    return values


def _per_layer_values(default, keys: set[str], layers_key: str, layers: int) -> dict:
    """The per-layer lists of `default` cut to one layer of each kind, with the layer count to
    match: the fewest layers that hold every kind each list has (a string or flag per layer), then
    the first other layers up to `layers` in all, in their order."""
    default_layers = _get(default, layers_key)
    if not isinstance(default_layers, int) or default_layers <= layers:
        return {}
    lists = {key: list(value) for key in keys if isinstance(value := _get(default, key), list | tuple)
             and len(value) == default_layers and key != layers_key}
    if not lists:
        return {}
    categorical = {key: value for key, value in lists.items() if all(isinstance(v, str | bool) for v in value)}
    kinds = [{(key, value[i]) for key, value in categorical.items()} for i in range(default_layers)]
    kept: set[int] = set()
    missing = set().union(*kinds)
    while missing:  # (greedily: the layer with the most kinds not yet kept, the first of equals)
        best = max(range(default_layers), key=lambda i: (len(kinds[i] & missing), -i))
        kept.add(best)
        missing -= kinds[best]
    while len(kept) < layers:
        kept.add(min(set(range(default_layers)) - kept))
    order = sorted(kept)
    values: dict = {key: [value[i] for i in order] for key, value in lists.items()}
    values[layers_key] = len(order)
    return values


def _sub_config_class(spec, default):
    """The class of a sub-config: its default's, else its spec's (None: an optional one, absent)."""
    if default is not None:
        return type(default)
    if spec is None or spec.optional:
        return None
    if spec.config_class.__name__ == "AutoConfig":
        return spec.get_config_class(spec.model_type)
    return spec.config_class


def _default_config(config_class):
    try:
        return config_class()
    except Exception:  # noqa: BLE001 (a config whose defaults do not validate alone: the table decides)
        return None


def _get(config, key: str):
    """`config.key`, or None (no config, no such attribute, or one that varies per layer)."""
    if config is None:
        return None
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 (a heterogeneous config's per-layer attribute has no one value)
        return None


def _settable(config_class, key: str) -> bool:
    """Whether `config_class(key=...)` can set `key`: not a read-only property (layers_block_type
    and its kin are derived from other keys)."""
    name = (getattr(config_class, "attribute_map", {}) or {}).get(key, key)
    attribute = getattr(config_class, name, None)
    return not (isinstance(attribute, property) and attribute.fset is None)

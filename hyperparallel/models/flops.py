"""Training FLOPs per token of a supported family, the denominator-free half of MFU.

Counted: every matmul a token passes through, forward and backward (x6 = 2 for the forward
multiply-add, 4 for the two backward matmuls): attention projections, dense MLPs, the router, the
top-k routed experts and the shared experts (never the idle experts), and the lm_head. Not
counted: the embedding lookup, norms, activations, rotary embedding and softmax (elementwise, a
small fraction). Attention scores (Q K^T) and values (P V) add 2 x (qk_dim + v_dim) per head per
attended key in the forward, x3 for training; with `causal` a query attends on average to half
the sequence, so that term is halved (the work a causal kernel does; PaLM's 12·L·T·width omits
the halving). Sliding-window layers attend to at most `sliding_window` keys.

DeepSeek-V4 also counts its hyper-connections' projections (two per layer and the head's) and
its KV compressors' and lightning indexers' projections; each query attends to its window plus
the compressed entries (all of them causally in HCA layers, `index_topk` in CSA layers). The
indexer's scores over the compressed entries are not counted.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import ConfigError


def training_flops_per_token(config: PretrainedConfig, seq_len: int, *, causal: bool = True) -> float:
    """6 x active matmul parameters per token + attention score/value FLOPs, for sequences of seq_len."""
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be positive; got {seq_len}")
    hidden = config.hidden_size
    total = 6.0 * hidden * config.vocab_size  # lm_head
    if config.model_type == "deepseek_v4":
        return total + _deepseek_v4(config, seq_len, 0.5 if causal else 1.0)
    for layer in range(config.num_hidden_layers):
        attention_params, qk_width, v_width = _attention(config)
        total += 6.0 * (attention_params + _mlp_params(config, layer))
        keys = min(seq_len, config.sliding_window) if _is_sliding(config, layer) else seq_len
        total += 6.0 * keys * (qk_width + v_width) * (0.5 if causal else 1.0)
    return total


def _attention(config: PretrainedConfig) -> tuple[int, int, int]:
    """(projection parameters, heads x qk head dim, heads x v head dim) of one attention layer."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    if config.model_type in ("deepseek_v3", "kimi_k2"):  # multi-head latent attention
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            q = hidden * heads * qk_dim
        else:
            q = hidden * config.q_lora_rank + config.q_lora_rank * heads * qk_dim
        kv = hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        out = heads * config.v_head_dim * hidden
        return q + kv + out, heads * qk_dim, heads * config.v_head_dim
    if config.model_type in ("qwen3", "qwen3_moe"):
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = config.num_key_value_heads
        params = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        return params, heads * head_dim, heads * head_dim
    raise ConfigError(f"training_flops_per_token does not know model_type {config.model_type!r}")


def _deepseek_v4(config: PretrainedConfig, seq_len: int, causal: float) -> float:
    hidden, heads, head_dim, q_rank = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
    n = config.hc_mult
    attention = (hidden * q_rank + q_rank * heads * head_dim + hidden * head_dim
                 + heads * head_dim * config.o_lora_rank + config.o_groups * config.o_lora_rank * hidden)
    hyper = 2 * (2 + n) * n * n * hidden
    routed = config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
    shared = 3 * hidden * config.moe_intermediate_size * config.n_shared_experts
    mlp = hidden * config.n_routed_experts + routed + shared
    indexer = (2 * hidden * 2 * config.index_head_dim + q_rank * config.index_n_heads * config.index_head_dim
               + hidden * config.index_n_heads)
    total = 6.0 * n * n * hidden  # the head's collapse
    for kind in config.layer_types:
        params, keys = attention + hyper + mlp, min(seq_len, config.sliding_window) * causal
        if kind == "heavily_compressed_attention":
            params += 2 * hidden * head_dim
            keys += seq_len / config.compress_rates[kind] * causal
        elif kind == "compressed_sparse_attention":
            params += 2 * hidden * 2 * head_dim + indexer
            keys += min(config.index_topk, seq_len / config.compress_rates[kind] * causal)
        total += 6.0 * params + 6.0 * keys * 2 * heads * head_dim
    return total


def _mlp_params(config: PretrainedConfig, layer: int) -> int:
    """Matmul parameters one token uses in this layer's MLP (gated: 3 matrices per MLP)."""
    hidden = config.hidden_size
    if config.model_type == "qwen3_moe" and _qwen3_moe_is_sparse(config, layer):
        routed = config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
        return hidden * config.num_experts + routed
    if config.model_type in ("deepseek_v3", "kimi_k2") and layer >= config.first_k_dense_replace:
        routed = config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
        shared = 3 * hidden * config.moe_intermediate_size * config.n_shared_experts
        return hidden * config.n_routed_experts + routed + shared
    return 3 * hidden * config.intermediate_size


def _qwen3_moe_is_sparse(config: PretrainedConfig, layer: int) -> bool:
    # the rule of Qwen3MoeDecoderLayer
    return (
        layer not in config.mlp_only_layers and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0
    )


def _is_sliding(config: PretrainedConfig, layer: int) -> bool:
    # Qwen3 marks sliding layers in layer_types; Qwen3-MoE slides in every layer once
    # sliding_window is set (its config leaves it None unless use_sliding_window).
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or layer_types[layer] == "sliding_attention"

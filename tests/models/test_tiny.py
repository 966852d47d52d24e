"""tiny_config_values: representative types' tiny configs build (on the meta device) under 5M
parameters, with per-layer lists as long as the layers and every kind of layer the full model has."""

from __future__ import annotations

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from hyperparallel.models.build import declared_config_keys
from hyperparallel.models.tiny import tiny_config_values

# dense, MoE, learned positions (GPT-2's own spellings), sliding + full attention, linear + full
# attention with MoE, mamba + attention with MoE, MLA with a dense first layer, MoE with sinks
TYPES = ["llama", "mixtral", "gpt2", "gemma3_text", "qwen3_next", "jamba", "deepseek_v3", "gpt_oss"]
# the per-layer kinds each keeps (a derived property where the config computes them)
KINDS = {
    "gemma3_text": ("layer_types", {"sliding_attention", "full_attention"}),
    "qwen3_next": ("layer_types", {"linear_attention", "full_attention"}),
    "jamba": ("layers_block_type", {"mamba", "attention"}),
    "gpt_oss": ("layer_types", {"sliding_attention", "full_attention"}),
}


@pytest.mark.parametrize("model_type", TYPES)
def test_tiny_config_builds_small_with_whole_per_layer_lists(model_type):
    values = tiny_config_values(model_type)
    assert set(values) <= declared_config_keys(CONFIG_MAPPING[model_type])
    config = CONFIG_MAPPING[model_type](**values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert config.vocab_size == 512
    layers = config.num_hidden_layers
    assert 2 <= layers <= 4
    for key, value in values.items():
        if isinstance(value, list):
            assert len(value) == layers, key
    if model_type in KINDS:
        name, kinds = KINDS[model_type]
        assert set(getattr(config, name)) == kinds


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_next", "jamba", "deepseek_v3", "gpt_oss"])
def test_tiny_moe_keeps_several_experts_two_per_token(model_type):
    config = CONFIG_MAPPING[model_type](**tiny_config_values(model_type))
    experts = next(getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                   if isinstance(getattr(config, k, None), int))
    assert experts == 8 and config.num_experts_per_tok == 2


def test_tiny_attention_keeps_grouped_query_heads():
    config = CONFIG_MAPPING["llama"](**tiny_config_values("llama"))
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)

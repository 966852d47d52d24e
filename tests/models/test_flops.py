"""training_flops_per_token against hand counts of meta-device models, built by hyperparallel and by
transformers alone, and against the models' own module trees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model, make_config, training_flops_per_token

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
SEQ = 128


def values(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def built(family: str, name: str) -> nn.Module:
    """hyperparallel's build: meta device, MoE blocks swapped for moe's MoEBlock / GroupedExperts."""
    return build_model(family, config=values(name), materialize=False)


def transformers_model(config) -> nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def model_of(builder: str, family: str, name: str) -> nn.Module:
    """The same config built by hyperparallel or by transformers alone: the counts must agree."""
    if builder == "hyperparallel":
        return built(family, name)
    return transformers_model(make_config(family, values(name)))


BUILDERS = pytest.mark.parametrize("builder", ["hyperparallel", "transformers"])


def attention_at_one_key(model) -> float:
    # the attention term is linear in the number of keys (within windows): f(2) - f(1) is its value at one key
    return training_flops_per_token(model, 2, causal=False) - training_flops_per_token(model, 1, causal=False)


def matmuls(model) -> float:
    return training_flops_per_token(model, 1, causal=False) - attention_at_one_key(model)


# ---- hyperparallel's families: the same hand counts as the per-family formulas had --------------


@BUILDERS
def test_qwen3_by_hand(builder):
    model = model_of(builder, "qwen3", "qwen3_tiny")
    # hidden 64, 4 heads x 16 (q, o: 64x64), 2 kv heads x 16 (k, v: 64x32), MLP 3 x 64x192, 2 layers,
    # lm_head 64x512 (tied to the embedding, but still a matmul)
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 3 * 64 * 192
    params = 2 * per_layer + 64 * 512
    attention = 2 * 6 * SEQ * (64 + 64) / 2  # per layer: 6 x keys x (qk width + v width), causal half
    assert training_flops_per_token(model, SEQ) == 6 * params + attention == 884736


@BUILDERS
def test_qwen3_moe_by_hand(builder):
    model = model_of(builder, "qwen3_moe", "qwen3_moe_tiny")
    # every layer sparse: router 64x16 + top-4 experts of 3 x 64x32; the 12 other experts cost nothing
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 64 * 16 + 4 * 3 * 64 * 32
    params = 2 * per_layer + 64 * 512
    attention = 2 * 6 * SEQ * (64 + 64) / 2
    assert training_flops_per_token(model, SEQ) == 6 * params + attention == 749568


@BUILDERS
def test_kimi_k2_by_hand(builder):
    model = model_of(builder, "kimi_k2", "kimi_k2_tiny")
    # MLA, 4 heads: q 64->48->4x(16+8); kv 64->(32+8), 32->4x(16+16); o 4x16->64
    attention_params = (64 * 48 + 48 * 4 * 24) + (64 * 40 + 32 * 4 * 32) + 4 * 16 * 64
    dense_mlp = 3 * 64 * 192  # layer 0 (first_k_dense_replace = 1)
    moe = 64 * 48 + 8 * 3 * 64 * 32 + 1 * 3 * 64 * 32  # router, top-8 of 48 routed, 1 shared
    params = 3 * attention_params + dense_mlp + 2 * moe + 64 * 512
    attention = 3 * 6 * SEQ * (4 * 24 + 4 * 16) / 2  # qk width 96, v width 64
    assert training_flops_per_token(model, SEQ) == 6 * params + attention == 1634304


@BUILDERS
def test_deepseek_v4_by_hand(builder):
    model = model_of(builder, "deepseek_v4", "deepseek_v4_tiny")
    # hidden 64, 4 heads x 32 sharing one kv head, q_lora 32, o in 2 groups of rank 16, hc_mult 4,
    # top-4 of 16 experts of 64x32, 1 shared; layers: sliding, CSA, HCA, CSA. The figures of the
    # former per-family formula, now read from the modules.
    attention_params = 64 * 32 + 32 * 4 * 32 + 64 * 32 + 4 * 32 * 16 + 2 * 16 * 64  # q_a, q_b, kv, o_a, o_b
    hyper = 2 * (2 + 4) * 4 * (4 * 64)  # attn_hc, ffn_hc: [(2 + n) n, n H]
    moe = 64 * 16 + 4 * 3 * 64 * 32 + 3 * 64 * 32  # router (hash-routed layer 0 too), top-4 routed, shared
    csa = 2 * 64 * 2 * 32 + (2 * 64 * 2 * 16 + 32 * 2 * 16 + 64 * 2)  # compressor; indexer: kv, gate, q_b, weights
    hca = 2 * 64 * 32  # compressor: kv, gate
    params = 4 * (attention_params + hyper + moe) + 2 * csa + hca + 64 * 512 + 4 * 4 * 64  # lm_head, hyper-head
    # keys: the window (32, causal half: 16) in every layer; + CSA min(index_topk 8, 128 / 4 / 2), HCA 128 / 16 / 2
    keys = 16 + (16 + 8) + (16 + 4) + (16 + 8)
    attention = 6 * keys * (4 * 32 + 4 * 32)
    assert training_flops_per_token(model, SEQ) == 6 * params + attention == 1869312


def test_deepseek_v4_with_mega_mhc_is_the_same():
    from hyperparallel.models.deepseek_v4 import use_mega_mhc

    model = built("deepseek_v4", "deepseek_v4_tiny")
    before = [training_flops_per_token(model, seq) for seq in (1, 32, 1024)]
    assert use_mega_mhc(model) == 4
    assert [training_flops_per_token(model, seq) for seq in (1, 32, 1024)] == before


@pytest.mark.parametrize(("family", "name"), [("qwen3", "qwen3_tiny"), ("qwen3_moe", "qwen3_moe_tiny"),
                                              ("kimi_k2", "kimi_k2_tiny")])
def test_agrees_with_the_built_model(family, name):
    """6 x (every Linear + routers + experts x top_k / E) of the real module tree."""
    from hyperparallel.moe import GroupedExperts, MoEBlock

    model = built(family, name)
    top_k = getattr(model.config, "num_experts_per_tok", None)
    assert any(isinstance(m, GroupedExperts) for m in model.modules()) == (top_k is not None)  # swapped in
    active = 0.0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            active += module.weight.numel()
        elif isinstance(module, GroupedExperts):
            active += (module.gate_up_proj.numel() + module.down_proj.numel()) * top_k / module.num_experts
        elif isinstance(module, MoEBlock):
            active += module.gate.weight.numel()
    assert matmuls(model) == pytest.approx(6 * active, rel=1e-12)


def test_causal_halves_the_attention_term_and_windows_cap_it():
    model = built("qwen3", "qwen3_tiny")
    full = training_flops_per_token(model, 1024, causal=False) - matmuls(model)
    causal = training_flops_per_token(model, 1024) - matmuls(model)
    assert causal == full / 2

    windowed = transformers_model(make_config("qwen3", {**values("qwen3_tiny"), "use_sliding_window": True,
                                                        "sliding_window": 256, "max_window_layers": 1}))
    assert windowed.config.layer_types == ["full_attention", "sliding_attention"]
    assert training_flops_per_token(windowed, 1024) - matmuls(windowed) == causal / 2 + causal / 2 * 256 / 1024


def test_swapped_linears_count_the_same():
    # lowp's MXLinear and the fused loss's head are no nn.Linear, but hold a Linear's weight
    from hyperparallel.lowp import LowPrecisionConfig, convert
    from hyperparallel.models import install_fused_loss

    model = built("qwen3", "qwen3_tiny")
    before = training_flops_per_token(model, SEQ)
    assert install_fused_loss(model)
    assert convert(model, LowPrecisionConfig(enabled=True, modules=["linear"])).replaced
    assert {"FusedLossHead", "MXLinear"} <= {type(m).__name__ for m in model.modules()}
    assert training_flops_per_token(model, SEQ) == before


# ---- any transformers causal LM, from its modules ------------------------------------------------

# 4 heads x 16 over 2 kv heads, hidden 64, 2 layers, vocabulary 512
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512)
ATTENTION_PARAMS = 64 * 64 * 2 + 64 * 32 * 2  # q, o; k, v
FULL_LAYER = 6 * SEQ / 2 * (64 + 64)  # one causal full-attention layer's scores and values


def test_llama_by_hand():
    model = transformers_model(transformers.LlamaConfig(**SMALL, intermediate_size=128))
    params = 2 * (ATTENTION_PARAMS + 3 * 64 * 128) + 64 * 512
    assert training_flops_per_token(model, SEQ) == 6 * params + 2 * FULL_LAYER == 737280


def test_mixtral_by_hand():
    # 8 experts of 3 x 64x128 stored as 3-D weights, top-2 per token; router 8x64
    config = transformers.MixtralConfig(**SMALL, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)
    model = transformers_model(config)
    params = 2 * (ATTENTION_PARAMS + 8 * 64 + 2 * 3 * 64 * 128) + 64 * 512
    assert training_flops_per_token(model, SEQ) == 6 * params + 2 * FULL_LAYER == 1038336


def test_gpt2_by_hand():
    # Conv1D weights [in, out]: c_attn 64x192, c_proj 64x64, c_fc 64x256, mlp c_proj 256x64; lm_head tied
    config = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    model = transformers_model(config)
    assert isinstance(model.transformer.h[0].attn.c_attn, transformers.pytorch_utils.Conv1D)
    params = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 64 * 512
    assert training_flops_per_token(model, SEQ) == 6 * params + 2 * FULL_LAYER == 884736


def test_gemma2_sliding_layers_attend_to_their_window():
    config = transformers.Gemma2Config(**SMALL, intermediate_size=128, sliding_window=32)
    model = transformers_model(config)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    params = 2 * (ATTENTION_PARAMS + 3 * 64 * 128) + 64 * 512
    sliding = 6 * 32 / 2 * (64 + 64)  # min(128, 32) keys, causal half
    assert training_flops_per_token(model, SEQ) == 6 * params + sliding + FULL_LAYER == 700416
    # below the window both kinds of layer see the same keys
    assert attention_at_one_key(model) == 2 * 6 * (64 + 64)


def test_gpt_oss_transposed_experts_without_biases():
    # experts stored transposed: gate_up_proj [8, 64, 2x32], down_proj [8, 32, 64], with biases (not
    # counted, nor the attention's biases and sinks); router 8x64 (+ bias); layer 0 slides over 32
    config = transformers.GptOssConfig(**SMALL, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                       sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    model = transformers_model(config)
    experts = model.model.layers[0].mlp.experts
    assert experts.is_transposed and experts.has_bias
    params = 2 * (ATTENTION_PARAMS + 8 * 64 + 2 * (64 * 64 + 32 * 64)) + 64 * 512
    sliding = 6 * 32 / 2 * (64 + 64)
    assert training_flops_per_token(model, SEQ) == 6 * params + sliding + FULL_LAYER == 559104


def test_mamba_has_no_quadratic_term():
    # per layer in_proj 64x256, x_proj 128x(4 + 2x16), dt_proj 4x128, out_proj 128x64; the depthwise
    # convolution and the scan are not matmuls; lm_head tied
    config = transformers.MambaConfig(vocab_size=512, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2)
    model = transformers_model(config)
    params = 2 * (64 * 256 + 128 * 36 + 4 * 128 + 128 * 64) + 64 * 512
    assert training_flops_per_token(model, SEQ) == training_flops_per_token(model, 4096) == 6 * params == 552960


def test_qwen3_next_counts_only_its_full_attention_layer():
    # layer 0 a gated delta net (linear attention), layer 1 full attention: one layer's quadratic term
    config = transformers.Qwen3NextConfig(**SMALL, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                          layer_types=["linear_attention", "full_attention"])
    model = transformers_model(config)
    assert attention_at_one_key(model) == 6 * (64 + 64)
    assert training_flops_per_token(model, SEQ) - matmuls(model) == FULL_LAYER


def test_experts_whose_top_k_nothing_states_are_refused():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.empty(4, 16, 8, device="meta"))
            self.down_proj = nn.Parameter(torch.empty(4, 8, 8, device="meta"))

    with pytest.raises(ConfigError, match="cannot tell how many of Experts's experts a token uses"):
        training_flops_per_token(nn.Sequential(Experts()), SEQ)


def test_a_model_never_gets_memory():
    model = transformers_model(transformers.LlamaConfig(**SMALL, intermediate_size=128))
    training_flops_per_token(model, SEQ)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_bad_arguments():
    model = built("qwen3", "qwen3_tiny")
    with pytest.raises(ConfigError, match="seq_len must be positive"):
        training_flops_per_token(model, 0)
    with pytest.raises(ConfigError, match="an nn.Module"):
        training_flops_per_token(model.config, SEQ)

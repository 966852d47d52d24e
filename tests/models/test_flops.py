"""training_flops_per_token against hand counts and against the built models' parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model, get_family, make_config, training_flops_per_token
from hyperparallel.moe import GroupedExperts, TopKRouter

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
SEQ = 128


def tiny(family: str, name: str):
    return make_config(get_family(family), yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))


def test_qwen3_by_hand():
    # hidden 64, 4 heads x 16 (q, o: 64x64), 2 kv heads x 16 (k, v: 64x32), MLP 3 x 64x192, 2 layers,
    # lm_head 64x512 (tied to the embedding, but still a matmul)
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 3 * 64 * 192
    params = 2 * per_layer + 64 * 512
    attention = 2 * 6 * SEQ * (64 + 64) / 2  # per layer: 6 x keys x (qk width + v width), causal half
    assert training_flops_per_token(tiny("qwen3", "qwen3_tiny"), SEQ) == 6 * params + attention == 884736


def test_qwen3_moe_by_hand():
    # every layer sparse: router 64x16 + top-4 experts of 3 x 64x32; the 12 other experts cost nothing
    per_layer = (64 * 64 * 2 + 64 * 32 * 2) + 64 * 16 + 4 * 3 * 64 * 32
    params = 2 * per_layer + 64 * 512
    attention = 2 * 6 * SEQ * (64 + 64) / 2
    assert training_flops_per_token(tiny("qwen3_moe", "qwen3_moe_tiny"), SEQ) == 6 * params + attention


def test_kimi_k2_by_hand():
    # MLA, 4 heads: q 64->48->4x(16+8); kv 64->(32+8), 32->4x(16+16); o 4x16->64
    attention_params = (64 * 48 + 48 * 4 * 24) + (64 * 40 + 32 * 4 * 32) + 4 * 16 * 64
    dense_mlp = 3 * 64 * 192  # layer 0 (first_k_dense_replace = 1)
    moe = 64 * 48 + 8 * 3 * 64 * 32 + 1 * 3 * 64 * 32  # router, top-8 routed, 1 shared
    params = 3 * attention_params + dense_mlp + 2 * moe + 64 * 512
    attention = 3 * 6 * SEQ * (4 * 24 + 4 * 16) / 2  # qk width 96, v width 64
    config = tiny("deepseek_v3", "kimi_k2_tiny")
    assert training_flops_per_token(config, SEQ) == 6 * params + attention == 1634304


@pytest.mark.parametrize(
    ("family", "name"), [("qwen3", "qwen3_tiny"), ("qwen3_moe", "qwen3_moe_tiny"), ("kimi_k2", "kimi_k2_tiny")]
)
def test_agrees_with_the_built_model(family, name):
    """6 x (every Linear + routers + experts x top_k / E) of the real module tree, + attention."""
    model = build_model(family, config=yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()))
    config = model.config
    active = 0.0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            active += module.weight.numel()
        elif isinstance(module, GroupedExperts):
            active += (
                (module.gate_up_proj.numel() + module.down_proj.numel())
                * config.num_experts_per_tok
                / module.num_experts
            )
        elif isinstance(module, (TopKRouter, *get_family(family).router_classes)):
            active += module.weight.numel()
    matmuls = training_flops_per_token(config, 1, causal=False) - _attention_at_one_key(config)
    assert matmuls == pytest.approx(6 * active, rel=1e-12)


def _attention_at_one_key(config) -> float:
    # the attention term is linear in the number of keys: f(2) - f(1) is its value at one key
    return training_flops_per_token(config, 2, causal=False) - training_flops_per_token(config, 1, causal=False)


def test_causal_halves_the_attention_term_and_windows_cap_it():
    config = tiny("qwen3", "qwen3_tiny")
    matmuls = training_flops_per_token(config, 1, causal=False) - _attention_at_one_key(config)
    full = training_flops_per_token(config, 1024, causal=False) - matmuls
    causal = training_flops_per_token(config, 1024) - matmuls
    assert causal == full / 2

    config.sliding_window, config.layer_types = 256, ["sliding_attention", "full_attention"]
    windowed = training_flops_per_token(config, 1024) - matmuls
    assert windowed == causal / 2 + causal / 2 * 256 / 1024


def test_bad_seq_len():
    with pytest.raises(ConfigError, match="seq_len must be positive"):
        training_flops_per_token(tiny("qwen3", "qwen3_tiny"), 0)

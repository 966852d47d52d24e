"""Which parameters of real (tiny) Hugging Face Qwen3 models go to Muon, AdamW, decay and no-decay."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hyperparallel.errors import ConfigError
from hyperparallel.optim import Muon, OptimizerConfig, build_optimizer, split_for_muon

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
ATTENTION = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
NORMS = [
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def _per_layer(suffixes):
    return {f"model.layers.{i}.{suffix}" for i in range(TINY["num_hidden_layers"]) for suffix in suffixes}


def _dense(tie: bool) -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, tie_word_embeddings=tie, **TINY))


def _moe() -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, **TINY)
    return Qwen3MoeForCausalLM(config)


def _names(named_params):
    return {name for name, _ in named_params}


def _group(optimizer, name):
    (group,) = [g for g in optimizer.param_groups if g["name"] == name]
    return group


def _param_names(model, params):
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize("tie", [True, False])
def test_dense_qwen3_split(tie):
    model = _dense(tie)
    muon, adamw = split_for_muon(model)
    mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert _names(muon) == _per_layer(ATTENTION + mlp)
    head = set() if tie else {"lm_head.weight"}
    assert _names(adamw) == _per_layer(NORMS) | {"model.embed_tokens.weight", "model.norm.weight"} | head
    every_param = [p for _, p in muon + adamw]
    assert len({id(p) for p in every_param}) == len(every_param) == len(list(model.parameters()))


def test_moe_qwen3_split_sends_expert_stacks_to_muon_and_the_router_to_adamw():
    model = _moe()
    muon, adamw = split_for_muon(model)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert _names(muon) == _per_layer(ATTENTION + experts)
    assert {dict(muon)[name].ndim for name in _per_layer(experts)} == {3}
    expected = _per_layer(NORMS + ["mlp.gate.weight"]) | {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
    assert _names(adamw) == expected


def test_frozen_params_are_left_out_and_exclude_is_configurable():
    model = _dense(tie=False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    muon, adamw = split_for_muon(model, exclude=["*embed*", "*lm_head*", "*norm*", "*.o_proj.*"])
    assert "model.layers.0.self_attn.q_proj.weight" not in _names(muon) | _names(adamw)
    assert "model.layers.1.self_attn.o_proj.weight" in _names(adamw)


def test_exclude_must_be_a_list_of_globs():
    with pytest.raises(ConfigError, match="exclude"):
        split_for_muon(_dense(tie=True), exclude="*embed*")


@pytest.mark.parametrize("tie", [True, False])
def test_build_adamw(tie):
    model = _dense(tie)
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1))
    assert type(optimizer) is torch.optim.AdamW
    assert [g["name"] for g in optimizer.param_groups] == ["adamw_decay", "adamw_no_decay"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.95) and decay["lr"] == 1e-3
    mlp = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    head = set() if tie else {"lm_head.weight"}
    assert _param_names(model, decay["params"]) == _per_layer(ATTENTION + mlp) | {"model.embed_tokens.weight"} | head
    assert _param_names(model, no_decay["params"]) == _per_layer(NORMS) | {"model.norm.weight"}


def test_build_muon_for_moe():
    model = _moe()
    optimizer = build_optimizer(
        model, OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.1, muon_lr=0.02, ns_steps=4),
        adjust_lr_fn="match_rms_adamw",
    )
    assert type(optimizer) is Muon
    assert [g["name"] for g in optimizer.param_groups] == ["muon", "adamw_decay", "adamw_no_decay"]
    muon = _group(optimizer, "muon")
    assert muon["use_muon"] and muon["lr"] == 0.02 and muon["weight_decay"] == 0.1
    assert (muon["momentum"], muon["nesterov"], muon["ns_steps"], muon["adjust_lr_fn"]) == (
        0.95,
        True,
        4,
        "match_rms_adamw",
    )
    assert _param_names(model, muon["params"]) == _per_layer(
        ATTENTION + ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    )
    decay, no_decay = _group(optimizer, "adamw_decay"), _group(optimizer, "adamw_no_decay")
    assert not decay["use_muon"] and decay["lr"] == 1e-3 and decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    routers_and_embeddings = _per_layer(["mlp.gate.weight"]) | {"model.embed_tokens.weight", "lm_head.weight"}
    assert _param_names(model, decay["params"]) == routers_and_embeddings
    assert _param_names(model, no_decay["params"]) == _per_layer(NORMS) | {"model.norm.weight"}


def test_muon_lr_defaults_to_lr_and_a_training_step_moves_every_param():
    model = _dense(tie=True)
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-2, weight_decay=0.0))
    assert _group(optimizer, "muon")["lr"] == 1e-2
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == []


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"name": "sgd"}, "adamw"),
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"muon_lr": float("inf")}, "muon_lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1.0}, "eps"),
        ({"no_decay": "*bias"}, "no_decay"),
        ({"momentum": 1.5}, "momentum"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn"),
    ],
)
def test_bad_settings_raise_config_error(kwargs, key):
    settings = {"name": "muon", "lr": 1e-3, "weight_decay": 0.1, **kwargs}
    extras = {k: settings.pop(k) for k in ("no_decay", "adjust_lr_fn") if k in settings}  # (not config settings)
    with pytest.raises(ConfigError, match=key):
        build_optimizer(_dense(tie=True), OptimizerConfig(**settings), **extras)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_model_without_trainable_params_is_an_error(name):
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ConfigError, match="trainable"):
        build_optimizer(model, OptimizerConfig(name=name, lr=1e-3, weight_decay=0.1))


def test_a_model_without_matrices_gets_only_adamw_groups():
    optimizer = build_optimizer(nn.LayerNorm(8), OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.1))
    assert [g["name"] for g in optimizer.param_groups] == ["adamw_no_decay"]

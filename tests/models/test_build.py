"""build_model: every family from its inline YAML fragment, seeded init, checkpoints, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model, get_family, init_weights
from hyperparallel.moe import GroupedExperts, MoEBlock, TopKRouter

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
FAMILIES = [("qwen3", "qwen3_tiny"), ("qwen3_moe", "qwen3_moe_tiny"), ("kimi_k2", "kimi_k2_tiny"),
            ("deepseek_v4", "deepseek_v4_tiny")]
MOE_FAMILIES = FAMILIES[1:]


def tiny(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def batch(vocab_size: int, seed: int = 0, shape=(2, 128)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(("family", "name"), FAMILIES)
def test_builds_and_trains_one_step(family, name):
    model = build_model(family, config=tiny(name))
    assert model.training and model.config.use_cache is False
    ids = batch(model.config.vocab_size)

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()

    assert torch.isfinite(loss)
    # random init: the loss sits near log(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(model.config.vocab_size)).item()) < 0.5
    # (DeepSeek-V4's lightning indexer picks compressed entries by top-k: transformers' model has no
    # gradient for it, the paper trains it with a loss of its own)
    trained = [(n, p) for n, p in model.named_parameters() if ".indexer." not in n]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in trained)
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    moe_layers = {"qwen3": 0, "qwen3_moe": 2, "kimi_k2": 2, "deepseek_v4": 4}[family]
    for kind in (MoEBlock, GroupedExperts, TopKRouter):  # transformers' MoE blocks swapped for ours
        assert sum(isinstance(m, kind) for m in model.modules()) == moe_layers, kind.__name__


@pytest.mark.parametrize(("family", "name"), FAMILIES)
def test_init_is_the_families_own_and_seeded(family, name):
    config = tiny(name)
    rng_before = torch.get_rng_state()
    a = build_model(family, config=config, seed=7).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is left alone
    b = build_model(family, config=config, seed=7).state_dict()
    c = build_model(family, config=config, seed=8).state_dict()

    assert all(torch.equal(a[k], b[k]) for k in a)
    # (DeepSeek-V4's compressors start their position bias at zero; its hash table is experts' ids)
    matrices = [k for k in a if a[k].dim() >= 2 and not k.endswith(("position_bias", "tid2eid"))]
    assert all(not torch.equal(a[k], c[k]) for k in matrices)
    for key in matrices:  # normal(0, initializer_range), nothing left empty
        assert torch.isfinite(a[key]).all()
        assert abs(a[key].float().std().item() - config["initializer_range"]) < 0.004, key
    norms = [k for k in a if k.endswith("norm.weight")]
    assert norms and all(torch.equal(a[k], torch.ones_like(a[k])) for k in norms)


def test_tied_embedding_stays_tied():
    config = tiny("qwen3_tiny")
    assert config["tie_word_embeddings"] is True
    model = build_model("qwen3", config=config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


def test_rotary_buffers_are_computed_not_left_empty():
    # to_empty leaves buffers uninitialized; the family's init must recompute the (yarn) frequencies
    model = build_model("kimi_k2", config=tiny("kimi_k2_tiny"))
    rotary = model.model.rotary_emb
    expected, _ = ROPE_INIT_FUNCTIONS["yarn"](model.config)
    assert rotary.rope_type == "yarn"
    assert torch.equal(rotary.inv_freq, expected) and torch.equal(rotary.original_inv_freq, expected)


@pytest.mark.parametrize(("family", "name"), MOE_FAMILIES)
def test_moe_blocks_match_hf_moe_blocks(family, name):
    """Our MoE blocks (router, GroupedExperts, shared experts) against transformers' own, eager."""
    config = tiny(name)
    grouped = build_model(family, config=config, seed=3)
    hf = build_model(family, config=config, seed=3, grouped_experts=False)
    hf.set_experts_implementation("eager")  # transformers' reference loop over experts
    assert not any(isinstance(m, (MoEBlock, TopKRouter, GroupedExperts)) for m in hf.modules())

    ref_state = hf.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in grouped.state_dict().items())  # same seed, same weights
    ids = batch(config["vocab_size"], seed=1, shape=(2, 64))
    torch.testing.assert_close(logits(grouped, ids), logits(hf, ids), rtol=1e-5, atol=1e-5)


def test_bf16_keeps_deepseek_router_in_fp32():
    model = build_model("kimi_k2", config=tiny("kimi_k2_tiny"), dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
    ids = batch(model.config.vocab_size, shape=(1, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("family", "name"), FAMILIES)
def test_save_pretrained_then_load_gives_the_same_logits(tmp_path, family, name):
    model = build_model(family, config=tiny(name), seed=5)
    model.save_pretrained(tmp_path)
    loaded = build_model(family, path=tmp_path)

    assert loaded.training and loaded.config.use_cache is False
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    ids = batch(model.config.vocab_size, seed=2, shape=(2, 32))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    if family == "qwen3":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_init_weights_reinitializes_a_loaded_model(tmp_path):
    model = build_model("qwen3_moe", config=tiny("qwen3_moe_tiny"), seed=1)
    model.save_pretrained(tmp_path)
    loaded = build_model("qwen3_moe", path=tmp_path)
    init_weights(loaded, seed=2)
    fresh = build_model("qwen3_moe", config=tiny("qwen3_moe_tiny"), seed=2).state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in loaded.state_dict().items())


# errors a user can cause


def test_unknown_family():
    with pytest.raises(ConfigError, match="model type 'lama' is no causal LM transformers knows; did you mean 'llama'"):
        build_model("lama", config={})
    with pytest.raises(ConfigError, match="model type 'bert' is an encoder.*trains text decoder-only causal LMs"):
        build_model("bert", config={})


def test_unknown_inline_key_is_named_with_the_family():
    config = tiny("qwen3_moe_tiny") | {"num_expert": 8}
    with pytest.raises(ConfigError, match=r"unknown key 'num_expert'.*'qwen3_moe'.*did you mean 'num_experts'"):
        build_model("qwen3_moe", config=config)
    with pytest.raises(ConfigError, match="'q_lora_rank'.*'qwen3'"):
        build_model("qwen3", config={"q_lora_rank": 8})
    with pytest.raises(ConfigError, match="'num_experts'.*family 'kimi_k2' \\(DeepseekV3Config"):
        build_model("kimi_k2", config={"num_experts": 8})


def test_kimi_k2_is_deepseek_v3():
    kimi, deepseek = get_family("kimi_k2"), get_family("deepseek_v3")
    assert (kimi.config_class, kimi.model_class, kimi.model_types) == (
        deepseek.config_class,
        deepseek.model_class,
        deepseek.model_types,
    )
    assert "kimi_k2" in deepseek.model_types  # Kimi checkpoints' config.json says kimi_k2


def test_inline_values_are_checked():
    with pytest.raises(ConfigError, match="'qwen3'.*hidden_size"):
        build_model("qwen3", config={"hidden_size": "wide"})
    with pytest.raises(ConfigError, match="n_group"):
        build_model("kimi_k2", config=tiny("kimi_k2_tiny") | {"n_group": 5})
    with pytest.raises(ConfigError, match="'dtype'.*dtype= argument"):
        build_model("qwen3", config={"dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="model_type"):
        build_model("qwen3", config={"model_type": "qwen3_moe"})


def test_exactly_one_source(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of path= .* or config="):
        build_model("qwen3")
    with pytest.raises(ConfigError, match="exactly one"):
        build_model("qwen3", path=tmp_path, config={})


def test_missing_path_and_missing_config_json(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"'{missing}' is not a directory"):
        build_model("qwen3", path=missing)
    with pytest.raises(ConfigError, match=f"'{tmp_path}' has no config.json"):
        build_model("qwen3", path=tmp_path)


def test_family_mismatch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(
        ConfigError, match="family 'qwen3' does not match model_type 'qwen3_moe'.*use family 'qwen3_moe'"
    ):
        build_model("qwen3", path=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2"}))
    with pytest.raises(ConfigError, match="use family 'deepseek_v3'"):
        build_model("qwen3_moe", path=tmp_path)


def test_bad_dtype_and_attention():
    with pytest.raises(ConfigError, match="dtype must be a floating-point torch.dtype"):
        build_model("qwen3", config={}, dtype="bf16")
    with pytest.raises(ConfigError, match="attn_implementation 'flash'"):
        build_model("qwen3", config={}, attn_implementation="flash")
    with pytest.raises(ConfigError, match="attn_implementation 'sdpa': transformers' deepseek_v4 supports eager only"):
        build_model("deepseek_v4", config=tiny("deepseek_v4_tiny"), attn_implementation="sdpa")


def test_deepseek_v4_hash_layers_route_by_a_drawn_table_and_clamp_the_experts():
    """transformers zeroes tid2eid (every token to expert 0); a model built from a seed draws each
    token k distinct experts, the same with and without our MoE blocks. The experts keep
    DeepSeek-V4's SwiGLU clamp."""
    config = tiny("deepseek_v4_tiny")
    ours = build_model("deepseek_v4", config=config, seed=2)
    hf = build_model("deepseek_v4", config=config, seed=2, grouped_experts=False)
    gate = ours.model.layers[0].mlp.gate
    assert gate.hash_routing and ours.model.layers[1].mlp.gate.e_score_correction_bias is not None
    table = gate.tid2eid
    assert table.shape == (config["vocab_size"], config["num_experts_per_tok"])
    assert torch.equal(table, hf.model.layers[0].mlp.gate.tid2eid)
    assert all(len(set(row)) == config["num_experts_per_tok"] for row in table.tolist())
    assert set(table.flatten().tolist()) == set(range(config["n_routed_experts"]))
    # the clamp is transformers' own (DeepseekV4Experts._apply_gate, reading its `limit`), which ours runs
    experts = ours.model.layers[0].mlp.experts
    assert experts.limit == config["swiglu_limit"]
    limit = config["swiglu_limit"]
    big = torch.full((3, 2 * experts.intermediate_dim), 4 * limit)  # gate and up clamped to the limit
    assert torch.equal(experts.activate(big), torch.full((3, experts.intermediate_dim),
                                                         limit * torch.sigmoid(torch.tensor(limit)).item() * limit))


# Whose init reaches beyond each module's own tensors: GPT-2's attention rescales its c_proj (and
# its head is tied); ModernBERT's decoder draws truncated normals (which torch skips on the meta
# device) from its parents, the model for its head; Falcon-H1's model writes every layer's
# mup_vector; AFMoE's MoE block zeroes its router's; Apertus' xIELU alphas and OpenAI GPT's Conv1D
# weights come from their constructors alone.
@pytest.mark.parametrize("model_type", ["gpt2", "modernbert-decoder", "falcon_h1", "afmoe", "apertus", "openai-gpt"])
def test_init_by_name_gives_the_whole_models_init(model_type):
    from hyperparallel.models.init import init_by_name
    from hyperparallel.models.tiny import tiny_config_values

    config = tiny_config_values(model_type)
    whole = build_model(model_type, config=config, seed=3)
    with torch.device("meta"):
        shadow = build_model(model_type, config=config, materialize=False)
    tensors = dict(whole.named_parameters(remove_duplicate=False)) | dict(whole.named_buffers(remove_duplicate=False))
    got: dict[int, torch.Tensor] = {}  # by the whole model's tensor: a tied one keeps the first value handed out
    init_by_name(shadow, 3, lambda name, value: got.setdefault(id(tensors[name]), value.clone()))

    assert set(got) == {id(t) for t in tensors.values()}
    assert all(torch.equal(t, got[id(t)]) for t in tensors.values())
    assert all(t.is_meta for t in shadow.parameters())

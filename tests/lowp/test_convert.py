"""convert(): which modules are swapped, and that every Parameter object survives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from hyperparallel.lowp import ConversionReport, LowPrecisionConfig, MXLinear, convert
from hyperparallel.models import build_model, init_weights

ROOT = Path(__file__).resolve().parent.parent.parent


def tiny(family: str, fragment: str):
    config = yaml.safe_load((ROOT / "configs" / "models" / f"{fragment}.yaml").read_text())
    return build_model(family, config=config, dtype=torch.bfloat16, seed=0)


@pytest.mark.parametrize("family, fragment", [("qwen3", "qwen3_tiny"), ("qwen3_moe", "qwen3_moe_tiny"),
                                              ("kimi_k2", "kimi_k2_tiny")])
def test_parameters_names_and_optimizer_references_survive(family, fragment):
    model = tiny(family, fragment)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    report = convert(model, LowPrecisionConfig(enabled=True))
    assert report.replaced and not report.skipped
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert list(model.state_dict()) == keys
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in after.values()}
    ids = torch.randint(0, 512, (2, 64))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_defaults_leave_head_embeddings_and_routers_alone():
    model = tiny("qwen3_moe", "qwen3_moe_tiny")
    report = convert(model, LowPrecisionConfig(enabled=True))
    assert "lm_head" not in report.replaced
    assert not any(name.endswith("mlp.gate") for name in report.replaced)
    assert any(name.endswith("self_attn.q_proj") for name in report.replaced)
    assert any(name.endswith("mlp.experts") for name in report.replaced)
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.layers[0].self_attn.q_proj, MXLinear)


def test_modules_include_and_exclude_choose():
    model = tiny("qwen3_moe", "qwen3_moe_tiny")
    report = convert(model, LowPrecisionConfig(enabled=True, modules=["linear"], exclude=["*.k_proj", "lm_head"]))
    assert report.replaced and all(not n.endswith("experts") and not n.endswith("k_proj") for n in report.replaced)
    model = tiny("qwen3", "qwen3_tiny")
    report = convert(model, LowPrecisionConfig(enabled=True, include=["model.layers.0.*"]))
    assert report.replaced and all(n.startswith("model.layers.0.") for n in report.replaced)


def test_a_module_the_kernels_cannot_take_is_skipped_with_its_reason():
    model = nn.Sequential(nn.Linear(64, 50), nn.Linear(50, 64).double())
    report = convert(model, LowPrecisionConfig(enabled=True))
    assert report.replaced == ["0"] and [n for n, _ in report.skipped] == ["1"]  # 50: a partial block is fine
    assert "weight dtype torch.float64 is not one the MX kernels take" in report.skipped[0][1]
    assert "skipped 1: weight dtype" in report.summary()


def test_disabled_converts_nothing():
    model = tiny("qwen3", "qwen3_tiny")
    assert convert(model, LowPrecisionConfig(enabled=False)) == ConversionReport()


@pytest.mark.parametrize("family, fragment", [("qwen3", "qwen3_tiny"), ("qwen3_moe", "qwen3_moe_tiny")])
def test_converted_modules_initialize_like_the_originals(family, fragment):
    # DESIGN's order converts before materializing and initializing: the MX modules must get the
    # same draws as the modules they replaced
    plain = tiny(family, fragment)
    init_weights(plain, seed=0)
    converted = tiny(family, fragment)
    convert(converted, LowPrecisionConfig(enabled=True))
    with torch.no_grad():
        for p in converted.parameters():
            p.zero_()
    init_weights(converted, seed=0)
    for (name, a), (_, b) in zip(plain.named_parameters(), converted.named_parameters(), strict=True):
        assert torch.equal(a, b), name

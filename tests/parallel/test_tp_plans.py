"""Tensor parallelism applies the plan its family's entry declares (models/families.py), as data.

Over a fake process group: one process plays one TP rank, with no collectives run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyperparallel.errors import ConfigError
from hyperparallel.models import FAMILIES, build_model, get_family
from hyperparallel.moe import MoEBlock
from hyperparallel.parallel.tensor_parallel import apply_tensor_parallel

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(family: str):
    config = yaml.safe_load((ROOT / f"configs/models/{family}_tiny.yaml").read_text())
    return build_model(family, config=config, materialize=False)


@pytest.fixture
def fake_tp2():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("family", [name for name, f in FAMILIES.items() if f.tensor_parallel is not None])
def test_each_plan_names_modules_and_head_sizes_its_family_has(family):
    plan = get_family(family).tensor_parallel
    for layer in tiny_model(family).model.layers:
        attention = getattr(layer, plan.attention_at)
        for names, placement in plan.attention:
            held = [n for n in names.split("|") if getattr(attention, n, None) is not None]
            assert held or placement.style == "replicated", (family, names)
            assert all(isinstance(getattr(attention, size), int) for size in placement.head_size), (family, names)
        mlp = getattr(layer, plan.mlp_at)
        if isinstance(mlp, MoEBlock):
            assert (mlp.shared_experts is not None) == (plan.shared_experts is not None), family
            mlp = mlp.shared_experts
        if mlp is not None:
            assert all(getattr(mlp, names) is not None for names, _ in plan.mlp), family


def test_the_plan_applied_is_the_entrys_and_a_changed_entry_changes_it(fake_tp2):
    plan = get_family("qwen3").tensor_parallel
    state = apply_tensor_parallel(tiny_model("qwen3"), fake_tp2, sequence_parallel=False)
    assert ("model.layers.0.self_attn.q_norm", "replicated (gradient summed over tp)") in state.plan
    assert "model.layers.0.self_attn.q_norm.weight" in state.partial

    # the same family with q_norm left out of its data: nothing in the code knows q_norm
    without = dataclasses.replace(plan, attention=tuple(p for p in plan.attention if p[0] != "q_norm"))
    state = apply_tensor_parallel(tiny_model("qwen3"), fake_tp2, sequence_parallel=False, plan=without)
    assert not any("q_norm" in module for module, _ in state.plan)
    assert "model.layers.0.self_attn.q_norm.weight" not in state.partial


def test_a_family_without_a_plan_is_refused(fake_tp2):
    assert get_family("deepseek_v4").parallel_plans == ()
    with pytest.raises(ConfigError, match="family 'deepseek_v4' has no tensor-parallel plan"):
        apply_tensor_parallel(tiny_model("deepseek_v4"), fake_tp2, sequence_parallel=False)

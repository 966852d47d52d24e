"""Tensor parallelism applies the plan it is handed: transformers' own (`_tp_plan`, from each
config's `base_model_tp_plan`), with a tuned family's additions, as data; the code that applies
it knows no family.

Over a fake process group: one process plays one TP rank, with no collectives run. (Equality with
one process is tested on two real ranks: tests/dist/test_parallel_layouts.py, tests/models/
test_coverage.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyperparallel.models import build_model, get_family
from hyperparallel.models.families import tensor_parallel_plan
from hyperparallel.models.tiny import tiny_config_values
from hyperparallel.parallel.tensor_parallel import apply_tensor_parallel, plan_problem

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(family: str):
    path = ROOT / f"configs/models/{family}_tiny.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else tiny_config_values(family)
    return build_model(family, config=config, materialize=False)


def plan_of(family: str, model):
    return tensor_parallel_plan(get_family(family), model)


@pytest.fixture
def fake_tp2():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_qwen3_runs_transformers_own_plan_and_a_changed_plan_changes_it(fake_tp2):
    model = tiny_model("qwen3")
    plan = plan_of("qwen3", model)
    assert plan == model._tp_plan  # (no additions: transformers' plan is the whole of it)
    state = apply_tensor_parallel(model, fake_tp2, sequence_parallel=False, plan=plan)
    assert ("model.layers.0.self_attn.q_norm", "replicated (gradient summed over tp)") in state.plan
    assert ("model.layers.0.self_attn.q_proj", "column-parallel over heads") in state.plan
    assert "model.layers.0.self_attn.q_norm.weight" in state.partial

    # the same plan without the MLPs' entries: nothing in the code knows the MLPs, which stay whole
    without = {key: style for key, style in plan.items() if ".mlp." not in key}
    state = apply_tensor_parallel(tiny_model("qwen3"), fake_tp2, sequence_parallel=False, plan=without)
    assert not any(".mlp." in module for module, _ in state.plan)
    assert "model.layers.0.mlp.down_proj.weight" not in state.columns
    # ... and without q_norm's: inside the attention it still works on this rank's heads alone, so
    # its gradient is still summed over tp
    without = {key: style for key, style in plan.items() if not key.endswith("q_norm")}
    state = apply_tensor_parallel(tiny_model("qwen3"), fake_tp2, sequence_parallel=False, plan=without)
    assert not any("q_norm" in module for module, _ in state.plan)
    assert "model.layers.0.self_attn.q_norm.weight" in state.partial


def test_deepseek_v3_adds_its_latent_attention_to_transformers_plan(fake_tp2):
    model = tiny_model("deepseek_v3")
    plan = plan_of("deepseek_v3", model)
    assert plan.items() >= model._tp_plan.items()  # transformers' own entries (MLPs, shared experts) kept
    assert plan["model.layers.*.self_attn.kv_b_proj"] == "colwise"
    state = apply_tensor_parallel(model, fake_tp2, sequence_parallel=False, plan=plan)
    placed = dict(state.plan)
    assert placed["model.layers.0.self_attn.kv_b_proj"] == "column-parallel over heads"
    assert placed["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "replicated (gradient summed over tp)"
    assert placed["model.layers.1.mlp.shared_experts.down_proj"] == "row-parallel"
    assert not any(".experts." in module for module in placed)  # (expert parallelism splits the routed experts)


def test_fewer_key_value_heads_than_tp_are_replicated():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        model = tiny_model("qwen3")  # 4 query heads over 2 key/value heads
        state = apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=False, plan=plan_of("qwen3", model))
    finally:
        dist.destroy_process_group()
    assert dict(state.plan)["model.layers.0.self_attn.k_proj"] == "key/value head replicated over 2 ranks"
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.shape[0] == attention.head_dim  # the one head rank 3's query head uses
    assert attention.num_key_value_groups == 1
    assert state.partial["model.layers.0.self_attn.k_proj.weight"] == (1, 2)  # slot 1 of 2, summed among its sharers


def test_attention_sinks_are_split_with_the_query_heads_at_tp_above_the_key_value_heads():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        model = tiny_model("granite_swa")  # 4 query heads over 2 key/value heads, a sink per query head
        whole = model.model.layers[0].self_attn.sinks.shape
        state = apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=False,
                                      plan=plan_of("granite_swa", model))
    finally:
        dist.destroy_process_group()
    attention = model.model.layers[0].self_attn
    assert whole == (4,)
    assert attention.sinks.shape == (1,)  # rank 3's one query head's sink, not a key/value slot's half
    assert "model.layers.0.self_attn.sinks" not in state.partial


def test_what_cannot_run_is_named_in_one_line():
    gpt2 = tiny_model("gpt2")
    assert plan_of("gpt2", gpt2) == "transformers declares no tensor-parallel plan for it"
    v4 = tiny_model("deepseek_v4")
    assert "no tensor-parallel plan" in plan_of("deepseek_v4", v4)
    llama = tiny_model("llama")
    odd = dict(plan_of("llama", llama), **{"model.layers.*.self_attn.o_proj": "sequence_parallel"})
    assert plan_problem(llama, odd, 2) == ("the tensor-parallel plan puts model.layers.0.self_attn.o_proj as "
                                           "'sequence_parallel', which hyperparallel's tensor parallelism does not run")
    assert plan_problem(llama, plan_of("llama", llama), 3) == ("parallel.tp (3) must divide the attention heads "
                                                               "(num_attention_heads = 4) that "
                                                               "model.layers.0.self_attn.q_proj holds")
    assert "splits no row-parallel projection" in plan_problem(llama, {"model.embed_tokens": "embedding_rowwise"}, 2)

"""Any causal LM of transformers through the trainer: a representative subset of docs/models.md's
sweep (scripts/model_coverage.py), beyond the four tuned families: ten dense architectures and
ten MoE ones, each trained 2 steps in one process (fp32), in MXFP8, exported and loaded by
`AutoModelForCausalLM.from_pretrained` with transformers' own class and keys, and on two gloo
ranks in every layout that applies (FSDP dp_shard=2, EP ep=2, TP tp=2, CP cp=2), whose losses
must equal one process's within 1e-5 relative (hyperparallel/train/coverage.py runs each case;
the two-rank ones in the session's shared spawn, tests/dist/spawn.py's "coverage" part).

A layout the trainer refuses gives its one-line reason; the ones listed in RUNS run. Each
architecture brings something the others do not: sliding windows and logit soft-capping (Gemma
3), packed projections that transformers' plan leaves whole (Phi-3), Conv1D layers and no plan
(GPT-2), parallel attention and MLP with biases (GPT-NeoX), biased row-parallel projections
(StarCoder2), norms over whole projections (OLMo 2), a scaled head (Cohere), a state-space model
(Mamba); routers of every kind, shared experts with a gate (Qwen2-MoE), transposed experts with
biases, sinks and their own SwiGLU (GPT-OSS), experts without a gate (Nemotron-H), routers with a
correction bias (GLM-4-MoE), a hybrid of attention and Mamba (Jamba).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hyperparallel.train import coverage

DENSE = ["llama", "mistral", "gemma3_text", "phi3", "gpt2", "gpt_neox", "starcoder2", "olmo2", "cohere", "mamba"]
MOE = ["mixtral", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "deepseek_v2", "glm4_moe", "jamba", "nemotron_h",
       "hunyuan_v1_moe"]
TYPES = DENSE + MOE

# The two-rank layouts that run beyond FSDP (which every one must), with transformers 5.25 (whose
# plans added TP to Jamba, Nemotron-H and HunYuan-MoE); the others are refused, each
# with its one-line reason (sliding windows and state-space layers for CP, plans that keep every
# projection whole or name none for TP)
RUNS = {
    "llama": {"tp", "cp"}, "mistral": {"tp"}, "gemma3_text": {"tp"}, "phi3": {"cp"}, "gpt2": {"cp"},
    "gpt_neox": {"tp", "cp"}, "starcoder2": {"tp", "cp"}, "olmo2": {"tp", "cp"}, "cohere": {"cp"}, "mamba": set(),
    "mixtral": {"ep", "tp", "cp"}, "qwen2_moe": {"ep", "tp", "cp"}, "olmoe": {"ep", "cp"}, "gpt_oss": {"ep"},
    "granitemoe": {"ep", "cp"}, "deepseek_v2": {"ep", "tp", "cp"}, "glm4_moe": {"ep", "tp", "cp"},
    "jamba": {"ep", "tp"}, "nemotron_h": {"ep", "tp"}, "hunyuan_v1_moe": {"ep", "tp", "cp"},
}
# (GPT-2's layers are transformers' Conv1D, which MXFP8 does not convert)
NO_MXFP8 = {"gpt2"}
MXFP8_RTOL = 3e-2


def on_ranks(rank: int, world: int, out: str) -> dict:
    """Every architecture's two-rank layouts (the shared 2-rank spawn's "coverage" part)."""
    import os

    os.environ["HYPERPARALLEL_CACHE"] = str(Path(out) / "cache")
    results = {}
    for model_type in TYPES:
        layouts = [layout for layout, why in coverage.applicable(model_type).items() if why is None]
        results[model_type] = coverage.on_ranks(model_type, Path(out) / model_type, layouts)
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    import os

    root = tmp_path_factory.mktemp("coverage")
    os.environ["HYPERPARALLEL_CACHE"] = str(root / "cache")
    return {model_type: coverage.reference(model_type, root / model_type) for model_type in TYPES}


@pytest.fixture(scope="module")
def ranks(spawn_2) -> dict[str, dict]:
    return spawn_2["coverage"][0]


@pytest.mark.parametrize("model_type", TYPES)
def test_trains_in_one_process_in_mxfp8_and_exports(references, model_type):
    cells = {name: coverage.Cell(**cell) for name, cell in references[model_type].items()}
    assert cells["train"].ran and len(cells["train"].losses) == coverage.STEPS, cells["train"]
    mxfp8 = cells["mxfp8"]
    assert mxfp8.ran and mxfp8.note.startswith("MXFP8: 0 modules") == (model_type in NO_MXFP8), mxfp8
    assert len(mxfp8.losses) == coverage.STEPS and all(math.isfinite(x) for x in mxfp8.losses), mxfp8
    # MXFP8's losses near fp32's: 1.2e-3 relative at most over these types (2.8e-3 over the whole
    # sweep, docs/models.jsonl); gpt2 converts nothing (its losses are fp32's)
    worst = max(abs(m - f) / abs(f) for m, f in zip(mxfp8.losses, cells["train"].losses, strict=True))
    assert worst <= MXFP8_RTOL, (model_type, worst)
    assert cells["export"].ran, cells["export"]


@pytest.mark.parametrize("model_type", TYPES)
def test_two_ranks_equal_one_process_or_refuse_in_one_line(references, ranks, model_type):
    for layout, cell in ranks[model_type].items():
        reference = coverage.Cell(**coverage.reference_of(references[model_type], layout))
        result = coverage.compare(coverage.Cell(**cell), reference, model_type)
        assert not result.failed, (model_type, layout, result.failed, result.note)
        if not result.ran:  # (refused before the run wrote anything: coverage.run_case)
            assert result.refused.count("\n") == 0, (model_type, layout, result.refused)
    ran = {layout for layout, cell in ranks[model_type].items() if coverage.Cell(**cell).ran}
    assert ran == {"fsdp", *RUNS[model_type]}, (model_type, {k: v["refused"] for k, v in ranks[model_type].items()})

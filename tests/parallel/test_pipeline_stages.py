"""Pipeline stages as numbers and as what a rank holds: the pp axis of the mesh, the balanced
split of the decoder layers, which stages a rank runs, the layout's refusals, and a model cut to
one rank's stages on the meta device (the one-process names kept)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from torch import nn

from hyperparallel.models import build_model
from hyperparallel.models.layers import LayerOnAnotherStage, decoder_layer_names, layer_list
from hyperparallel.parallel.mesh import MeshShape, layout_problems
from hyperparallel.parallel.pipeline import (
    HeldByLastStage,
    StageInput,
    StageLayout,
    balanced_split,
    hold_stages,
    stage_layout,
)

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_pp_is_the_outermost_dimension_of_the_mesh():
    groups = MeshShape(pp=2, dp_shard=2).groups()
    assert groups["pp"] == [[0, 2], [1, 3]]  # a rank of each stage, at the same place in it
    assert groups["fsdp"] == [[0, 1], [2, 3]]  # FSDP within each stage's block of ranks
    shape = MeshShape(pp=2, tp=2, dp_shard=2)
    assert shape.world == 8 and shape.stage_world == 4 and shape.dp_size == 2
    assert shape.coordinates(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "cp": 1 - 1, "tp": 1}


def _costliest(costs: list[float], cuts: tuple[int, ...], extra: float) -> float:
    loads = [sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, len(costs)))]
    loads[-1] += extra
    return max(loads)


def test_the_balanced_split_is_the_least_costly_stage_of_every_split():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages, extra in ((2, 0.0), (3, 0.0), (4, 7.0)):
        counts = balanced_split(costs, stages, extra)
        assert sum(counts) == len(costs) and min(counts) >= 1
        best = min(_costliest(costs, c, extra) for c in itertools.combinations(range(1, len(costs)), stages - 1))
        assert _costliest(costs, tuple(itertools.accumulate(counts[:-1])), extra) == best
    assert balanced_split([1.0] * 8, 4) == [2, 2, 2, 2]
    assert balanced_split([1.0] * 8, 2, last_extra=2.0) == [5, 3]  # the head's work on the last stage


def test_each_schedule_deals_its_stages_to_the_ranks():
    bounds = tuple((i, i + 1) for i in range(8))
    assert StageLayout(4, 2, "interleaved_1f1b", bounds).stages_of(1) == [1, 5]
    assert StageLayout(2, 1, "1f1b", bounds[:2]).stages_of(1) == [1]


def parallel(**settings):
    base = dict(ep=1, dp_replicate=1, dp_shard=1, tp=1, cp=1, pp=1, pp_schedule="1f1b", pp_virtual_stages=1,
                pp_layers=None, sync_every_micro_batch=False, sequence_parallel=False)
    return SimpleNamespace(**(base | settings))


@pytest.mark.parametrize(("settings", "world", "said"), [
    ({"pp": 2, "dp_shard": 2}, 2, "parallel.pp (2) x parallel.dp_replicate (1) x parallel.dp_shard (2)"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, 2, "set parallel.pp_virtual_stages: 2 or more"),
    ({"pp": 2, "pp_virtual_stages": 2}, 2, "1f1b runs one stage a rank"),
    ({"pp": 2, "tp": 2, "sequence_parallel": True}, 4, "set sequence_parallel: false"),
    ({"pp": 2, "pp_layers": [1, 1, 2]}, 2, "the pipeline has pp x pp_virtual_stages = 2"),
])
def test_pipeline_layouts_a_run_cannot_take_are_named(settings, world, said):
    problems = layout_problems(parallel(**settings), world)
    assert any(said in line for line in problems), problems


def test_a_rank_holds_its_stages_under_their_one_process_names():
    whole = build_model("llama", config=LLAMA | {"tie_word_embeddings": False}, materialize=False)
    names = {n for n, _ in whole.named_parameters()}
    held = {}
    for rank in range(2):
        model = build_model("llama", config=LLAMA | {"tie_word_embeddings": False}, materialize=False)
        layout = stage_layout(model, 2, 1, "1f1b", None)
        assert layout.layers == ((0, 2), (2, 4))  # (the head, 4096 parameters, is under half a layer)
        assert hold_stages(model, layout, rank) == [rank]
        held[rank] = {n for n, _ in model.named_parameters()}
        assert decoder_layer_names(model) == [f"model.layers.{i}" for i in range(2 * rank, 2 * rank + 2)]
        assert sum(isinstance(layer, LayerOnAnotherStage) for layer in layer_list(model)) == 2
        assert isinstance(model.get_input_embeddings(), nn.Embedding if rank == 0 else StageInput)
        assert isinstance(model.lm_head, HeldByLastStage if rank == 0 else nn.Linear)
    assert held[0] | held[1] == names and not held[0] & held[1]
    assert "model.embed_tokens.weight" in held[0] and {"lm_head.weight", "model.norm.weight"} <= held[1]


def test_a_head_tied_to_the_embedding_is_held_by_the_first_and_last_stages_under_the_embeddings_name():
    """The last stage keeps the embedding module beside the head (one weight): the weight has the
    one-process name on both ranks; a middle stage holds neither."""
    held = {}
    for rank in range(3):
        model = build_model("llama", config=LLAMA | {"tie_word_embeddings": True, "num_hidden_layers": 3},
                            materialize=False)
        hold_stages(model, stage_layout(model, 3, 1, "1f1b", None), rank)
        held[rank] = dict(model.named_parameters())
        if rank == 2:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert "model.embed_tokens.weight" in held[0] and "model.embed_tokens.weight" in held[2]
    assert not any("embed_tokens" in name or "lm_head" in name for name in held[1])
    assert "lm_head.weight" not in held[2]  # (the same Parameter: named once, as the embedding)

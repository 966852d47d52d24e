"""`plan_hf_read` / `HFReadPlan.read`: a Hugging Face safetensors directory read block by block into
the model's own layout (experts stacked, gate and up concatenated, DeepSeek-V4's names), checked
against the state dict of the model save_pretrained wrote it from."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from hyperparallel.checkpoint import hf_files
from hyperparallel.checkpoint.hf_files import INDEX_FILE, plan_hf_read, read_headers
from hyperparallel.checkpoint.sharded import Chunk
from hyperparallel.errors import CheckpointError, ShapeError
from hyperparallel.models import build_model

ROOT = Path(__file__).resolve().parent.parent.parent
FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v4"]


def tiny_config(family: str, **changes) -> dict:
    return dict(yaml.safe_load((ROOT / "configs" / "models" / f"{family}_tiny.yaml").read_text()), **changes)


@dataclass
class Saved:
    directory: Path
    state: dict[str, torch.Tensor]  # what save_pretrained wrote, in the model's names and layout
    meta: torch.nn.Module  # the same model on the meta device: what a rank plans with


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    """Each family's tiny model saved once by save_pretrained, in several shards."""
    root = tmp_path_factory.mktemp("hf_files")
    out = {}
    for family in FAMILIES:
        model = build_model(family, config=tiny_config(family))
        model.save_pretrained(root / family, max_shard_size="200KB")
        state = {key: value.detach().clone() for key, value in model.state_dict().items()}
        out[family] = Saved(root / family, state, build_model(family, config=tiny_config(family), materialize=False))
    return out


def read_all(plan, shapes_and_chunks: dict, dtype: torch.dtype | None = None, threads: int = 4) -> dict:
    targets = {key: (torch.empty(chunk.sizes if chunk is not None else plan.shapes[key], dtype=dtype or torch.float32),
                     chunk) for key, chunk in shapes_and_chunks.items()}
    plan.read(targets, threads=threads)
    return {key: destination for key, (destination, _) in targets.items()}


def block(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def chunk(shape, offsets, sizes) -> Chunk:
    return Chunk(torch.Size(shape), torch.Size(offsets), torch.Size(sizes))


def copy_files(source: Path, destination: Path, edit) -> Path:
    """A copy of a safetensors directory with `edit(file, tensors) -> tensors` applied to every
    file (the index follows)."""
    shutil.copytree(source, destination)
    index = json.loads((destination / INDEX_FILE).read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = edit(file, load_file(destination / file))
        save_file(tensors, destination / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
    index["weight_map"] = weight_map
    (destination / INDEX_FILE).write_text(json.dumps(index))
    return destination


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_read_whole_equals_the_state_dict(saved, family):
    case = saved[family]
    assert len(read_headers(case.directory)) > 1  # several shards
    plan = plan_hf_read(case.directory, case.meta)
    assert plan.shapes.keys() == case.state.keys()
    for threads in (1, 4):
        got = read_all(plan, dict.fromkeys(case.state), dtype=None, threads=threads)
        for key, value in case.state.items():
            assert got[key].dtype == torch.float32 and torch.equal(got[key], value.float()), key
    # the files hold each expert separately, and only the model has them stacked
    names = {name for tensors in read_headers(case.directory).values() for name in tensors}
    assert not any("gate_up_proj" in name for name in names)
    if family == "qwen3":  # tied to the embedding: not in the files, read from the embedding's tensor
        assert "lm_head.weight" not in names and plan.ties == {"lm_head.weight": "model.embed_tokens.weight"}
    if family == "deepseek_v4":  # DeepSeek's own names in the files
        assert "head.weight" in names and any(".ffn.experts.0.w1.weight" in name for name in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_of_any_layout_equal_those_slices_of_the_state_dict(saved, family):
    """FSDP rows on dim 0, an expert-parallel rank's experts, a TP rank's columns (across the
    gate / up boundary of gate_up_proj), in bfloat16 as well."""
    case = saved[family]
    plan = plan_hf_read(case.directory, case.meta)
    generator = torch.Generator().manual_seed(0)
    blocks = {}
    for key, value in case.state.items():
        shape = tuple(value.shape)
        if not shape:
            continue
        rows = int(torch.randint(1, shape[0] + 1, (1,), generator=generator))
        first = int(torch.randint(0, shape[0] - rows + 1, (1,), generator=generator))
        blocks[(key, "rows")] = chunk(shape, (first, *[0] * (len(shape) - 1)), (rows, *shape[1:]))
        if key.endswith("experts.gate_up_proj"):
            experts, columns = shape[0], shape[1] // 2  # gate, then up along dim 1
            blocks[(key, "ep")] = chunk(shape, (experts // 4, 0, 0), (experts // 2, *shape[1:]))
            blocks[(key, "tp")] = chunk(shape, (experts // 4, columns - 3, 0), (experts // 2, 8, shape[2]))
        elif len(shape) >= 2:
            columns = max(1, shape[1] // 3)
            blocks[(key, "tp")] = chunk(shape, (0, columns, *[0] * (len(shape) - 2)), (shape[0], columns, *shape[2:]))
    for dtype in (torch.float32, torch.bfloat16):
        for (key, layout), where in blocks.items():
            got = read_all(plan, {key: where}, dtype=dtype)[key]
            want = block(case.state[key], where.offsets, where.sizes).to(dtype)
            assert torch.equal(got, want), (key, layout, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_files_read_into_bfloat16_round_as_to_does(saved, family):
    case = saved[family]
    got = read_all(plan_hf_read(case.directory, case.meta), dict.fromkeys(case.state), dtype=torch.bfloat16)
    for key, value in case.state.items():
        assert torch.equal(got[key], value.to(torch.bfloat16)), key


def test_an_expert_parallel_rank_reads_only_its_experts_tensors(saved, tmp_path):
    """Planned on the whole files; then every expert tensor but experts 4..7 is taken out of the
    files: the rank of experts 4..7 reads as before, and expert 0 is not there to read."""
    case = saved["qwen3_moe"]
    plan = plan_hf_read(case.directory, case.meta)

    def own_experts_only(file, tensors):
        return {name: t for name, t in tensors.items()
                if ".experts." not in name or int(name.split(".experts.")[1].split(".")[0]) in range(4, 8)}

    stripped = copy_files(case.directory, tmp_path / "stripped", own_experts_only)
    assert sum(".experts." in name for tensors in read_headers(stripped).values() for name in tensors) == 2 * 4 * 3
    plan_of_stripped_files = dataclasses.replace(plan, directory=stripped)
    experts = {key: chunk(value.shape, (4, 0, 0), (4, *value.shape[1:]))
               for key, value in case.state.items() if ".experts." in key}
    for key, got in read_all(plan_of_stripped_files, experts).items():
        assert torch.equal(got, case.state[key][4:8]), key
    key = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(CheckpointError, match=r"cannot read model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        read_all(plan_of_stripped_files, {key: chunk(case.state[key].shape, (0, 0, 0), (1, *case.state[key].shape[1:]))})


def test_missing_unexpected_and_mis_shaped_tensors_are_one_error_and_nothing_is_read(saved, tmp_path, monkeypatch):
    case = saved["qwen3_moe"]
    gate, norm, q_proj = ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.norm.weight",
                          "model.layers.1.self_attn.q_proj.weight")
    added = []

    def edit(file, tensors):
        tensors.pop(gate, None)
        tensors.pop(norm, None)
        if q_proj in tensors:
            tensors[q_proj] = tensors[q_proj][:, :32].contiguous()
        if not added:
            added.append(file)
            tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
        return tensors

    edited = copy_files(case.directory, tmp_path / "edited", edit)
    opened = []
    monkeypatch.setattr(hf_files, "_read_into", lambda *args, **kwargs: opened.append(args))
    with pytest.raises(CheckpointError) as error:
        plan_hf_read(edited, case.meta)
    lines = str(error.value).splitlines()
    assert sorted(line.removeprefix(f"checkpoint {edited}: ") for line in lines) == sorted([
        "model.layers.0.mlp.experts.gate_up_proj lacks mlp.experts.3.gate_proj.weight (expert 3) in the files",
        f"model.layers.0.mlp.extra.weight in {added[0]} is no tensor of the model",
        "model.layers.1.self_attn.q_proj.weight is (64, 64) in the model but (64, 32) in the files",
        "model.norm.weight is missing from the files",
    ])
    assert opened == []  # nothing read: only the headers were


def test_a_model_of_other_shapes_is_refused_with_each_tensor_and_both_shapes(saved):
    case = saved["qwen3_moe"]
    wider = build_model("qwen3_moe", config=tiny_config("qwen3_moe", moe_intermediate_size=48), materialize=False)
    with pytest.raises(CheckpointError) as error:
        plan_hf_read(case.directory, wider)
    assert str(error.value).splitlines() == [
        f"checkpoint {case.directory}: model.layers.{layer}.mlp.experts.{name}" for layer in (0, 1)
        for name in ("down_proj is (16, 64, 48) in the model but (16, 64, 32) in the files",
                     "gate_up_proj is (16, 96, 64) in the model but (16, 64, 64) in the files")]
    fewer = build_model("qwen3_moe", config=tiny_config("qwen3_moe", num_experts=8), materialize=False)
    with pytest.raises(CheckpointError, match=r"gate_up_proj is \(8, 64, 64\) in the model but \(16, 64, 64\) in the"):
        plan_hf_read(case.directory, fewer)


def test_tensors_the_model_class_ignores_on_load_are_no_problem(saved, tmp_path):
    """DeepSeek-V3's multi-token-prediction layer (model.layers.61 of the release) is in its
    files; transformers ignores it on load, and so does the plan."""
    case = saved["deepseek_v3"]
    files = copy_files(case.directory, tmp_path / "mtp", lambda file, tensors: {
        **tensors, **({"model.layers.61.eh_proj.weight": torch.zeros(2, 2)} if file.startswith("model-00001") else {})})
    got = read_all(plan_hf_read(files, case.meta), dict.fromkeys(case.state))
    assert all(torch.equal(got[key], value) for key, value in case.state.items())


def test_a_conversion_that_is_no_placement_is_refused_naming_the_model_type(saved, monkeypatch):
    from transformers import conversion_mapping
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    def by_dim_1(model, *args, **kwargs):
        return [WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                                operations=[MergeModulelist(dim=1)])]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", by_dim_1)
    with pytest.raises(CheckpointError, match=r"sharded loading does not support model type 'qwen3_moe' "
                                              r"\(Qwen3MoeForCausalLM\)'s conversion .*MergeModulelist\(dim=1\)"):
        plan_hf_read(saved["qwen3_moe"].directory, saved["qwen3_moe"].meta)


def test_a_destination_that_is_not_its_block_is_refused(saved):
    case = saved["qwen3"]
    plan = plan_hf_read(case.directory, case.meta)
    key = "model.embed_tokens.weight"
    with pytest.raises(ShapeError, match="the destination is"):
        plan.read({key: (torch.empty(3, 64), chunk((512, 64), (0, 0), (4, 64)))})
    with pytest.raises(ShapeError, match=r"the chunk is of a \(512, 32\) tensor but the model's is \(512, 64\)"):
        plan.read({key: (torch.empty(4, 32), chunk((512, 32), (0, 0), (4, 32)))})
    with pytest.raises(CheckpointError, match="model.nothing is not a tensor of the model"):
        plan.read({"model.nothing": (torch.empty(1), None)})


def test_a_zero_dimensional_tensor_reads_whole_or_as_the_one_row_chunk_of_gives_it(tmp_path):
    save_file({"scale": torch.tensor(2.5), "other": torch.ones(2)}, tmp_path / "model.safetensors")
    model = torch.nn.Module()
    model.register_buffer("scale", torch.tensor(0.0, device="meta"))
    model.register_buffer("other", torch.zeros(2, device="meta"))
    plan = plan_hf_read(tmp_path, model)
    whole, row, none = torch.zeros(()), torch.zeros(1), torch.zeros(0)
    plan.read({"scale": (whole, None)})
    plan.read({"scale": (row, chunk((1,), (0,), (1,)))})
    plan.read({"scale": (none, chunk((1,), (1,), (0,)))})
    assert whole.item() == 2.5 and row.tolist() == [2.5]


def test_a_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor model.safetensors.index.json"):
        read_headers(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors is not a safetensors file"):
        read_headers(tmp_path)

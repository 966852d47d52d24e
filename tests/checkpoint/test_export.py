"""`export_hf` / `hyperparallel export`: a checkpoint becomes a Hugging Face directory that
`from_pretrained` (and the trainer's `model.path`) loads to the same logits as the trained model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hyperparallel.checkpoint import ModelCard, export_hf, load, save
from hyperparallel.checkpoint.export import build_from_card, parse_size
from hyperparallel.checkpoint.safetensors_stream import SafetensorsWriter
from hyperparallel.errors import CheckpointError, ConfigError
from hyperparallel.models import build_model, get_family

ROOT = Path(__file__).resolve().parent.parent.parent
TINY = {"qwen3": "qwen3_tiny", "qwen3_moe": "qwen3_moe_tiny", "deepseek_v3": "kimi_k2_tiny",
        "deepseek_v4": "deepseek_v4_tiny"}
IDS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(7))


def tiny_config(family: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / "models" / f"{TINY[family]}.yaml").read_text())


def model_card(model, family: str, dtype: str = "float32") -> dict:
    """What the trainer writes into a checkpoint's manifest."""
    return ModelCard.of(family, dtype, model.config).to_json()


def trained(family: str, steps: int = 2):
    """A tiny model a few AdamW steps away from its init (router and expert weights moved too)."""
    model = build_model(family, config=tiny_config(family))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def perturbed(family: str):
    """The same weights in every process: the init plus seeded noise."""
    model = build_model(family, config=tiny_config(family))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=g))
    return model


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.eval()(input_ids=IDS).logits


@pytest.mark.parametrize("family", list(TINY))
def test_export_loads_with_from_pretrained_and_as_model_path_to_the_same_logits(tmp_path, family):
    model = trained(family)
    checkpoint = save(tmp_path / "checkpoint", model, extra={"model": model_card(model, family)})
    out = export_hf(checkpoint, tmp_path / "hf")

    assert out == tmp_path / "hf" and not (tmp_path / "hf.tmp").exists()
    # no tokenizer: the checkpoint is not in a run directory
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == get_family(family).model_types[0] and config["dtype"] == "float32"
    if family != "qwen3":  # the published layout: one matrix per expert, as transformers 5 writes them
        names = load_file(out / "model.safetensors").keys()
        # (DeepSeek-V4's: the names of DeepSeek's own release, w1 = gate, w3 = up, w2 = down)
        one_expert = "ffn.experts.0.w1" if family == "deepseek_v4" else "mlp.experts.0.gate_proj"
        assert f"model.layers.1.{one_expert}.weight" in names
        assert not any(name.endswith("gate_up_proj") for name in names)

    want = logits(model)
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf) is get_family(family).model_class
    torch.testing.assert_close(logits(hf), want, rtol=1e-5, atol=1e-5)
    again = build_model(family, path=out)  # what the trainer does with model.path
    torch.testing.assert_close(logits(again), want, rtol=1e-5, atol=1e-5)


def test_a_trainer_checkpoint_exports_with_its_tokenizer_and_trains_again(tmp_path, monkeypatch):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from hyperparallel.train import data
    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.loop import train

    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))
    raw = {
        "model": {"family": "qwen3_moe", "config": tiny_config("qwen3_moe")},
        "data": {"max_corpus_bytes": 60_000, "vocab_size": 512, "seq_len": 32, "validation": None},
        "training": {"steps": 2, "global_batch": 4, "micro_batch": 2, "seed": 1, "compile": "none"},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"warmup_steps": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "every": 1, "progress": False},
    }
    train(from_mapping(raw))
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_00000002"
    out = export_hf(checkpoint, tmp_path / "hf")

    assert (out / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    # AutoTokenizer encodes as training did (the family's own tokenizer class would not) and knows EOS / PAD
    tokenizer, trained_with = AutoTokenizer.from_pretrained(out), Tokenizer.from_file(str(run / "tokenizer.json"))
    text = "def export(checkpoint):\n    return  {'a': 1}  # done"
    assert tokenizer(text).input_ids == trained_with.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert (tokenizer.eos_token, tokenizer.pad_token) == (data.EOS, data.PAD)
    # the run's chat template comes along (the builtin tokenizer's ChatML)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    reference = build_model("qwen3_moe", config=dict(tiny_config("qwen3_moe"), vocab_size=512))
    load(checkpoint, reference)
    torch.testing.assert_close(logits(build_model("qwen3_moe", path=out)), logits(reference), rtol=1e-5, atol=1e-5)

    raw["model"] = {"family": "qwen3_moe", "path": str(out)}
    raw["training"]["steps"] = 1
    raw["logging"]["run_dir"] = str(tmp_path / "again")
    summary = train(from_mapping(raw))
    assert summary["last_loss"] is not None and (tmp_path / "again" / "checkpoints" / "step_00000001").is_dir()


def test_bfloat16_export_holds_the_rounded_weights(tmp_path):
    model = trained("qwen3")
    out = export_hf(save(tmp_path / "checkpoint", model, extra={"model": model_card(model, "qwen3")}),
                    tmp_path / "hf", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(out / "model.safetensors")
    want = model.state_dict()
    assert tensors.keys() == want.keys() - {"lm_head.weight"}  # tied to the embedding: saved once
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name].to(torch.bfloat16)), name


SHARDED = Path("run") / "checkpoints" / "step_00000001"  # where the trainer would put it, in the part's directory


def on_ranks(rank: int, world: int, out_dir: str) -> None:
    """On a rank of the session's shared 2-rank spawn (tests/dist/spawn.py): the perturbed
    Qwen3-MoE sharded unevenly and saved with its model card, as the trainer saves it (also what
    tests/train/test_generate.py generates from)."""
    from hyperparallel.parallel import shard_model

    model = perturbed("qwen3_moe")
    card = model_card(model, "qwen3_moe")
    shard_model(model, geometry="balanced", align=32)  # uneven shards: some ranks hold no rows of a tensor
    save(Path(out_dir) / SHARDED, model, extra={"model": card})


def test_a_checkpoint_of_two_sharded_ranks_exports_as_one_process_would(spawn_2, spawn_dir, tmp_path):
    assert "export" in spawn_2
    model = perturbed("qwen3_moe")
    one = export_hf(save(tmp_path / "one", model, extra={"model": model_card(model, "qwen3_moe")}), tmp_path / "hf1")
    two = export_hf(spawn_dir / "export" / SHARDED, tmp_path / "hf2")

    one_tensors, two_tensors = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert one_tensors.keys() == two_tensors.keys()
    for name, tensor in one_tensors.items():
        assert torch.equal(two_tensors[name], tensor), name
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(two)), logits(model), rtol=1e-5, atol=1e-5)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model = build_model("qwen3", config=tiny_config("qwen3"))
    return save(tmp_path / "run" / "checkpoints" / "step_00000001", model, extra={"model": model_card(model, "qwen3")})


def test_a_checkpoint_without_a_model_card_is_refused(tmp_path):
    model = build_model("qwen3", config=tiny_config("qwen3"))
    with pytest.raises(CheckpointError, match="has no model card"):
        export_hf(save(tmp_path / "bare", model), tmp_path / "hf")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        export_hf(tmp_path / "nowhere", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_destination_is_refused_and_an_empty_one_is_filled(checkpoint, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=f"{taken} is a non-empty directory"):
        export_hf(checkpoint, taken)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_hf(checkpoint, empty) / "model.safetensors").is_file()
    with pytest.raises(ConfigError, match="export dtype is 'float16'"):
        export_hf(checkpoint, tmp_path / "hf", dtype="float16")


@pytest.mark.parametrize("family, message", [
    ("qwen3_moe", "family 'qwen3_moe' but its HF config has model_type 'qwen3'"),
    ("llama", "family 'llama' but its HF config has model_type 'qwen3'"),
    ("lama", "its model card names model type 'lama' is no causal LM transformers knows; did you mean 'llama'"),
])
def test_a_card_whose_family_does_not_fit_is_refused(tmp_path, family, message):
    model = build_model("qwen3", config=tiny_config("qwen3"))
    checkpoint = save(tmp_path / "checkpoint", model, extra={"model": model_card(model, family)})
    with pytest.raises(CheckpointError, match=message):
        export_hf(checkpoint, tmp_path / "hf")


def test_a_failed_export_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    written = []

    def fail(self, name, tensor):  # the disk fills up after config.json and a few tensors
        if len(written) == 3:
            raise OSError("disk full")
        written.append(name)
        real_write(self, name, tensor)

    real_write = SafetensorsWriter.write
    monkeypatch.setattr(SafetensorsWriter, "write", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf(checkpoint, tmp_path / "hf", max_shard_size="100KB")
    assert len(written) == 3
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_the_export_command(checkpoint, cli, tmp_path):
    """In this process (tests/conftest.py's `cli`): what it writes and how it fails."""
    result = cli("export", str(checkpoint), "hf", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert "exported" in result.stdout and (tmp_path / "hf" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"

    result = cli("export", str(checkpoint), "hf")  # hf is taken now
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hf is a non-empty directory" in errors[0], result.stderr

    result = cli("export", str(checkpoint), "shards", "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors.index.json" in result.stdout and (tmp_path / "shards" / "model-00001-of-00005.safetensors").is_file()
    result = cli("export", str(checkpoint), "other", "--max-shard-size", "5XB")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr and not (tmp_path / "other").exists()
    assert errors == ["error: max_shard_size '5XB' is not a size: give a number of bytes or one with a unit, such as "
                      "5GB or 200MB"], result.stderr


def test_shard_sizes_are_read_as_save_pretrained_reads_them():
    assert [parse_size(v) for v in (123, "123", "200KB", "5GB", "5gb", " 1.5 MB", "2GiB", "1TB")] == [
        123, 123, 200_000, 5 * 10**9, 5 * 10**9, 1_500_000, 2 * 2**30, 10**12]
    for bad in ("5XB", "GB", "-1", 0, "", True, 1.5):
        with pytest.raises(ConfigError, match="is not a size"):
            parse_size(bad)


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("family, dtype, max_shard_size", [
    ("qwen3", None, "5GB"), ("qwen3", "bfloat16", "100KB"), ("qwen3_moe", None, "100KB"),
    ("deepseek_v3", None, "100KB"), ("deepseek_v4", "bfloat16", "100KB"), ("deepseek_v4", None, 60_000),
])
def test_a_streamed_export_writes_what_save_pretrained_writes(tmp_path, family, dtype, max_shard_size):
    """The same tensors (names, dtypes, values), config.json and generation_config.json as
    save_pretrained of the model loaded whole; shards of at most max_shard_size bytes of tensors,
    named as save_pretrained names them, with a correct index; and from_pretrained loads it."""
    model = perturbed(family)
    checkpoint = save(tmp_path / "checkpoint", model, extra={"model": model_card(model, family)})
    out = export_hf(checkpoint, tmp_path / "hf", dtype=dtype, max_shard_size=max_shard_size)
    reference = build_from_card(ModelCard.from_manifest(checkpoint, json.loads((checkpoint / "checkpoint.json")
                                                                              .read_text())), checkpoint)
    load(checkpoint, reference)
    reference.to(getattr(torch, dtype or "float32")).save_pretrained(tmp_path / "reference", max_shard_size=max_shard_size)

    got, want = tensors_of(out), tensors_of(tmp_path / "reference")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((tmp_path / "reference" / name).read_text()), name

    files = sorted(p.name for p in out.glob("*.safetensors"))
    limit = parse_size(max_shard_size)
    if limit > 10**6:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    else:
        assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        reference_index = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
        assert index["metadata"] == reference_index["metadata"]  # total_size, total_parameters
        assert index["weight_map"].keys() == got.keys() and set(index["weight_map"].values()) == set(files)
        for file in files:
            tensors = load_file(out / file)
            assert {n for n, f in index["weight_map"].items() if f == file} == tensors.keys()
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            assert nbytes <= limit or len(tensors) == 1, (file, nbytes)
    if dtype is None:  # (transformers 5.17's DeepSeek-V4 has no bfloat16 forward on the CPU)
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)),
                                   logits(AutoModelForCausalLM.from_pretrained(tmp_path / "reference")), rtol=0, atol=0)


PEAK = """
import json, sys, torch
from hyperparallel.checkpoint import ModelCard, read_manifest
from hyperparallel.checkpoint.export import export_hf, meta_model_from_card, model_from_checkpoint
import transformers.core_model_loading, transformers.modeling_utils, torch.distributed.checkpoint


def status(field):  # kB
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])


checkpoint, out, how = sys.argv[1:]
meta_model_from_card(ModelCard.from_manifest(checkpoint, read_manifest(checkpoint)), checkpoint)  # imports its class
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size (VmHWM) starts again from the present one
before = status("VmRSS:")
if how == "export":
    export_hf(checkpoint, out, batch_bytes=2_000_000)
else:
    model = model_from_checkpoint(checkpoint)  # the whole model in memory: what the measure must see
print(json.dumps({"peak_above_baseline": (status("VmHWM:") - before) * 1024}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_a_streamed_export_holds_far_less_than_the_model(tmp_path):
    """The peak resident memory of an export process above what it held before the export
    (Linux's VmHWM, reset before it: every allocation, torch's included) is a small part of the
    model's bytes; loading the same model whole, measured the same way, is not."""
    config = dict(tiny_config("qwen3"), hidden_size=256, intermediate_size=768, num_hidden_layers=16,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=2048)
    model = build_model("qwen3", config=config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > 40 * 2**20
    checkpoint = save(tmp_path / "checkpoint", model, extra={"model": model_card(model, "qwen3")})
    del model

    def peak(how: str) -> int:
        run = subprocess.run([sys.executable, "-c", PEAK, str(checkpoint), str(tmp_path / how), how],
                             capture_output=True, text=True, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.strip().splitlines()[-1])["peak_above_baseline"]

    streamed, whole = peak("export"), peak("whole")
    print(f"peak above baseline: streamed export {streamed / 2**20:.1f} MiB, whole model {whole / 2**20:.1f} MiB, "
          f"model {model_bytes / 2**20:.1f} MiB")
    assert whole > 0.9 * model_bytes, (whole, model_bytes)  # the measure sees the tensors
    assert streamed < model_bytes / 4, (streamed, model_bytes)
    assert (tmp_path / "export" / "model.safetensors").is_file()

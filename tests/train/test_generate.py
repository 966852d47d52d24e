"""`generate` / `hyperparallel generate`: a checkpoint of any layout and its export continue a
prompt with the same tokens, greedy ones equal to transformers' `generate`; sampling is seeded."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hyperparallel.checkpoint import export_hf, read_manifest, save
from hyperparallel.errors import CheckpointError, ConfigError
from hyperparallel.train.generate import generate
from tests.train.test_loop import config

PROMPT = "def main("
NEW = 24


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3-MoE trained 6 steps (far enough from its init to write varied tokens, not so
    far that greedy decoding repeats one), its checkpoint and its export."""
    from hyperparallel.train.loop import train

    root = tmp_path_factory.mktemp("generate")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYPERPARALLEL_CACHE", str(root / "cache"))
        train(config(root, "qwen3_moe", training={"compile": "none"}, optimizer={"lr": 1e-3},
                     logging={"every": 100}))
    checkpoint = root / "run" / "checkpoints" / "step_00000006"
    return {"root": root, "checkpoint": checkpoint, "hf": export_hf(checkpoint, root / "hf")}


@pytest.fixture(scope="module")
def greedy(run) -> list[int]:
    return generate(run["checkpoint"], PROMPT, max_new_tokens=NEW).token_ids


def test_greedy_tokens_of_a_checkpoint_and_its_export_are_the_same_and_transformers_generates_them(run, greedy):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = Tokenizer.from_file(str(run["root"] / "run" / "tokenizer.json"))
    result = generate(run["hf"], PROMPT, max_new_tokens=NEW)
    assert result.token_ids == greedy
    assert len(set(greedy)) >= 4, greedy  # varied: a wrong position or cache would show
    assert result.stop_reason == "max_new_tokens" and len(greedy) == NEW
    assert result.prompt_ids == tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert result.text == PROMPT + result.continuation
    assert result.text == tokenizer.decode(result.prompt_ids + greedy)

    eos = tokenizer.token_to_id("<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(run["hf"]).eval()
    settings = GenerationConfig(do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos)
    out = model.generate(torch.tensor([result.prompt_ids]), generation_config=settings)
    assert out[0, len(result.prompt_ids):].tolist() == greedy


def test_a_checkpoint_of_two_sharded_ranks_generates_the_same_tokens(run, spawn_2, spawn_dir, tmp_path):
    """The perturbed Qwen3-MoE of tests/checkpoint/test_export.py, saved by the 2 ranks of the
    session's shared spawn in uneven shards (balanced, align 32: some ranks hold no rows of a
    tensor) and saved by one process, each beside the run's tokenizer: the same greedy tokens."""
    from tests.checkpoint.test_export import SHARDED, model_card, perturbed

    assert "export" in spawn_2
    sharded = tmp_path / "two" / "checkpoints" / "step_00000001"
    shutil.copytree(spawn_dir / "export" / SHARDED, sharded)
    assert read_manifest(sharded)["world_size"] == 2
    model = perturbed("qwen3_moe")
    one = save(tmp_path / "one" / "checkpoints" / "step_00000001", model,
               extra={"model": model_card(model, "qwen3_moe")})
    for run_dir in ("one", "two"):
        shutil.copyfile(run["root"] / "run" / "tokenizer.json", tmp_path / run_dir / "tokenizer.json")
    want = generate(one, PROMPT, max_new_tokens=NEW).token_ids
    assert len(set(want)) >= 4, want  # varied: a misplaced row would show
    assert generate(sharded, PROMPT, max_new_tokens=NEW).token_ids == want


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(run, greedy):
    state = torch.get_rng_state()
    sample = [generate(run["checkpoint"], PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed).token_ids
              for seed in (0, 0, 1, 2)]
    assert torch.equal(torch.get_rng_state(), state)
    assert sample[0] == sample[1]
    assert len({tuple(s) for s in sample}) == 3 and greedy not in sample
    top_1 = generate(run["checkpoint"], PROMPT, max_new_tokens=NEW, temperature=1.5, top_k=1, seed=3)
    assert top_1.token_ids == greedy
    assert generate(run["root"] / "run", PROMPT, max_new_tokens=NEW).token_ids == greedy  # a run: its newest checkpoint
    again = generate(run["hf"], PROMPT, max_new_tokens=NEW, temperature=0.8, top_k=20, seed=5).token_ids
    assert again == generate(run["checkpoint"], PROMPT, max_new_tokens=NEW, temperature=0.8, top_k=20,
                             seed=5).token_ids


def test_generation_stops_at_the_end_of_text_token_and_at_the_last_position(run, greedy, tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from hyperparallel.checkpoint import export

    # pretend the 4th greedy token ends documents: generation stops right after it
    token = Tokenizer.from_file(str(run["hf"] / "tokenizer.json")).id_to_token(greedy[3])
    monkeypatch.setattr(export, "end_of_text_token", lambda vocab: token)
    result = generate(run["hf"], PROMPT, max_new_tokens=NEW)
    assert result.stop_reason == "end_of_text" and result.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    monkeypatch.undo()

    short = shrunk(run["hf"], tmp_path / "short", max_position_embeddings=len(result.prompt_ids) + 5)
    result = generate(short, PROMPT, max_new_tokens=NEW)
    assert result.stop_reason == "max_position_embeddings" and result.token_ids == greedy[:5]


def shrunk(hf: Path, out: Path, **config) -> Path:
    """A copy of an HF directory with some config.json keys changed."""
    shutil.copytree(hf, out)
    values = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**values, **config}))
    return out


def test_each_mistake_is_named(run, tmp_path):
    checkpoint, hf = run["checkpoint"], run["hf"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    shutil.copytree(checkpoint, tmp_path / "loose" / "step_1")  # not in a run directory
    shutil.copytree(hf, tmp_path / "bare")
    (tmp_path / "bare" / "tokenizer.json").unlink()
    shutil.copytree(checkpoint, tmp_path / "partial.tmp")
    (tmp_path / "partial.tmp" / "checkpoint.json").unlink()  # what a killed save leaves
    llama = shrunk(hf, tmp_path / "llama", model_type="llama")  # Qwen3's files under Llama's config
    bert = shrunk(hf, tmp_path / "bert", model_type="bert")
    tiny = shrunk(hf, tmp_path / "tiny", max_position_embeddings=2)
    cases = [
        (tmp_path / "nowhere", {}, ConfigError, "nowhere does not exist"),
        (tmp_path / "file.txt", {}, ConfigError, "file.txt is a file"),
        (tmp_path / "empty", {}, ConfigError, r"empty is neither a checkpoint .* nor a Hugging Face directory"),
        (tmp_path / "loose" / "step_1", {}, ConfigError,
         r"no tokenizer for checkpoint .*loose/step_1: .*tokenizer.json does not exist"),
        (tmp_path / "bare", {}, ConfigError, r"no tokenizer for .*bare/tokenizer.json does not exist"),
        (tmp_path / "partial.tmp", {}, CheckpointError, "partial.tmp is not a complete checkpoint"),
        (llama, {}, CheckpointError, r"checkpoint .*llama: model.layers.0.mlp.experts.0.down_proj.weight in model.safetensors is no tensor of "
         r"the model"),
        (bert, {}, ConfigError, r"config.json: model type 'bert' is an encoder, .* trains text decoder-only causal LMs"),
        (tiny, {}, ConfigError, r"the prompt is \d+ tokens; .* at most 2 positions \(max_position_embeddings\)"),
        (hf, {"prompt": ""}, ConfigError, "the prompt is empty"),
        (hf, {"max_new_tokens": 0}, ConfigError, "max_new_tokens must be an integer of at least 1; got 0"),
        (hf, {"temperature": -0.5}, ConfigError, "temperature must be a number >= 0 .*got -0.5"),
        (hf, {"top_k": 0}, ConfigError, "top_k must be an integer of at least 1"),
    ]
    for source, options, error, message in cases:
        options = {"prompt": PROMPT, **options}
        with pytest.raises(error, match=message):
            generate(source, options.pop("prompt"), **options)


def test_the_generate_command(run, cli, tmp_path):
    """In this process (tests/conftest.py's `cli`): what it prints and how it fails."""
    result = cli("generate", str(run["checkpoint"]), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature",
                 "0.7", "--top-k", "50", "--seed", "4")
    assert result.returncode == 0, result.stderr
    want = generate(run["checkpoint"], PROMPT, max_new_tokens=8, temperature=0.7, top_k=50, seed=4)
    assert result.stdout == want.text + "\n"
    assert re.fullmatch(r"8 new tokens in [\d.]+ s \([\d,.]+ tokens/s\), stopped by max new tokens\n", result.stderr)

    for args, message in [((str(tmp_path / "nowhere"), "--prompt", PROMPT), "nowhere does not exist"),
                          ((str(run["hf"]), "--prompt", PROMPT, "--max-new-tokens", "0"), "max_new_tokens must be")]:
        result = cli("generate", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], result.stderr

"""Fine-tuning a Hugging Face model in one step, as README.md's "Fine-tuning a Hugging Face model"
does it: a run's newest checkpoint exported through `runs/latest`, configs/finetune.yaml as it
is (model.path's weights, family and tokenizer), then `generate` from the fine-tune's
`runs/finetune/latest`; at a small size (the tiny Qwen3 pretrained 2 steps, fine-tuned 2)."""

from __future__ import annotations

import json

from tests.train.test_cli_train import ROOT, tiny_config


def test_export_then_finetune_from_the_directory_then_generate(cli, tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "data").symlink_to(ROOT / "configs" / "data")  # finetune.yaml's data, as in the repo
    pretrain = tiny_config(tmp_path, "runs/{time}", steps=2)
    assert cli("train", str(pretrain)).returncode == 0
    assert (tmp_path / "runs" / "latest").is_symlink()

    exported = cli("export", "runs/latest", "hf-model")
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.startswith("exported runs/latest/checkpoints/step_00000002 to hf-model: ")

    tuned = cli("train", str(ROOT / "configs" / "finetune.yaml"), "--set", "training.steps=2")
    assert tuned.returncode == 0, tuned.stderr
    assert "weights from model.path hf-model" in tuned.stdout
    assert "done: 2 steps from model.path hf-model, loss " in tuned.stdout
    run = (tmp_path / "runs" / "finetune" / "latest").resolve()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights_from"] for r in records if "weights_from" in r] == ["model.path hf-model"]
    # the run tokenized with the directory's own tokenizer (no builtin one trained for it)
    assert (run / "tokenizer.json").read_bytes() == (tmp_path / "hf-model" / "tokenizer.json").read_bytes()

    prompt = "<|im_start|>user\nstone tunnel needle<|im_end|>\n<|im_start|>assistant\n"
    generated = cli("generate", "runs/finetune/latest", "--prompt", prompt, "--max-new-tokens", "4")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith(prompt) and "4 new tokens in" in generated.stderr

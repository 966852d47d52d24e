"""Every trainer config shipped under configs/ trains as it is: 3 steps of it, on less text, uncompiled,
with nothing on stderr (no library's warning or progress bar: they go to RUN_DIR/libraries.log)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyperparallel.models import build_model, get_family
from hyperparallel.models.families import load_balance_rule
from hyperparallel.moe.balance import balanced_layers
from hyperparallel.train.config import load_config
from hyperparallel.train.loop import train

ROOT = Path(__file__).resolve().parent.parent.parent
# (configs/finetune.yaml fine-tunes a model directory, `hf-model`: tests/train/test_finetune.py
# trains it as it is, from an export)
EXAMPLES = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "finetune.yaml")


def test_there_is_an_example_per_family():
    from hyperparallel.models import family_names

    assert {load_config(path).model.family for path in EXAMPLES} >= set(family_names())


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_trains_three_steps(tmp_path, monkeypatch, capfd, path):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))
    # only the length, the amount of text (the tokenizer is trained on it) and where it writes; and
    # no compilation: Inductor's first compile of a layer costs half a minute on a fresh machine, and
    # Inductor on the same family's layers, equal to eager, is tests/train/test_loop.py's
    cfg = load_config(path, ["training.steps=3", "data.max_corpus_bytes=200000", "training.eval_batches=1",
                             f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false", "training.compile=none"])
    capfd.readouterr()
    summary = train(cfg)
    out, err = capfd.readouterr()
    assert err == "", err  # (a run's own errors would be there; a library's bars and warnings are not)
    assert "layout: 1 rank\n" in out and "(the model has no" not in out
    assert summary["last_loss"] < summary["first_loss"]
    assert [r["step"] for r in summary["records"] if "val_loss" in r] == [3]
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
    logged = [r for r in summary["records"] if "loss" in r]
    with torch.device("meta"):
        meta = build_model(cfg.model.family, config=dict(cfg.model.config), materialize=False)
    if balanced_layers(meta):  # MoE models: the loads measured, the model's balancing rule on
        assert all(1.0 <= r["moe_imbalance"] for r in logged)
        rule = cfg.moe.load_balance or load_balance_rule(get_family(cfg.model.family), meta)
        assert all(("aux_loss" in r) == (rule == "aux_loss") for r in logged)
    else:
        assert not any("moe_imbalance" in r or "aux_loss" in r for r in logged)

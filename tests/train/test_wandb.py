"""logging.wandb: a run logs to Weights & Biases what metrics.jsonl records, with its resolved
config, and a resumed run continues its W&B run; in W&B's offline mode, read back from W&B's own
files (tests/wandb_files.py). Without the wandb package, a config asking for it is refused in one
line before any work."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from hyperparallel.errors import ConfigError
from hyperparallel.train import preflight, wandb_log
from hyperparallel.train.loop import train
from tests.train.test_loop import config
from tests.wandb_files import offline_runs

WANDB = {"project": "hp-test", "name": "tiny", "tags": ["ci", "offline"], "mode": "offline"}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B with nothing of the user's read or written, and its service stopped after the test."""
    wandb = pytest.importorskip("wandb", reason="the test extra installs wandb (make test)")
    for key, value in {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                       "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_MACHINE_INFO": "true"}.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / key))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    yield
    wandb.teardown()


def test_an_offline_run_holds_the_metrics_and_config_and_its_resume_continues_it(tmp_path, offline_wandb):
    sections = dict(training={"steps": 4}, checkpoint={"every": 2}, logging={"wandb": WANDB})
    configs = [config(tmp_path, "qwen3", **sections),
               config(tmp_path, "qwen3", **{**sections, "checkpoint": {"every": 2, "resume": "latest"}})]
    train(configs[0], stop_after=2)
    train(configs[1])
    run_dir = tmp_path / "run"
    first, resumed = offline_runs(run_dir)
    # one W&B run: the id kept in the run directory, the second start resuming it
    run_id = (run_dir / wandb_log.ID_FILE).read_text().strip()
    assert (first["id"], first["resumed"]) == (run_id, False) and (resumed["id"], resumed["resumed"]) == (run_id, True)
    assert {k: first[k] for k in ("name", "project", "tags")} == {"name": "tiny", "project": "hp-test",
                                                                   "tags": ["ci", "offline"]}
    # each start's resolved config (the resumed one's, as the run directory's config.yaml holds it)
    assert [first["config"], resumed["config"]] == [c.model_dump(mode="json", by_alias=True) for c in configs]
    assert resumed["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())
    # every step's figures, as metrics.jsonl has them: steps 1-2 in the first, 3-4 in the resumed run
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in jsonl if "loss" in r}
    logged = [row for run in (first, resumed) for row in run["history"] if "loss" in row]
    assert [row["_step"] for row in logged] == [1, 2, 3, 4] == sorted(steps)
    for row in logged:
        for key in ("loss", "lr", "tokens_per_s", "grad_norm", "step_time_s", "peak_mem_bytes"):
            assert row[key] == pytest.approx(steps[row["_step"]][key], rel=1e-12), key
    # each start's build record too (its step: where it started)
    assert [row["_step"] for run in (first, resumed) for row in run["history"] if "build_s" in row] == [0, 2]


def test_a_config_asking_for_wandb_without_the_package_is_refused_before_any_work(tmp_path, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    cfg = config(tmp_path, "qwen3", logging={"wandb": {"project": "p"}})
    with pytest.raises(ConfigError, match=r"^logging.wandb.project is set but the wandb package is not installed"):
        preflight.check(cfg, 1, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # offline or disabled, or no project: nothing to refuse
    assert wandb_log.problems(config(tmp_path, "qwen3", logging={"wandb": {"project": "p", "mode": "disabled"}})
                              .logging.wandb) == []


def test_an_online_run_without_a_wandb_login_is_named_in_one_line(tmp_path, offline_wandb, monkeypatch):
    from hyperparallel.train.config import WandbSection

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"^logging.wandb: W&B did not start the run \(No API key .*\); "
                                          r"`wandb login`, or logging.wandb.mode=offline$"):
        wandb_log.WandbRun(WandbSection(project="p"), tmp_path, {})

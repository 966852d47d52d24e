"""The training loop end to end: each family trains, resume reproduces, run dirs are complete."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from hyperparallel.errors import CheckpointError, ConfigError
from hyperparallel.train.config import from_mapping
from hyperparallel.train.loop import train

ROOT = Path(__file__).resolve().parent.parent.parent
FRAGMENTS = {"qwen3": "qwen3_tiny", "qwen3_moe": "qwen3_moe_tiny", "kimi_k2": "kimi_k2_tiny",
             "deepseek_v4": "deepseek_v4_tiny"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))


def config(tmp_path, family="qwen3_moe", **sections):
    inline = yaml.safe_load((ROOT / "configs" / "models" / f"{FRAGMENTS[family]}.yaml").read_text())
    raw = {
        "model": {"family": family, "config": inline},
        "data": {"max_corpus_bytes": 60_000, "vocab_size": 512, "seq_len": 32, "validation": None},
        "training": {"steps": 6, "global_batch": 4, "micro_batch": 2, "seed": 1, "compile": "none"},
        "scheduler": {"warmup_steps": 2},
        "optimizer": {"lr": 1e-3},
        "logging": {"run_dir": str(tmp_path / "run"), "every": 1, "progress": False},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return from_mapping(raw)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "kimi_k2"])
def test_each_family_trains_and_fills_its_run_dir(tmp_path, family):
    summary = train(config(tmp_path, family, training={"steps": 8}, optimizer={"lr": 3e-3}))
    run = tmp_path / "run"
    everything = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    built, records = everything[0], everything[1:]
    assert built["step"] == 0 and built["weights_from"] == "init" and built["build_peak_mem_bytes"] > 0
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_bytes", "mfu"):
        assert all(key in r for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert summary["last_loss"] < summary["first_loss"]
    assert (run / "config.yaml").is_file() and (run / "loss.png").is_file() and (run / "tokenizer.json").is_file()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000008"]


def test_muon_trains(tmp_path):
    summary = train(config(tmp_path, "qwen3", optimizer={"name": "muon", "lr": 3e-3, "muon_lr": 0.02},
                           training={"steps": 8}))
    assert summary["last_loss"] < summary["first_loss"]


def losses(summary) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in summary["records"] if "loss" in r}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_an_interrupted_run_resumes_to_the_same_losses(tmp_path, optimizer):
    whole = train(config(tmp_path / "a", optimizer={"name": optimizer}, checkpoint={"every": 3}))
    first = train(config(tmp_path / "b", optimizer={"name": optimizer}, checkpoint={"every": 3}), stop_after=3)
    resumed = train(config(tmp_path / "b", optimizer={"name": optimizer}, checkpoint={"every": 3,
                                                                                      "resume": "latest"}))
    assert resumed["first_step"] == 3 and losses(first) == {k: v for k, v in losses(whole).items() if k <= 3}
    assert losses(resumed) == losses(whole)  # exactly: fp32, same data order, same RNG and optimizer state
    records = [json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    # each start's build record, then the steps (the first run's past its checkpoint dropped)
    assert [(r["step"], r.get("weights_from")) for r in records if "build_s" in r] == [(0, "init"), (3, "checkpoint")]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))


def test_a_stop_request_ends_the_run_after_its_step_with_a_checkpoint_that_resumes_exactly(tmp_path):
    """SIGINT (or SIGTERM) during step 4: the step finishes, a checkpoint is saved, train returns."""
    whole = train(config(tmp_path / "a", "qwen3"))

    def interrupt(step, record):
        if step == 3:  # after step 3's checkpoint decision: the signal lands in step 4
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN where pytest runs as a background job)
    first = train(config(tmp_path / "b", "qwen3"), on_step=interrupt)
    assert first["stopped_by"] == "SIGINT"
    assert [p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir()] == ["step_00000004"]
    assert losses(first) == {k: v for k, v in losses(whole).items() if k <= 4}
    assert signal.getsignal(signal.SIGINT) is before  # handlers are put back
    resumed = train(config(tmp_path / "b", "qwen3", checkpoint={"resume": "latest"}))
    assert resumed["first_step"] == 4 and losses(resumed) == losses(whole)


def test_background_checkpoints_resume_as_synchronous_ones(tmp_path):
    whole = train(config(tmp_path / "a", checkpoint={"every": 3}))
    background = {"every": 3, "async": True}
    train(config(tmp_path / "b", checkpoint=background), stop_after=3)
    assert [p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir()] == ["step_00000003"]
    resumed = train(config(tmp_path / "b", checkpoint={**background, "resume": "latest"}))
    assert resumed["first_step"] == 3 and losses(resumed) == losses(whole)
    assert sorted(p.name for p in (tmp_path / "b" / "run" / "checkpoints").iterdir()) == ["step_00000003",
                                                                                        "step_00000006"]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    train(config(tmp_path, "qwen3", checkpoint={"every": 1, "keep_last": 2}))
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_00000005", "step_00000006"]


def test_recompute_trains_to_the_same_losses(tmp_path):
    plain = train(config(tmp_path / "a", "qwen3"))
    for mode in ("full", "selective"):
        again = train(config(tmp_path / mode, "qwen3", parallel={"recompute": mode}))
        for step, loss in losses(plain).items():
            assert losses(again)[step] == pytest.approx(loss, rel=1e-5), (mode, step)


def test_how_the_numbers_are_computed_does_not_change_them(tmp_path):
    """Inductor or DVM per decoder layer, and HF's loss instead of the fused one: the same run."""
    plain = train(config(tmp_path / "plain"))
    for name, training in (("inductor", {"compile": "inductor"}), ("dvm", {"compile": "dvm"}),
                           ("hf_loss", {"fused_loss": False})):
        again = train(config(tmp_path / name, training=training))
        for step, loss in losses(plain).items():
            assert losses(again)[step] == pytest.approx(loss, rel=1e-5), (name, step)  # measured <= 1.2e-7


def test_bf16_mixed_precision_follows_fp32(tmp_path):
    plain = train(config(tmp_path / "fp32", training={"steps": 8}, optimizer={"lr": 3e-3}))
    mixed = train(config(tmp_path / "bf16", training={"steps": 8, "mixed_precision": "bf16"}, optimizer={"lr": 3e-3}))
    assert mixed["last_loss"] < mixed["first_loss"]
    for step, loss in losses(plain).items():
        assert losses(mixed)[step] == pytest.approx(loss, rel=3e-3), step  # measured <= 1.7e-4
    assert losses(mixed) != losses(plain)  # bf16 really ran


def test_an_existing_run_is_never_written_into(tmp_path):
    train(config(tmp_path, "qwen3", training={"steps": 2}, scheduler={"warmup_steps": 0}))
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    with pytest.raises(ConfigError, match="already holds a run"):
        train(config(tmp_path, "qwen3", training={"steps": 2}, scheduler={"warmup_steps": 0}))
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before


def test_resume_checks_the_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is not a complete checkpoint"):
        train(config(tmp_path, "qwen3", checkpoint={"resume": str(tmp_path / "nowhere")}))
    train(config(tmp_path, "qwen3", training={"steps": 2}, scheduler={"warmup_steps": 0}))
    with pytest.raises(CheckpointError, match=r"different model, data or optimizer config; it differs in "
                                              r"optimizer.lr: 0.001 -> 0.5; resume it with the config it was made"):
        train(config(tmp_path, "qwen3", training={"steps": 4}, scheduler={"warmup_steps": 0},
                     optimizer={"lr": 0.5}, checkpoint={"resume": "latest"}))


def test_resume_latest_with_a_time_template_continues_the_newest_run_of_this_config(tmp_path):
    """The default run_dir is runs/{time}: `resume: latest` finds the run instead of starting one."""
    timed = {"run_dir": str(tmp_path / "runs" / "{time}"), "every": 1, "progress": False}
    whole = train(config(tmp_path / "whole", "qwen3"))
    first = train(config(tmp_path, "qwen3", logging=timed), stop_after=3)
    ran = Path(first["run_dir"])
    # a newer run of another config beside it (as if it had been started later with another lr)
    other = tmp_path / "runs" / "29991231-235959"
    other.mkdir()
    (other / "config.yaml").write_text((ran / "config.yaml").read_text().replace("lr: 0.001", "lr: 0.5"))
    resumed = train(config(tmp_path, "qwen3", logging=timed, checkpoint={"resume": "latest"}))
    assert resumed["run_dir"] == str(ran) and resumed["first_step"] == 3
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([ran.name, other.name, "latest"])  # no new one
    assert (tmp_path / "runs" / "latest").resolve() == ran.resolve()  # (the run started last: the resumed one)
    assert losses(resumed) == losses(whole)


def test_a_resume_with_nothing_left_to_train_is_refused(tmp_path):
    train(config(tmp_path, "qwen3", training={"steps": 2}))
    with pytest.raises(ConfigError, match=r"step_00000002 is at step 2 and training.steps is 2: nothing is left to "
                                          r"train; raise training.steps"):
        train(config(tmp_path, "qwen3", training={"steps": 2}, checkpoint={"resume": "latest"}))


def test_resume_latest_with_one_checkpoint_dir_for_every_run_continues_the_run_it_records(tmp_path):
    timed = {"run_dir": str(tmp_path / "runs" / "{time}"), "every": 1, "progress": False}
    shared = {"dir": str(tmp_path / "checkpoints")}
    first = train(config(tmp_path, "qwen3", logging=timed, checkpoint=shared), stop_after=3)
    resumed = train(config(tmp_path, "qwen3", logging=timed, checkpoint={**shared, "resume": "latest"}))
    assert resumed["run_dir"] == first["run_dir"] and resumed["first_step"] == 3
    with pytest.raises(ConfigError, match=r"no complete checkpoint in checkpoint.dir .* was written by a run of this "
                                          r"config"):
        train(config(tmp_path, "qwen3", logging=timed, training={"seed": 7}, checkpoint={**shared, "resume": "latest"}))


def test_evaluating_changes_nothing_of_the_training(tmp_path):
    held_out = {"validation": 0.1}
    at_the_end = train(config(tmp_path / "a", "qwen3", data=held_out))
    every_step = train(config(tmp_path / "b", "qwen3", data=held_out, training={"eval_every": 1}))
    assert losses(every_step) == losses(at_the_end)  # exactly
    assert len([r for r in every_step["records"] if "val_loss" in r]) == 6


def test_resume_latest_with_nothing_to_continue_names_where_it_looked(tmp_path):
    timed = {"run_dir": str(tmp_path / "runs" / "{time}"), "every": 1, "progress": False}
    with pytest.raises(ConfigError, match=r"checkpoint.resume: latest: there is no run to continue in .*runs/\*"):
        train(config(tmp_path, "qwen3", logging=timed, checkpoint={"resume": "latest"}))
    train(config(tmp_path, "qwen3", logging=timed, training={"steps": 2}))
    with pytest.raises(ConfigError, match=r"none of the 1 run\(s\) in .*runs/\* can be continued with this config: "
                                          r".*another config \(training.seed: 1 -> 5\)"):
        train(config(tmp_path, "qwen3", logging=timed, training={"seed": 5}, checkpoint={"resume": "latest"}))


def test_a_longer_run_on_resume_follows_the_schedule_rebuilt_for_it(tmp_path, capsys):
    from hyperparallel.optim.schedules import lr_factor

    train(config(tmp_path, "qwen3"), stop_after=3)
    resumed = train(config(tmp_path, "qwen3", training={"steps": 10}, checkpoint={"resume": "latest"}))
    assert "training.steps 6 -> 10: the cosine schedule is rebuilt for 10 steps (warmup 2); the lr at step 4 is" \
        in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in resumed["records"] if "lr" in r}
    for step in range(4, 11):  # (logged step N ran with the lr of schedule step N - 1)
        assert lrs[step] == pytest.approx(1e-3 * lr_factor("cosine", step - 1, 2, 10, 0.1), rel=1e-12)


def test_logged_metrics_are_means_over_the_steps_since_the_last_log(tmp_path):
    every_step = train(config(tmp_path / "a", "qwen3"))
    windows = train(config(tmp_path / "b", "qwen3", logging={"every": 4}))
    per_step = {r["step"]: r for r in every_step["records"] if "loss" in r}
    logged = [r for r in windows["records"] if "loss" in r]
    assert [(r["step"], r["window"]) for r in logged] == [(1, 1), (4, 3), (6, 2)]
    for record in logged:
        steps = range(record["step"] - record["window"] + 1, record["step"] + 1)
        assert record["loss"] == pytest.approx(sum(per_step[s]["loss"] for s in steps) / len(steps), rel=1e-12)
        assert record["grad_norm"] == pytest.approx(sum(per_step[s]["grad_norm"] for s in steps) / len(steps),
                                                    rel=1e-12)
        assert record["lrs"] == [per_step[s]["lr"] for s in steps]
        # the window's tokens over its time: the tokens of a step over the mean step time
        assert record["tokens_per_s"] == pytest.approx(4 * 32 / record["step_time_s"], rel=1e-12)


def test_validation_loss_is_logged_at_its_steps_and_plotted(tmp_path):
    summary = train(config(tmp_path, "qwen3", data={"validation": 0.1}, training={"eval_every": 4, "eval_batches": 2}))
    evaluations = [r for r in summary["records"] if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [4, 6]
    assert evaluations[-1]["val_tokens"] == 2 * 4 * 31  # 2 global batches of 4 packed sequences, 31 targets each
    for r in evaluations:
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
    assert evaluations[-1]["val_loss"] < evaluations[0]["val_loss"] < 7  # it learns (ln 512 = 6.24 at the start)
    again = train(config(tmp_path / "again", "qwen3", data={"validation": 0.1},
                         training={"eval_every": 4, "eval_batches": 2}))
    assert [r for r in again["records"] if "val_loss" in r] == evaluations  # deterministic
    assert (tmp_path / "run" / "loss.png").is_file()


def test_an_impossible_batch_split_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"global_batch \(5\) must be a multiple"):
        train(config(tmp_path, "qwen3", training={"global_batch": 5}))
    assert not (tmp_path / "run").exists()


def test_tensorboard_events_are_written_when_asked(tmp_path):
    train(config(tmp_path, "qwen3", training={"steps": 2}, scheduler={"warmup_steps": 0},
                 logging={"tensorboard": True}))
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(events[0])).Reload().Tags()["scalars"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(scalars)


def test_mxfp8_training_ends_within_3_percent_of_bf16(tmp_path):
    common = dict(training={"steps": 50}, scheduler={"warmup_steps": 5}, optimizer={"lr": 3e-3})
    bf16 = train(config(tmp_path / "bf16", "qwen3_moe", **common, model={"dtype": "bfloat16"}))
    mx = train(config(tmp_path / "mx", "qwen3_moe", **common, model={"dtype": "bfloat16"},
                      low_precision={"enabled": True}))
    assert mx["last_loss"] < mx["first_loss"] - 0.5  # it learns

    def end(summary):  # the mean of the last 10 steps: one step's loss is one batch's, and noisy
        return sum(r["loss"] for r in summary["records"][-10:]) / 10

    assert abs(end(mx) - end(bf16)) <= 0.03 * end(bf16), (end(mx), end(bf16))


def test_mxfp8_layers_compile_with_each_backend(tmp_path):
    """MXFP8 modules inside compiled layers: dvm traces them; Inductor (no float8_e8m0fnu on the
    CPU) leaves them between its graphs. Both train to the losses of no compilation.

    The MoE auxiliary loss is off here: its gradient reaches the routers through probabilities
    that a compiled graph rounds otherwise, and one token's top-k near-tie then flips to another
    expert (measured: 3e-5 of one step's loss with Inductor, 1e-7 on the others), which is the
    routing's discreteness, not the compilation of the MXFP8 modules this test is about."""
    low, moe = {"enabled": True}, {"load_balance": "none"}
    plain = train(config(tmp_path / "none", training={"steps": 4}, low_precision=low, moe=moe))
    for backend in ("inductor", "dvm"):
        again = train(config(tmp_path / backend, training={"steps": 4, "compile": backend}, low_precision=low,
                             moe=moe))
        for step, loss in losses(plain).items():
            assert losses(again)[step] == pytest.approx(loss, rel=1e-5), (backend, step)  # measured <= 8e-8

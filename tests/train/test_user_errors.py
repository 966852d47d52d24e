"""Every mistake a user can make in a run's inputs: one `error:` line naming the fault, exit
status 2, no traceback, and nothing written (no run directory, no cache, no checkpoint), from
one process and from the ranks of `--nproc 2` alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.train.test_cli_train import ROOT, run, tiny_config


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def fails_cleanly(tmp_path: Path, *args: str, message: str, lines: int = 1) -> list[str]:
    before = files_under(tmp_path)
    result = run("train", *args, tmp_path=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(errors) == lines, result.stderr[-2000:]
    assert re.search(message, "\n".join(errors)), errors
    assert files_under(tmp_path) == before, sorted(map(str, files_under(tmp_path) - before))  # nothing written
    return errors


@pytest.fixture
def config(tmp_path) -> Path:
    return tiny_config(tmp_path, tmp_path / "run")


def test_a_config_that_is_not_utf8_text(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"model:\n  family: qwen3\n\xff\xfe")
    fails_cleanly(tmp_path, str(path), message=r"error: .*binary.yaml is not UTF-8 text \(byte 24\)")


def test_a_config_path_that_is_a_directory(tmp_path):
    (tmp_path / "configs").mkdir()
    fails_cleanly(tmp_path, str(tmp_path / "configs"), message=r"error: config .*configs is a directory; give a YAML file")


def test_a_malformed_parquet_file(tmp_path, config):
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1 this is not parquet")
    fails_cleanly(tmp_path, str(config), "--set", "data.source=files", "--set", f"data.files={tmp_path}/corpus.parquet",
                  message=r"error: data.files: .*corpus.parquet is not a readable parquet file")


def test_a_malformed_tokenizer_file(tmp_path, config):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    fails_cleanly(tmp_path, str(config), "--set", f"data.tokenizer={tmp_path}/tokenizer.json",
                  message=r"error: data.tokenizer: .*tokenizer.json is not a tokenizers JSON file")


def test_a_run_dir_that_is_an_existing_file(tmp_path, config):
    (tmp_path / "taken").write_text("a file")
    fails_cleanly(tmp_path, str(config), "--set", f"logging.run_dir={tmp_path}/taken",
                  message=r"error: logging.run_dir: .*taken is an existing file, not a directory")


def test_run_and_checkpoint_dirs_that_cannot_be_written(tmp_path, config):
    # /sys refuses new files even to root (who may write anywhere else)
    fails_cleanly(tmp_path, str(config), "--set", "logging.run_dir=/sys/hyperparallel-run",
                  message=r"error: logging.run_dir: /sys/hyperparallel-run cannot be created: /sys is not writable")
    fails_cleanly(tmp_path, str(config), "--set", "checkpoint.dir=/sys/hyperparallel-checkpoints",
                  message=r"error: checkpoint.dir: /sys/hyperparallel-checkpoints cannot be created")


def test_a_model_config_mistake_is_found_before_the_tokenizer_is_trained(tmp_path, config):
    fails_cleanly(tmp_path, str(config), "--set", "model.config.hidden_sise=64", "--set", "model.config.num_layerz=1",
                  lines=2, message=r"(?s)error: model.config: unknown key 'hidden_sise' .*did you mean 'hidden_size'.*"
                                   r"error: model.config: unknown key 'num_layerz'")
    assert not (tmp_path / "cache").exists()  # no tokenizer, no token cache


def test_a_model_vocabulary_smaller_than_the_builtin_tokenizer(tmp_path):
    fails_cleanly(tmp_path, str(ROOT / "configs" / "qwen3.yaml"), "--set", "data.vocab_size=4096",
                  message=r"error: model.config.vocab_size \(512\) is smaller than the builtin tokenizer's "
                          r"data.vocab_size \(4096\); set data.vocab_size: 512")


def test_three_mistakes_are_named_together(tmp_path, config):
    fails_cleanly(tmp_path, str(config), "--set", "training.stepz=3", "--set", "optimizer.lr=fast",
                  "--set", "data.seq_len=2", lines=3,
                  message=r"(?s)data.seq_len: .*greater than or equal to 8.*training.stepz: unknown key; did you mean "
                          r"training.steps\?.*optimizer.lr: .*got 'fast'")


@pytest.mark.parametrize("case", ["malformed parquet", "unwritable checkpoint.dir", "three mistakes"])
def test_under_two_ranks_a_mistake_is_reported_once(tmp_path, config, case):
    """Found by the launcher before any rank starts (a directory, the config) or inside the ranks
    (the data, read in full there): one line either way."""
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1 this is not parquet")
    args, message, lines = {
        "malformed parquet": (["--set", "data.source=files", "--set", f"data.files={tmp_path}/corpus.parquet"],
                              r"corpus.parquet is not a readable parquet file", 1),
        "unwritable checkpoint.dir": (["--set", "checkpoint.dir=/sys/hyperparallel-checkpoints"],
                                      r"checkpoint.dir: /sys/hyperparallel-checkpoints cannot be created", 1),
        "three mistakes": (["--set", "training.stepz=3", "--set", "optimizer.lr=fast", "--set", "data.seq_len=2"],
                           r"(?s)data.seq_len.*training.stepz.*optimizer.lr", 3),
    }[case]
    fails_cleanly(tmp_path, str(config), *args, "--nproc", "2", message=message, lines=lines)

"""The command line: help works both ways, and user errors exit 2 without a traceback."""

from __future__ import annotations

import subprocess
import sys

from hyperparallel.cli import main


def test_help_via_module():
    result = subprocess.run([sys.executable, "-m", "hyperparallel", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "bench" in result.stdout


def test_main_prints_help_without_command(capsys):
    assert main([]) == 0
    assert "usage: hyperparallel" in capsys.readouterr().out


def test_bench_runs_and_prints_ratios(capsys):
    assert main(["bench", "mx", "--m", "64", "--k", "64", "--n", "32", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "quantize_dual vs quantize" in out and "ratio" in out

"""What a page must hold for tests/docs to run it: commands in labelled blocks, markers that name
something, bare commands only where the page says to activate the environment; and the benchmark
lists of the Makefile and README.md equal to `hyperparallel bench`'s."""

from __future__ import annotations

import re

import pytest

from hyperparallel.cli import BENCHMARKS
from tests.docs import sizes
from tests.docs.blocks import ROOT, all_blocks, pages, stray_markers

BLOCKS = all_blocks()
PAGES = [str(p.relative_to(ROOT)) for p in pages()]
COMMAND_WORDS = {"hyperparallel", ".venv/bin/hyperparallel", "python", "python3", ".venv/bin/python", "make", "bash",
                 "torchrun", "pip", "source"}
ACTIVATE = "source .venv/bin/activate"


def _program(text: str) -> str:
    words = [w for w in text.split() if not re.fullmatch(r"[A-Za-z_]\w*=\S*", w)]  # (past NAME=value)
    return words[0] if words else ""


@pytest.mark.parametrize("page", PAGES)
def test_commands_are_in_labelled_blocks(page):
    unlabelled = [f"{b.id}: {line.strip()}" for b in BLOCKS if b.page == page and b.lang == "output"
                  for line in b.text.splitlines() if _program(line) in COMMAND_WORDS]
    assert not unlabelled, ("commands in a block of no language (label it bash, or write `$ ` before each "
                            "command):\n" + "\n".join(unlabelled))


@pytest.mark.parametrize("page", PAGES)
def test_markers_stand_above_a_block_and_name_its_commands(page):
    text = (ROOT / page).read_text()
    assert not stray_markers(text), f"{page}: lines {stray_markers(text)}: a `not run` marker must be " \
                                    f"`<!-- not run: REASON -->` or `<!-- not run \"TEXT\": REASON -->` right above a fence"
    for block in (b for b in BLOCKS if b.page == page):
        assert not block.markers or block.runnable, f"{block.id}: a marker on a block that is not run anyway"
        for text_, _ in block.markers:
            if text_ is not None:
                assert any(text_ in c.text for c in block.commands), f"{block.id}: no command contains {text_!r}"


@pytest.mark.parametrize("page", PAGES)
def test_bare_commands_come_with_the_environment(page):
    """`hyperparallel`, `python` and `torchrun` are the venv's only once it is active: a page that
    writes them bare says how (or writes `.venv/bin/...`)."""
    bare = [f"{b.page}:{c.line}: {c.text}" for b in BLOCKS if b.page == page and b.lang == "bash" and not b.not_run
            for c in b.commands if not c.not_run and _program(c.text) in ("hyperparallel", "python", "python3")]
    assert not bare or ACTIVATE in (ROOT / page).read_text(), (
        f"{page} runs these as if the environment were active, and never says `{ACTIVATE}`:\n" + "\n".join(bare))


def test_make_bench_runs_every_benchmark():
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert sorted(re.findall(r"hyperparallel bench (\w+)", recipe)) == sorted(BENCHMARKS)


def test_make_demo_says_how_to_activate_the_environment():
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "source $(VENV)/bin/activate" in recipe


def test_readme_lists_every_benchmark():
    listed = {name for b in BLOCKS if b.page == "README.md" for c in b.commands
              for name in re.findall(r"hyperparallel bench (\w+)", c.text)}
    assert listed == set(BENCHMARKS)


def test_the_size_tables_name_what_exists():
    python = [b for b in BLOCKS if b.lang == "python"]
    for (page, contains) in sizes.SNIPPET_SIZES:
        assert sum(b.page == page and contains in b.text for b in python) == 1, (page, contains)
    for config in sizes.PLAN_SIZES:
        assert (ROOT / config).is_file(), config
    for script in sizes.BENCH_SIZES:
        assert (ROOT / "benchmarks" / script).is_file(), script

"""tests/docs' own parts: the extractor, the markers, the shape comparison, and that a broken
documented command or snippet fails its block."""

from __future__ import annotations

import pytest

from tests.docs.blocks import ROOT, Block, Command, parse, stray_markers
from tests.docs.runner import BlockFailure, _expected_status, shape_problems

PAGE = """\
Text.

<!-- not run "--nnodes": several machines -->
```bash
hyperparallel train my.yaml \\
    --set training.steps=3   # a comment
# a comment line
torchrun --nnodes 2 -m hyperparallel train
```

<!-- not run: needs a GPU -->
```python
import torch
```

```
$ hyperparallel train --bad
error: one
$ echo $?
2
...
```

```
a table the page shows
```
"""


def test_blocks_commands_and_markers_are_read_as_written():
    shell, python, transcript, output = parse(PAGE, "docs/x.md")
    assert (shell.lang, shell.line, shell.not_run) == ("bash", 4, None)
    assert [(c.text, c.line, c.not_run) for c in shell.commands] == [
        ("hyperparallel train my.yaml --set training.steps=3   # a comment", 5, None),
        ("torchrun --nnodes 2 -m hyperparallel train", 8, "several machines")]
    assert (python.lang, python.not_run) == ("python", "needs a GPU")
    assert transcript.lang == "bash"
    assert [(c.text, c.shown) for c in transcript.commands] == [
        ("hyperparallel train --bad", ("error: one",)), ("echo $?", ("2", "..."))]
    assert _expected_status(list(transcript.commands), 0) == 2
    assert output.lang == "output" and not output.runnable


def test_a_marker_away_from_a_fence_is_found():
    assert stray_markers(PAGE) == []
    assert stray_markers("<!-- not run: x -->\n\n```bash\nls\n```\n") == [1]
    assert stray_markers("<!-- not run x -->\n```bash\nls\n```\n") == [1]


def test_shown_output_is_compared_by_its_first_words_and_its_tables():
    shown = ["step      1  loss 8.3913", "...", "| a | b |", "|---|---|", "| 1 | 2 |"]
    assert shape_problems(shown, "step 3 loss 1.0\n| a | b |\n| 5 | 6 |") == []
    assert shape_problems(shown, "done: 3 steps\n| a | c |") == [
        "no output line begins as the shown line 'step      1  loss 8.3913' does",
        "the table header '| a | b |' is not in the output"]
    assert shape_problems(["| a | b |", "| 1 | 2 | 3 |"], "| a | b |") == [
        "the row '| 1 | 2 | 3 |' has 3 columns, its header 2"]


def _one_command(text: str) -> Block:
    return Block("README.md", 1, "bash", text + "\n", commands=(Command(text, 2),))


def test_a_documented_command_broken_fails_its_block(doc_runner):
    """The README's --print-config line as written passes; with its option misspelt, it fails."""
    line = next(c.text for b in parse((ROOT / "README.md").read_text(), "README.md") for c in b.commands
                if "--print-config" in c.text)
    doc_runner.check_block(_one_command(line))
    with pytest.raises(BlockFailure, match="exit status 2, the page says 0"):
        doc_runner.check_block(_one_command(line.replace("--print-config", "--print-konfig")))


def test_a_broken_snippet_and_output_of_another_shape_fail(doc_runner):
    with pytest.raises(BlockFailure, match="AttributeError"):
        doc_runner.check_block(Block("README.md", 1, "python", "import hyperparallel.mx as mx\nmx.no_such_op()\n"))
    transcript = Block("README.md", 1, "bash", "", commands=(
        Command("hyperparallel train --print-config", 2, ("step 1 loss 8.39",)),))
    with pytest.raises(BlockFailure, match="no output line begins as the shown line 'step 1 loss 8.39' does"):
        doc_runner.check_block(transcript)

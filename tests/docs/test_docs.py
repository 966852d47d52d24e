"""Every runnable block of README.md and docs/*.md runs as its page says.

tests/docs/blocks.py says what a block is and how a page marks one not run (with its reason);
tests/docs/runner.py how each kind runs and what is compared with the output a page shows;
tests/docs/sizes.py the small sizes each command runs at. One test per block, in page order, each
page followed in a working directory of its own.
"""

from __future__ import annotations

import pytest

from tests.docs.blocks import all_blocks

RUNNABLE = [block for block in all_blocks() if block.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.id)
def test_block_runs_as_its_page_says(block, doc_runner):
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    if block.commands and all(command.not_run for command in block.commands):
        pytest.skip("not run: " + "; ".join(sorted({command.not_run for command in block.commands})))
    doc_runner.check_block(block)

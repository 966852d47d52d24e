"""Every Markdown table of README.md and docs/*.md renders whole on GitHub: each row has as many
cells as its header.

The tables are found as GitHub finds them, by rendering the page with markdown-it (the GFM table
rule; so a `|` line inside a code fence is no table). Their rows are then split as GFM splits them:
on every `|` not escaped as `\\|`, code spans included. A row with more cells than its header loses
the extra ones on GitHub (an unescaped `|` in `cp_mode: ring | ulysses` once cut two README rows
short); one with fewer renders its last columns empty.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from tests.docs.blocks import ROOT, pages

_PARSER = MarkdownIt("commonmark").enable("table")


def cells(row: str) -> list[str]:
    """A table row's cells as GFM splits them: on unescaped pipes, the outer ones optional."""
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if re.search(r"(?<!\\)\|$", row) else row
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)]


def uneven_rows(text: str) -> list[tuple[int, int, int]]:
    """(line, its cells, the header's cells) of every table row whose cell count differs from its
    header's; lines 1-based."""
    lines = text.splitlines()
    found = []
    for token in _PARSER.parse(text):
        if token.type != "table_open":
            continue
        first, end = token.map
        header = len(cells(lines[first]))
        found += [(n + 1, len(cells(lines[n])), header) for n in range(first + 2, end)
                  if len(cells(lines[n])) != header]
    return found


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in pages()])
def test_every_table_row_has_its_headers_cell_count(page):
    uneven = uneven_rows((ROOT / page).read_text())
    assert not uneven, "\n".join(f"{page}:{line}: {count} cells under a header of {header} (an unescaped "
                                 f"`|` inside a cell? write `\\|`)" for line, count, header in uneven)


def test_a_pipe_inside_a_code_span_splits_the_row():
    page = ("| key | meaning |\n| --- | --- |\n| `cp_mode: ring | ulysses` | how |\n"
            "| `cp_mode: ring \\| ulysses` | how |\n")
    assert uneven_rows(page) == [(3, 3, 2)]


def test_a_table_inside_a_code_fence_is_no_table():
    assert uneven_rows("```\n| a | b |\n| --- | --- |\n| 1 | 2 | 3 |\n```\n") == []


def test_a_row_short_of_cells_is_found_too():
    assert uneven_rows("a | b | c\n--- | --- | ---\n1 | 2\n") == [(3, 2, 3)]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file, or whose #anchor in that file, does not exist."""
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", _without_fences(page.read_text()))  # (code is no link)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+:", target):  # (https:, mailto:)
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+\s+(.+?)\s*$", _without_fences(linked.read_text()), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(target)
    return broken


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in pages()])
def test_every_relative_link_finds_its_file_and_heading(page):
    assert not broken_links(ROOT / page), f"{page}: links to nothing: {broken_links(ROOT / page)}"


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## MX operators (bench mx)\n\n[ok](#mx-operators-bench-mx) "
                                   "[bad](#mx-operators) [gone](b.md)\n")
    assert broken_links(tmp_path / "a.md") == ["#mx-operators", "b.md"]

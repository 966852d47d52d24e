"""The runnable blocks of README.md and docs/*.md, as the pages hold them.

What is a block (a fenced code block, its fence's language deciding):

- `bash` / `sh` / `shell` / `console`: shell commands, one per line (a line ending in `\\`
  continues on the next; blank and comment lines are not commands). A block whose lines start
  with `$ ` (of any language, or none) is a console transcript: each `$ ` line is a command and
  the lines after it, up to the next `$ `, are the output the page shows for it (`...` stands for
  lines left out; `$ echo $?` followed by a number is the exit status shown).
- `python`: a snippet, run as a whole.
- `yaml`: a fragment of a trainer config, validated by the trainer's own loader.
- anything else (no language, `text`): output the page shows, not run. A block of no language
  whose lines read as commands (they start with `hyperparallel`, `python`, `make`, ...) is refused
  by tests/docs/test_docs.py: label it `bash`, or write it as a `$ ` transcript.

The marker for what is not run, on the page itself, in the line(s) right above the fence:

    <!-- not run: REASON -->                 the whole block is not run, for REASON
    <!-- not run "TEXT": REASON -->          its commands containing TEXT are not run, for REASON

(HTML comments: in the page's source beside the block, not in its rendering.) Several markers may
stand above one fence. A marker that is not directly above a fence, or whose TEXT matches no
command of its block, fails the tests, as does a marker on a block with nothing to run. `python -m
tests.docs.blocks` lists every block or command not run, page by page, with its reason.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_MARKER = re.compile(r'^\s*<!--\s*not run(?:\s+"(?P<text>[^"]+)")?\s*:\s*(?P<reason>.+?)\s*-->\s*$')
_LOOSE_MARKER = re.compile(r"<!--\s*not run\b")


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Command:
    text: str  # as on the page (continuation lines joined), without the `$ ` of a transcript
    line: int  # its first line on the page (1-based)
    shown: tuple[str, ...] = ()  # the output the page shows after it (transcripts)
    not_run: str | None = None  # the reason, when a marker names this command


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/train.md
    line: int  # the opening fence's line
    lang: str  # bash (every shell kind and transcript), python, yaml or output
    text: str
    not_run: str | None = None  # a marker's reason for the whole block
    commands: tuple[Command, ...] = ()
    markers: tuple[tuple[str | None, str], ...] = ()  # (TEXT or None, REASON) as written

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in ("bash", "python", "yaml")


def _commands(lines: list[str], first: int) -> list[Command]:
    """Shell lines, or a transcript's `$ ` lines with the output shown after each."""
    transcript = any(line.startswith("$ ") for line in lines)
    out: list[Command] = []
    pending, start, shown = "", 0, []

    def close():
        nonlocal pending, shown
        if pending:
            out.append(Command(pending, start, tuple(shown)))
        pending, shown = "", []

    for i, line in enumerate(lines):
        number = first + i
        if transcript:
            if line.startswith("$ ") and not pending.endswith("\\"):
                close()
                pending, start = line[2:].rstrip(), number
            elif pending.endswith("\\") and not shown:
                pending = pending[:-1].rstrip() + " " + line.strip()
            elif pending:
                shown.append(line)
            continue
        stripped = line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " " + stripped
            continue
        close()
        if stripped and not stripped.startswith("#"):
            pending, start = stripped, number
    close()
    return out


def parse(text: str, page: str) -> list[Block]:
    """Every fenced block of a page, with its markers applied."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.group(1), fence.group(2), fence.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j]]
        markers = []
        k = i - 1
        while k >= 0 and (m := _MARKER.match(lines[k])):
            markers.insert(0, (m.group("text"), m.group("reason")))
            k -= 1
        transcript = any(line.startswith("$ ") for line in body)
        kind = ("bash" if lang in SHELL or transcript else "python" if lang == "python"
                else "yaml" if lang in ("yaml", "yml") else "output")
        commands = _commands(body, i + 2) if kind == "bash" else []
        whole = next((reason for text_, reason in markers if text_ is None), None)
        partial = [(text_, reason) for text_, reason in markers if text_ is not None]
        commands = [Command(c.text, c.line, c.shown, next((r for t, r in partial if t in c.text), None))
                    for c in commands]
        blocks.append(Block(page, i + 1, kind, "\n".join(body) + "\n", whole, tuple(commands), tuple(markers)))
        i = j + 1
    return blocks


def stray_markers(text: str) -> list[int]:
    """Lines holding a `not run` marker that is malformed or not directly above a fence (a
    chain of markers counts as above it)."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not _LOOSE_MARKER.search(line):
            continue
        k = i
        while k < len(lines) and _MARKER.match(lines[k]):
            k += 1
        if not _MARKER.match(line) or k >= len(lines) or not _FENCE.match(lines[k]):
            bad.append(i + 1)
    return bad


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in pages(root) for b in parse(p.read_text(), str(p.relative_to(root)))]


def not_run(blocks: list[Block]) -> list[str]:
    """Every block or command not run, with its reason, one line each in page order."""
    lines = []
    for b in blocks:
        if not b.runnable:
            continue
        if b.not_run:
            lines.append(f"{b.id} ({b.lang} block, whole): {b.not_run}")
        lines += [f"{b.page}:{c.line} `{c.text}`: {c.not_run}" for c in b.commands if c.not_run and not b.not_run]
    return lines


if __name__ == "__main__":  # python -m tests.docs.blocks: what is not run, for a release note
    sys.stdout.write("".join(line + "\n" for line in not_run(all_blocks())))

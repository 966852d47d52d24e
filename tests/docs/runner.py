"""Runs a page's blocks (tests/docs/blocks.py) as a reader would, at the sizes of tests/docs/sizes.py.

The pages are followed in order (README.md, then docs/*.md) in one working directory, a checkout
of their own (the repository's inputs linked in: configs/, benchmarks/, scripts/, .venv ...; a
`docs/` of its own for what commands write there), with `HF_HUB_OFFLINE=1` and the virtual
environment active (`.venv/bin` first on PATH). A command line is expanded by bash (quotes, `$(...)`, leading
`NAME=value`), then:

- `hyperparallel ...`, `.venv/bin/hyperparallel ...`, `python -m hyperparallel ...`: the CLI, in the
  session's worker process (tests/docs/worker.py), with the size options added; `train --nproc N`
  runs everything before its ranks start (the config, the layout against N ranks, preflight) and
  not the ranks' training (tests/train and tests/dist run that);
- `python SCRIPT.py ...` / `python -m MODULE ...` (any of the venv's pythons): in the worker, a
  benchmark with its small options (sizes.BENCH_SIZES);
- `source .venv/bin/activate`: the file must exist (the environment already is active);
- `make TARGET`: `make -n TARGET` in the repository (the targets are the whole suite, the demo and
  every benchmark: what they run is run here block by block);
- anything else, or a line with pipes, `;`, `&&` or redirections: `bash -c LINE`.

A Python snippet runs as a script in the worker (a fresh namespace, sizes.SNIPPET_SIZES applied,
one torchrun rank's environment); a YAML block is validated as a config file
(`hyperparallel train FRAGMENT --print-config`).

Checks: every command exits 0, or with the status the page shows (`$ echo $?` then the number; a
transcript showing only `error:` lines: 2). Where the page shows a command's output, the output has
the same shape: each shown line's first word (numbers aside) begins some line of the real output,
and a shown table has the same header cells and the same number of columns.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.docs import sizes
from tests.docs.blocks import ROOT, Block

VENV_BIN = ROOT / ".venv" / "bin"
LINKED = ["configs", "benchmarks", "scripts", "hyperparallel", "csrc", ".venv", "Makefile", "pyproject.toml",
          "setup.py", "README.md"]
PYTHONS = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
CLI = {"hyperparallel", ".venv/bin/hyperparallel"}
TIMEOUT_S = 240


class BlockFailure(AssertionError):
    """A documented block that does not do what its page says."""


@dataclass
class Result:
    command: str  # what ran, as run
    rc: int
    out: str
    err: str
    seconds: float
    reused: bool = False

    def tail(self, lines: int = 25) -> str:
        text = (self.out + ("\n" if self.out and not self.out.endswith("\n") else "") + self.err).rstrip()
        return "\n".join(text.splitlines()[-lines:])


class Worker:
    """The worker process (tests/docs/worker.py), started on first use and again after a timeout."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env, self.log, self.proc = env, log, None

    def start(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("worker.py"))], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self.log.open("ab"), env=self.env, cwd=ROOT, text=True,
                start_new_session=True)

    def request(self, request: dict, timeout: float = TIMEOUT_S) -> dict:
        self.start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            timed_out = not ready
            self.stop()
            return {"rc": 124 if timed_out else 1, "seconds": timeout if timed_out else 0.0, "reused": False,
                    "died": "timed out" if timed_out else f"the worker died (log: {self.log})"}
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and the processes it started
            self.proc.wait()
        self.proc = None


class DocRunner:
    def __init__(self, base: Path | None = None):
        self.base = Path(base or tempfile.mkdtemp(prefix="hp-docs-"))
        self.tmp = self.base / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", HYPERPARALLEL_CACHE=str(self.base / "cache"), TMPDIR=str(self.tmp),
                   MPLBACKEND="Agg", VIRTUAL_ENV=str(ROOT / ".venv"), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
        env.pop("PYTHONHOME", None)
        self.env = env
        self.worker = Worker(env, self.base / "worker.log")
        self.worker.start()  # (its imports overlap whatever the session does first)
        self.results: list[Result] = []

    def close(self) -> None:
        self.worker.stop()

    # ------------------------------------------------------------------ places and placeholders
    def workdir(self, page: str) -> Path:
        """Where a page's commands run: one checkout for every page (a reader's, after README.md
        they read docs/)."""
        path = self.base / "checkout"
        if not path.exists():
            path.mkdir(parents=True)
            for name in LINKED:
                (path / name).symlink_to(ROOT / name)
            (path / "docs").mkdir()
        return path

    def _newest_run(self, page: str) -> Path | None:
        steps = [p for p in (self.workdir(page) / "runs").glob("**/checkpoints/step_*") if p.is_dir()
                 and not p.name.endswith(".tmp")]
        return max(steps, key=lambda p: p.stat().st_mtime).parent.parent if steps else None

    def resolve(self, page: str, text: str) -> str:
        """The command with the page's placeholders replaced, what it reads made first."""
        for pattern, replacement in sizes.PLACEHOLDERS:
            text = re.sub(pattern, replacement, text)
        if "{run_dir}" in text or "{step}" in text:
            run = self._newest_run(page)
            if run is None:  # the run a reader would have made by now
                self._require(self.run_command(page, "hyperparallel train"), "the default training")
                run = self._newest_run(page)
            step = max(p.name for p in (run / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
            text = text.replace("{run_dir}", str(run.relative_to(self.workdir(page)))).replace("{step}", step)
        for name, recipe in sizes.PREREQUISITES.items():
            if (re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w/.-])", text) and text.split()[:2] != recipe.split()[:2]
                    and not (self.workdir(page) / name).exists()):
                self._require(self.run_command(page, recipe), f"making {name}")
        return text.replace("{tmp}", str(self.tmp))

    @staticmethod
    def _require(result: Result, what: str) -> None:
        if result.rc != 0:
            raise BlockFailure(f"{what} (`{result.command}`) failed with status {result.rc}:\n{result.tail()}")

    # ------------------------------------------------------------------ commands
    def _expand(self, page: str, text: str) -> list[str]:
        done = subprocess.run(["bash", "-c", 'printf "%s\\0" ' + text], cwd=self.workdir(page), env=self.env,
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise BlockFailure(f"bash cannot expand `{text}`: {done.stderr.strip()}")
        return done.stdout.split("\0")[:-1]

    @staticmethod
    def _is_compound(text: str) -> bool:
        """Pipes, lists, redirections or subshells (a `$(...)` inside a word is none of them)."""
        text = re.sub(r"\$\([^()]*\)|`[^`]*`", "x", text)
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        try:
            return any(token and set(token) <= set("();<>|&") for token in lexer)
        except ValueError:  # (unbalanced quotes: bash says what is wrong)
            return True

    def run_command(self, page: str, text: str) -> Result:
        text = self.resolve(page, text)
        cwd = self.workdir(page)
        if self._is_compound(text):
            if re.search(r"(?<![\w-])hyperparallel(?![\w.-])", text.split("#")[0]):
                raise BlockFailure(f"`{text}`: a `hyperparallel` command inside a pipe or list cannot be run at a small "
                                   f"size; write it on a line of its own, or mark it not run")
            return self._shell(text, cwd)
        words = self._expand(page, text)
        env = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if not words:
            return Result(text, 0, "", "", 0.0)
        program, args = words[0], words[1:]
        if program in CLI:
            return self._cli(args, cwd, env, text)
        if program in PYTHONS and args[:2] == ["-m", "hyperparallel"]:
            return self._cli(args[2:], cwd, env, text)
        if program in PYTHONS and args[:1] == ["-m"] and len(args) > 1:
            return self._worker({"kind": "module", "module": args[1], "argv": args[2:]}, cwd, env, text)
        if program in PYTHONS and args and args[0].endswith(".py"):
            return self._worker({"kind": "script", "path": args[0], "argv": self._bench_args(args[0], args[1:])},
                                cwd, env, text)
        if program in ("source", ".") and args:
            there = (cwd / args[0]).is_file()
            return Result(text, 0 if there else 1, "", "" if there else f"{args[0]}: no such file", 0.0)
        if program == "make":
            return self._shell(shlex.join(["make", "-n", "-C", str(ROOT), *args]), ROOT)
        return self._shell(text, cwd)

    def _cli(self, args: list[str], cwd: Path, env: dict, text: str) -> Result:
        command = args[0] if args else ""
        rest = args[1:]
        if command == "train":
            resume = any(re.fullmatch(r"checkpoint\.resume=\s*latest", a) for a in rest)
            forced = sizes.TRAIN_SIZES + (sizes.RESUME_SIZES if resume else [])
            args = ["train", *_sets(sizes.TRAIN_DEFAULTS), *rest, *_sets(forced)]
        elif command == "prepare":
            args = ["prepare", *rest, *_sets(sizes.PREPARE_SIZES)]
        elif command == "plan":
            config = next((a for a in rest if a.endswith((".yaml", ".yml"))), None)
            args = ["plan", *rest, *_sets(sizes.PLAN_SIZES.get(config, []))]
        elif command == "generate":
            args = ["generate", *rest, *sizes.GENERATE_SIZES]
        elif command == "bench" and rest:
            from hyperparallel.cli import BENCHMARKS

            script = BENCHMARKS.get(rest[0])
            args = ["bench", rest[0], *(self._bench_args(script, rest[1:]) if script else rest[1:])]
        return self._worker({"kind": "cli", "argv": args, "launch": False}, cwd, env, text)

    @staticmethod
    def _bench_args(script: str, args: list[str]) -> list[str]:
        name = Path(script).name
        if name not in sizes.BENCH_SIZES:
            raise BlockFailure(f"no small size for {script}: add one to tests/docs/sizes.py's BENCH_SIZES, or mark the "
                               f"command not run on its page")
        return [*args, *sizes.BENCH_SIZES[name]]

    def _worker(self, request: dict, cwd: Path, env: dict, text: str) -> Result:
        out, err = (Path(tempfile.mkstemp(dir=self.tmp, suffix=s)[1]) for s in (".out", ".err"))
        answer = self.worker.request({**request, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)})
        argv = request.get("argv", [])
        program = {"cli": ["hyperparallel"], "module": ["python", "-m", request.get("module", "")]}.get(
            request["kind"], ["python", request.get("path", "")])
        shown = shlex.join([*program, *argv])
        result = Result(shown, answer["rc"], out.read_text(errors="replace"), err.read_text(errors="replace"),
                        answer["seconds"], answer.get("reused", False))
        if "died" in answer:
            result.err += f"\n(tests/docs: {answer['died']})"
        self.results.append(result)
        return result

    def _shell(self, text: str, cwd: Path) -> Result:
        started = time.perf_counter()
        try:
            done = subprocess.run(["bash", "-c", text], cwd=cwd, env=self.env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S, start_new_session=True)
            rc, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            rc, out, err = 124, str(expired.stdout or ""), f"(tests/docs: timed out after {TIMEOUT_S} s)"
        result = Result(text, rc, out, err, time.perf_counter() - started)
        self.results.append(result)
        return result

    # ------------------------------------------------------------------ snippets and configs
    def run_snippet(self, block: Block) -> Result:
        code = block.text
        for (page, contains), numbers in sizes.SNIPPET_SIZES.items():
            if page == block.page and contains in code:
                code = re.sub(r"\b\d+\b", lambda m, numbers=numbers: numbers.get(m.group(0), m.group(0)), code)
        cwd = self.workdir(block.page)
        path = cwd / f"snippet_{block.line}.py"
        path.write_text(code)
        env = dict(sizes.SNIPPET_ENV, MASTER_PORT=str(_free_port()))
        return self._worker({"kind": "snippet", "path": str(path)}, cwd, env, f"python {path.name}")

    def check_config(self, block: Block) -> Result:
        """A config fragment: its keys as `--set`s over the default config, resolved."""
        import yaml

        def leaves(node, prefix=""):
            if isinstance(node, dict) and node:
                for key, value in node.items():
                    yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix[:-1]}={yaml.safe_dump(node, default_flow_style=True).strip().removesuffix('...').strip()}"

        fragment = yaml.safe_load(block.text)
        if not isinstance(fragment, dict):
            raise BlockFailure(f"{block.id}: a yaml block is a fragment of a trainer config, a mapping")
        argv = ["train", "--print-config", *_sets(list(leaves(fragment)))]
        return self._worker({"kind": "cli", "argv": argv}, self.workdir(block.page), {}, shlex.join(argv))

    # ------------------------------------------------------------------ a block
    def check_block(self, block: Block) -> list[str]:
        """Run a block; raise BlockFailure naming each way it differs from its page. Returns the
        commands not run (with their markers' reasons)."""
        if block.lang == "python":
            self._expect_success(block, self.run_snippet(block))
            return []
        if block.lang == "yaml":
            self._expect_success(block, self.check_config(block))
            return []
        skipped, problems = [], []
        commands = list(block.commands)
        for i, command in enumerate(commands):
            if _exit_status_echo(command):
                continue
            if command.not_run:
                skipped.append(f"{command.text}: {command.not_run}")
                continue
            result = self.run_command(block.page, command.text)
            expected = _expected_status(commands, i)
            found = []
            if result.rc != expected:
                found.append(f"exit status {result.rc}, the page says {expected}")
            if command.shown and result.rc == expected:
                found += shape_problems(command.shown, result.out + "\n" + result.err, _subcommand(command.text))
            if found:
                problems.append(f"{block.page}:{command.line}: `{command.text}`\n  ran: `{result.command}`\n  "
                                + "\n  ".join(found) + "\n  its output's end:\n" + _indent(result.tail()))
        if problems:
            raise BlockFailure("\n\n".join(problems))
        return skipped

    def _expect_success(self, block: Block, result: Result) -> None:
        if result.rc != 0:
            raise BlockFailure(f"{block.id}: `{result.command}` exited {result.rc}:\n{_indent(result.tail())}")


def _sets(pairs: list[str]) -> list[str]:
    return [word for pair in pairs for word in ("--set", pair)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _subcommand(text: str) -> str:
    words = text.split()
    for i, word in enumerate(words):
        if word.endswith("hyperparallel"):
            return words[i + 1] if i + 1 < len(words) else ""
    return ""


def _exit_status_echo(command) -> bool:
    return command.text.split("#")[0].strip() == "echo $?"


def _expected_status(commands: list, i: int) -> int:
    """What the page says command i exits with: a following `$ echo $?`'s number, else 2 when all
    it shows are `error:` lines, else 0."""
    after = commands[i + 1] if i + 1 < len(commands) else None
    if after is not None and _exit_status_echo(after):
        shown = [line.strip() for line in after.shown if line.strip()]
        if shown and shown[0].isdigit():
            return int(shown[0])
    shown = [line for line in commands[i].shown if line.strip() and line.strip() != "..."]
    return 2 if shown and all(line.startswith("error:") for line in shown) else 0


def _key(line: str) -> str:
    return re.sub(r"\d[\d,.]*", "#", line.split()[0])


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def shape_problems(shown: tuple[str, ...] | list[str], actual: str, subcommand: str = "") -> list[str]:
    """How the output a page shows differs in shape from a real run's output (empty: alike)."""
    lines = [line for line in shown if line.strip() and line.strip() != "..."
             and not any(re.search(pattern, line) for pattern in sizes.NOT_AT_THIS_SIZE)]
    if subcommand in sizes.FREE_TEXT and len(lines) > 2:
        lines = [lines[0], lines[-1]]
    real = [line for line in actual.splitlines() if line.strip()]
    real_keys = {_key(line) for line in real}
    real_tables = [_cells(line) for line in real if line.strip().startswith("|")]
    problems, header = [], None
    for line in lines:
        if line.strip().startswith("|"):
            cells = _cells(line)
            if all(set(cell) <= set("-: ") for cell in cells):
                continue
            if header is None:
                header = cells
                if cells not in real_tables:
                    problems.append(f"the table header {line.strip()!r} is not in the output")
            elif len(cells) != len(header):
                problems.append(f"the row {line.strip()!r} has {len(cells)} columns, its header {len(header)}")
            continue
        header = None
        if _key(line) not in real_keys:
            problems.append(f"no output line begins as the shown line {line.strip()!r} does")
    return problems

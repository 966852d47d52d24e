"""The package's imports follow docs/architecture.md's layers.

The "depends on" column of the doc's package table is read as the rule: a package (or top-level
module) of hyperparallel may import, at module level or inside a function, only the packages that
its row names in backticks, and the shared modules every layer uses (`errors`, `versions`, `traffic`,
`lazy_exports`, `schema`, the package's `__version__`). "all of the above" (the trainer) may import every
package listed above its row. "`X` only in F.py" lets only the row's file F.py (its path in the
package) import X. So the doc and the code cannot drift apart: an import the doc does
not allow fails here, naming the file and line, and so does a row naming a package that is none.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hyperparallel"
SHARED = {"errors", "versions", "traffic", "lazy_exports", "schema", "__init__", "__main__", "__version__"}


def allowed_imports(doc: str) -> dict[str, set[str]]:
    """Each row of the "## Packages" table: its name (no `.py`) -> the names it may import."""
    return _rules(doc)[0]


def only_in(doc: str) -> dict[str, dict[str, str]]:
    """Each row's names that one file of it alone may import: row -> {name: file name}."""
    return _rules(doc)[1]


def _rules(doc: str) -> tuple[dict[str, set[str]], dict[str, dict[str, str]]]:
    table = doc.split("## Packages", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, set[str]] = {}
    files: dict[str, dict[str, str]] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) < 3 or not cells[0].startswith("`"):  # (a "what it is" cell may hold " | ")
            continue
        name, depends = cells[0].strip("`").removesuffix(".py"), cells[-1]
        if depends.startswith("all of the above"):
            rules[name] = set(rules)
        else:
            rules[name] = {m.split(".")[0].removesuffix(".py") for m in re.findall(r"`([\w.]+)`", depends)}
        files[name] = dict(re.findall(r"`(\w+)` only in ([\w]+\.py)", depends))
    return rules, files


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, the hyperparallel name imported: its first part below the package) of every import
    in the file under `root` (which holds the package), relative ones resolved."""
    found = [(line, name.split(".")[1]) for line, name in modules_imported(path, root)
             if name.startswith("hyperparallel.")]
    return list(dict.fromkeys(found))  # (`from M import a, b`: one import of M's package)


def modules_imported(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, the module's whole dotted name) of every import in the file under `root`, relative
    ones resolved; `from M import a` imports M.a where a is a module of package M (always below
    `hyperparallel` itself: `from hyperparallel import moe` imports the package moe), else M."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = path.relative_to(root).with_suffix("").parts  # ("hyperparallel", "moe", "router")
    if here[-1] == "__init__":
        here = here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            folder = root.joinpath(*module.split("."))
            names = [f"{module}.{alias.name}" if module == "hyperparallel" or (folder / f"{alias.name}.py").is_file()
                     or (folder / alias.name / "__init__.py").is_file() else module for alias in node.names]
        else:
            continue
        found.extend((node.lineno, name) for name in names)
    return found


def violations(rules: dict[str, set[str]], package: Path = PACKAGE,
               files: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Every import of a file under `package` (the hyperparallel directory) that `rules` (and the
    one-file permissions `files`) do not allow."""
    root = package.parent
    bad = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        layer = parts[0] if len(parts) > 1 else path.stem
        if layer in SHARED:
            continue
        if layer not in rules:
            bad.append(f"{path.relative_to(root)}: {layer} has no row in docs/architecture.md's package table")
            continue
        for line, imported in imports_of(path, root=root):
            if imported != layer and imported not in SHARED and imported not in rules[layer]:
                bad.append(f"{path.relative_to(root)}:{line}: {layer} imports {imported}, which its row does not name")
            elif (files or {}).get(layer, {}).get(imported, "/".join(parts[1:])) != "/".join(parts[1:]):
                bad.append(f"{path.relative_to(root)}:{line}: {layer} imports {imported}, which its row allows only "
                           f"in {files[layer][imported]}")
    return bad


def test_every_import_between_packages_is_one_the_architecture_table_allows():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rules = allowed_imports(doc)
    assert {"kernels", "mx", "models", "parallel", "checkpoint", "train", "cli"} <= set(rules)
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    unknown = {name: deps - packages - modules for name, deps in rules.items() if deps - packages - modules}
    assert not unknown, f"rows naming no package of hyperparallel: {unknown}"
    assert only_in(doc)["kernels"] == {"mx": "aot.py"}
    assert violations(rules, files=only_in(doc)) == []


def loop_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of the trainer's loop in the planning package under `package`."""
    loop = "hyperparallel.train.loop"
    return [f"{path.relative_to(package.parent)}:{line}: imports {name}"
            for path in sorted((package / "train" / "planning").rglob("*.py"))
            for line, name in modules_imported(path, package.parent) if name == loop or name.startswith(f"{loop}.")]


def test_the_planning_package_never_imports_the_training_loop(tmp_path):
    """`hyperparallel plan` and a finished run's memory summary use the planning package, which
    measures what a run imports without importing the loop (planning/memory.py, RUN_MODULES;
    tests/train/test_plan.py checks that they are all a run imports). The check bites: each way
    of naming the loop, absolute or relative, is found."""
    assert loop_imports() == []
    planning = tmp_path / "hyperparallel" / "train" / "planning"
    planning.mkdir(parents=True)
    (planning.parent / "loop.py").write_text("")
    (planning / "memory.py").write_text("import hyperparallel.train.loop\nfrom hyperparallel.train import loop\n\n\n"
                                        "def f():\n    from ..loop import train\n")
    assert loop_imports(tmp_path / "hyperparallel") == [
        f"hyperparallel/train/planning/memory.py:{line}: imports hyperparallel.train.loop" for line in (1, 2, 6)]


def test_the_check_finds_an_import_the_table_does_not_allow(tmp_path):
    """The rule bites: models (which the table does not let import parallel) importing it inside a
    function is reported with its file and line, and so is a package the table has no row for."""
    rules = allowed_imports((ROOT / "docs" / "architecture.md").read_text())
    assert "parallel" not in rules["models"] and "parallel" in rules["train"]
    package = tmp_path / "hyperparallel"
    (package / "models").mkdir(parents=True)
    (package / "models" / "loss.py").write_text("import torch\n\nfrom . import families\n\n\ndef f():\n"
                                                "    from ..parallel import mesh\n")
    (package / "nowhere").mkdir()
    (package / "nowhere" / "__init__.py").write_text("")
    (package / "kernels").mkdir()
    (package / "kernels" / "native.py").write_text("from hyperparallel import mx\n")  # mx only in aot.py
    (package / "kernels" / "aot.py").write_text("from hyperparallel import mx\n")
    files = only_in((ROOT / "docs" / "architecture.md").read_text())
    assert violations(rules, package, files) == [
        "hyperparallel/kernels/native.py:1: kernels imports mx, which its row allows only in aot.py",
        "hyperparallel/models/loss.py:7: models imports parallel, which its row does not name",
        "hyperparallel/nowhere/__init__.py: nowhere has no row in docs/architecture.md's package table"]


LOWER = ("transformers", "hyperparallel.parallel")


@pytest.mark.parametrize(("code", "unloaded"), [
    ("from hyperparallel.checkpoint import save, load, async_save", LOWER),
    ("from hyperparallel.moe import TopKRouter, MegaMoE, GroupedExperts", LOWER),
    ("from hyperparallel.cli import main", LOWER),
    ("from hyperparallel.train.config import load_config; load_config(None, [])", ("transformers",)),
])
def test_importing_a_lower_layer_loads_no_transformers(code, unloaded):
    """The checkpoint and MoE packages' names and the command line load neither transformers nor
    parallel (and, through it, torch.distributed.checkpoint's planners); reading a config (the
    default one) loads no transformers."""
    code += f"; import sys; print([m for m in {unloaded!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert (out.stdout.strip().splitlines() or [""])[-1] == "[]", out.stderr

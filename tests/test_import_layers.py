"""The package's imports follow docs/architecture.md's layers.

The "depends on" column of the doc's package table is read as the rule: a package (or top-level
module) of hyperparallel may import, at module level or inside a function, only the packages that
its row names in backticks, and the shared modules every layer uses (`errors`, `versions`,
`traffic`, `process_groups`, `lazy_exports`, `schema`, the package's `__version__`). "all of the
above" (the trainer) may import every package listed above its row. "`X` only in F.py" lets only the row's file F.py (its path in the
package) import X. So the doc and the code cannot drift apart: an import the doc does
not allow fails here, naming the file and line, and so does a row naming a package that is none.
Within a layer too, imports go one way: no circle of imports between modules runs (`import_circles`).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hyperparallel"
SHARED = {"errors", "versions", "traffic", "process_groups", "lazy_exports", "schema", "__init__", "__main__",
          "__version__"}


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
    return [(line, f"{module}.{name}" if name is not None and (module == "hyperparallel" or _is_module(root, f"{module}.{name}"))
             else module) for line, module, name, _ in _imports(path, root)]


def _imports(path: Path, root: Path) -> list[tuple[int, str, str | None, bool]]:
    """(line, module, name, whether it can run) of every import in the file under `root`: `import M`
    gives (M, None), `from M import a` (M, a), relative ones resolved; one inside `if TYPE_CHECKING:`
    never runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = path.relative_to(root).with_suffix("").parts  # ("hyperparallel", "moe", "router")
    if here[-1] == "__init__":
        here = here[:-1]
    typing_only = {id(inner) for node in ast.walk(tree)  # (`if TYPE_CHECKING:` exactly; `if not ...` runs)
                   if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for statement in node.body for inner in ast.walk(statement)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            pairs = [(module, alias.name) for alias in node.names]
        else:
            continue
        found.extend((node.lineno, module, name, id(node) not in typing_only) for module, name in pairs)
    return found


def _is_module(root: Path, dotted: str) -> bool:
    """Whether `dotted` names a module or package file under `root`."""
    where = root.joinpath(*dotted.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


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


def import_circles(package: Path = PACKAGE) -> list[str]:
    """Every circle of imports that run among the modules under `package` (the hyperparallel
    directory): a module's import runs another module, whose own imports (at module level or in a
    function, not inside `if TYPE_CHECKING:`) lead back to the first. Importing a module runs the
    packages above it that are not already running (those above the importer are), and `from P
    import a` runs the module of P that `a` is read from: P.a where that is a module, the module
    P's lazy_exports reads `a` from, else P's __init__. One line per circle: its imports in order,
    each as the importing file and line, and the other modules of the circle if it has more."""
    root = package.parent
    modules = {_dotted(path, root): path for path in sorted(package.rglob("*.py"))}
    graph = {name: _runs(name, path, root, modules) for name, path in modules.items()}
    circles = []
    for members in _strongly_connected(graph):
        start = min(members)
        way = {start: None}  # the shortest circle through start: a breadth-first walk back to it
        queue, end = [start], None
        while end is None:
            here = queue.pop(0)
            for there, line in graph[here]:
                if there == start:
                    end = (here, line)
                    break
                if there in members and there not in way:
                    way[there] = (here, line)
                    queue.append(there)
        steps = [end]
        while way[steps[-1][0]] is not None:
            steps.append(way[steps[-1][0]])
        steps.reverse()
        imported = [name for name, _ in steps[1:]] + [start]
        rest = sorted(members - set(imported))
        circles.append("; ".join(f"{modules[name].relative_to(root)}:{line} imports {there}"
                                 for (name, line), there in zip(steps, imported, strict=True))
                       + (f" (the circle also holds {', '.join(rest)})" if rest else ""))
    return sorted(circles)


def _dotted(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runs(importer: str, path: Path, root: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(module, line) of every module of `modules` that an import of `importer`'s file runs."""
    above = {importer.rsplit(".", n)[0] for n in range(importer.count(".") + 1)}  # (itself included)
    found = []
    for line, module, name, runs in _imports(path, root):
        if not runs:
            continue
        target = module
        if name is not None and f"{module}.{name}" in modules:
            target = f"{module}.{name}"
        elif name is not None and module in modules and name in (lazy := _lazy_exports(modules[module])):
            target = f"{module}.{lazy[name]}"
        if target not in modules:
            continue  # (not of the package)
        parts = target.split(".")
        packages = [".".join(parts[:n]) for n in range(1, len(parts))]
        found += [(p, line) for p in packages if p in modules and p not in above]
        if target != importer:
            found.append((target, line))
    return found


@functools.cache
def _lazy_exports(init: Path) -> dict[str, str]:
    """A package's names that its lazy_exports reads from a module of it: name -> the module's name."""
    if init.name != "__init__.py":
        return {}
    exported = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" \
                and len(node.args) == 2 and isinstance(node.args[1], ast.Dict):
            for module, names in zip(node.args[1].keys, node.args[1].values, strict=True):
                for entry in ast.literal_eval(names):
                    name, _, alias = entry.partition(" as ")
                    exported[alias or name] = ast.literal_eval(module)
    return exported


def _strongly_connected(graph: dict[str, list[tuple[str, int]]]) -> list[set[str]]:
    """The sets of two or more modules of `graph` that each reach all the others (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for there, _ in graph[node]:
            if there not in index:
                visit(there)
                low[node] = min(low[node], low[there])
            elif there in stack:
                low[node] = min(low[node], index[there])
        if low[node] == index[node]:
            members = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(members) > 1:
                found.append(members)

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_runs():
    """No module's imports lead back to it: each import of the package runs only modules that never
    import the importer again, at module level or in a function (a circle works only while the
    order its modules are first imported in happens to suit it, and is one module in two files)."""
    assert import_circles() == []


def test_the_circle_check_finds_circles_through_functions_and_lazy_exports(tmp_path):
    """The check bites, on the two circles it was written against: an import inside a function
    each way (train/config's model.path check and train/checkpointing's refused resume, each
    importing the other), and one through a package's lazy export (models/families importing a
    name of standins, under another name, from the models package, whose lazy_exports reads it
    from standins, whose __getattr__ imported families). An import only a type checker runs
    closes none."""
    package = tmp_path / "hyperparallel"
    (package / "train").mkdir(parents=True)
    (package / "models").mkdir()
    for init in (package, package / "train"):
        (init / "__init__.py").write_text("")
    (package / "lazy_exports.py").write_text("def lazy_exports(name, modules):\n    return None, None, []\n")
    (package / "train" / "config.py").write_text("import json\n\n\ndef _model_type_in(path):\n"
                                                 "    from hyperparallel.train.checkpointing import not_a_model_directory\n")
    (package / "train" / "checkpointing.py").write_text("def check_matches(path, cfg):\n"
                                                        "    from hyperparallel.train.config import differences\n")
    (package / "train" / "loop.py").write_text("from typing import TYPE_CHECKING\n\nfrom . import config\n\n"
                                               "if TYPE_CHECKING:\n    from .planning import Plan\n")
    (package / "train" / "planning.py").write_text("from hyperparallel.train import loop\n")
    (package / "models" / "__init__.py").write_text(
        "from hyperparallel.lazy_exports import lazy_exports\n\n__getattr__, __dir__, __all__ = lazy_exports(__name__, "
        "{'standins': ('stand_in', 'stands_in as is_stand_in'), 'families': ('FAMILIES',)})\n")
    (package / "models" / "families.py").write_text("from hyperparallel.models import is_stand_in\n")
    (package / "models" / "standins.py").write_text("def __getattr__(name):\n    from .families import FAMILIES\n")
    assert import_circles(package) == [
        "hyperparallel/models/families.py:1 imports hyperparallel.models.standins; "
        "hyperparallel/models/standins.py:2 imports hyperparallel.models.families",
        "hyperparallel/train/checkpointing.py:2 imports hyperparallel.train.config; "
        "hyperparallel/train/config.py:5 imports hyperparallel.train.checkpointing"]


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

"""Packages whose public names are imported on first use (PEP 562).

A package built this way imports none of its modules when it is imported: `from
hyperparallel.moe import LOAD_BALANCE` loads `moe/router.py` and nothing else, so the command line
validates a config, and `import hyperparallel.checkpoint` runs, without torch.distributed.checkpoint,
transformers, Triton or Dynamo (docs/architecture.md, "Imports go one way"). Each name is
imported from its module the first time it is read, and kept on the package from then on.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
    """`__getattr__`, `__dir__` and `__all__` for the package named `package`.

    `modules` maps each of its modules to the names the package exports from it, as an import
    statement would list them (`"NAME as ALIAS"` re-exports under another
    name). A name that is none of these but a module of the package is imported as the
    module, as an eager `__init__` would have left it on the package."""
    where: dict[str, tuple[str, str]] = {}
    for module, names in modules.items():
        for entry in names:
            name, _, alias = entry.partition(" as ")
            if (alias or name) in modules:  # the module, once imported, would be bound over the name
                raise ValueError(f"{package}: {alias or name!r} names both a module and an export")
            where[alias or name] = (module, name)

    def __getattr__(name: str):
        if name in where:
            module = importlib.import_module(f"{package}.{where[name][0]}")
            for exported, (source, attribute) in where.items():  # all of them, as `from M import a, b` does
                if source == where[name][0]:
                    setattr(sys.modules[package], exported, getattr(module, attribute))
            return getattr(sys.modules[package], name)
        if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return importlib.import_module(f"{package}.{name}")  # (which binds it on the package)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)

"""The example configs, shipped inside the package (hyperparallel/configs/, which the checkout's
configs/ links to) so that an installed wheel has them: `hyperparallel train NAME` names one,
and no config at all means default.yaml. Standard library only: the CLI's help lists them."""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent.parent / "configs"
DEFAULT = DIRECTORY / "default.yaml"


def names() -> list[str]:
    """The examples' names: their file names without .yaml."""
    return sorted(p.stem for p in DIRECTORY.glob("*.yaml"))


def find(name: str) -> Path | None:
    """The example called `name` (with or without .yaml), or None."""
    path = DIRECTORY / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return path if "/" not in name and path.is_file() else None

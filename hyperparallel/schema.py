"""The base of every config section, for the components that declare their own (optim's
OptimizerConfig, moe's MoEConfig, lowp's LowPrecisionConfig, ...) and the trainer that composes
them into its YAML schema (train/config.py), so a setting and its default are written once, by
the component that reads it.

A section refuses keys it does not know ("did you mean"), validates assignments too, and reports
every problem at once, one line each: as a ConfigError when built in code, as the trainer's list
of problems when it is part of a YAML file. (A bad value assigned to a built section raises
pydantic's ValidationError, a ValueError, as pydantic's validate_assignment does.)
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from hyperparallel.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, **data: Any) -> None:
        # Built in code (OptimizerConfig(lr=-1)), a mistake is a ConfigError like any other a user
        # can cause, every problem one line.
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise ConfigError("\n".join(problems(error, type(self)))) from None

    # Marked as pydantic's own __init__ (as pydantic's RootModel marks its), pydantic's validation
    # does not call it: a section inside a larger config (model_validate of the trainer's YAML)
    # leaves its problems to the whole, listed together, each under its full key.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


def choice(names) -> Any:
    """A Literal of the names a registry implements (model families, compile backends, ...): the
    choices are stated once, where they are implemented."""
    return Literal[tuple(names)]


def problems(error: ValidationError, root: type[BaseModel], skip: tuple | None = None) -> list[str]:
    """One line per problem of `error`, raised validating `root` (problems under the key `skip`
    left out): `key: what is wrong`, with "did you mean" for an unknown key."""
    seen: list[str] = []
    for problem in error.errors():
        if skip is not None and tuple(problem["loc"][: len(skip)]) == skip:
            continue
        line = _describe(problem, root)
        if line not in seen:  # (a union reports a wrong value once per member)
            seen.append(line)
    return seen


def _describe(problem: dict, root: type[BaseModel]) -> str:
    where = ".".join(str(p) for p in problem["loc"])
    message = problem["msg"].removeprefix("Value error, ")
    if problem["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(problem["loc"][-1]), _known_keys(root, problem["loc"]), n=1)
        parent = ".".join(str(p) for p in problem["loc"][:-1])
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        return f"{where}: unknown key{hint}"
    if problem["type"] == "missing":
        return f"{where}: missing"
    if message.startswith(f"{where}") or not where:  # our validators name their keys themselves
        return message
    if "input" in problem and problem["type"] not in ("value_error", "assertion_error"):
        return f"{where}: {message} (got {problem['input']!r})"
    return f"{where}: {message}"


def _known_keys(root: type[BaseModel], loc: tuple) -> list[str]:
    """The keys of the section at loc[:-1] below `root` (for "did you mean")."""
    section = root
    for part in loc[:-1]:
        field = section.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        section = annotation
    return [field.alias or name for name, field in section.model_fields.items()]

"""User-facing exception types.

Every error a user can cause (a config, a shape, a path, a checkpoint) raises one of these with a
message that names the thing at fault and what would be right. Each subclasses the matching
built-in so that callers who catch ``ValueError`` or ``RuntimeError`` keep working.
"""


class HyperparallelError(Exception):
    """Base of every error hyperparallel raises on purpose. A message of several lines is several
    problems found together (a config's), one per line."""


def error_lines(message: str) -> str:
    """What the command line prints for an error: `error: ` before each of its problems."""
    return "\n".join(f"error: {line}" for line in message.splitlines() or [""])


class ConfigError(HyperparallelError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class ShapeError(HyperparallelError, ValueError):
    """A tensor has a shape, dtype or layout that the operation cannot take."""


class CheckpointError(HyperparallelError, RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


class BackendError(HyperparallelError, RuntimeError):
    """A requested compute backend is unknown or unavailable on this machine."""

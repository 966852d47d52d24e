"""`logging.trace`: a timeline of a few training steps in RUN_DIR/trace.json (hyperparallel.multicore.timeline).

The trace opens before the second step of the run (the first allocates, compiles and warms up)
and closes after `logging.trace_steps` steps, or when the run ends sooner. Closing gathers every
rank's slices (a collective), so it happens at the same step on every rank."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from hyperparallel.multicore import timeline


class StepTrace:
    def __init__(self, path: Path, *, first_step: int, last_step: int, steps: int, enabled: bool):
        self.path = path
        self.enabled = enabled
        self.begin = min(first_step + 1, last_step - 1)  # a step index (0-based) of this run
        self.end = min(self.begin + steps, last_step)  # exclusive
        self._open = None

    def step(self, step: int):
        """The context the step `step` runs in: inside the trace while it is open."""
        if not self.enabled:
            return nullcontext()
        if step == self.begin and self._open is None:
            self._open = timeline.trace(self.path)
            self._open.__enter__()
        return timeline.span(f"step {step + 1}") if self._open is not None else nullcontext()

    def after_step(self, step: int) -> None:
        if self._open is not None and step + 1 >= self.end:
            self.close()

    def close(self) -> None:
        """Write the trace (every rank calls this at the same point)."""
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

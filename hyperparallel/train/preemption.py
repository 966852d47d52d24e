"""SIGTERM and Ctrl-C during training: finish the step, save a checkpoint, stop.

The first SIGTERM or SIGINT only records the request; the loop sees it after the step it is in
(every rank agrees on it in the step's exchange, `distributed.agree`, so all stop after the same
step), saves a checkpoint and returns. A second Ctrl-C stops at once, without a traceback: the
newest complete checkpoint stays as it was (saves are atomic). A repeated SIGTERM changes
nothing: schedulers and launchers often send it to every process of a job, some twice.

[Note: forwarded signals] Ranks of our launcher (`train.launch`) get the request as SIGUSR1
(for a SIGTERM) or SIGUSR2 (for a Ctrl-C), and keep SIGTERM and SIGINT fatal: torchrun's agent
stops the surviving ranks of a failure with SIGTERM, and a rank blocked in a collective with a
dead peer (NCCL may wait for its timeout) must die then, not wait to finish a step it never will.
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_CODES = {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
# what our launcher sends its ranks for the signal it got
FORWARD_AS = {"SIGTERM": signal.SIGUSR1, "SIGINT": signal.SIGUSR2}
_FORWARDED = {sig.name: name for name, sig in FORWARD_AS.items()}


class StopRequests:
    """While entered (in the main thread), SIGTERM and SIGINT (`forwarded`: SIGUSR1 and SIGUSR2
    from our launcher) ask the run to stop after its step."""

    def __init__(self, announce: bool, forwarded: bool = False):
        self.announce = announce  # rank 0 says what is happening; the others stay quiet
        self.signals = tuple(FORWARD_AS.values()) if forwarded else (signal.SIGTERM, signal.SIGINT)
        self.requested: str | None = None  # the name of the first signal (as the launcher got it)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        name = _FORWARDED.get(name, name)
        if self.requested is None:
            self.requested = name
            if self.announce:
                again = " (Ctrl-C again to stop at once)" if name == "SIGINT" else ""
                _say(f"{name}: finishing this step, then saving a checkpoint{again}\n")
        elif name == "SIGINT":
            _say("error: interrupted again: stopped at once; the newest complete checkpoint is kept\n")
            os._exit(EXIT_CODES["SIGINT"])


def _say(text: str) -> None:
    # os.write, not print: a signal handler can interrupt a print in progress
    os.write(2, text.encode())

"""`hyperparallel train --nproc N [--max-restarts K]`: N ranks on this machine through torchrun's
elastic agent (torch.distributed.elastic), with one line for a failure instead of its report.

- The run directory is resolved here, once, before any rank starts: every rank and every
  restart gets the same one (`--set logging.run_dir=...`), and a restart resumes from its newest
  complete checkpoint (`train.loop`).
- A rank that dies ends the run (or, with restarts left, restarts every rank) as soon as the
  agent sees it; the ranks' collectives time out after `training.timeout_s`, so a stuck rank ends
  it too. One line names the rank that failed first and why (`elastic.root_cause`).
- SIGTERM or Ctrl-C here is passed on to the ranks once (as SIGUSR1 / SIGUSR2: see
  `preemption`): they finish the step, save a checkpoint and stop. A second Ctrl-C kills them
  at once.

The agent runs in a thread of this process, so that the signals are ours to handle (the agent
only installs its own handlers in the main thread), and the ranks run in sessions of their own,
so a terminal's Ctrl-C reaches them only through us. For several machines, run torchrun itself
on each (README); the ranks then behave the same, and torchrun reports failures its own way.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from pathlib import Path

from hyperparallel.errors import ConfigError, error_lines
from hyperparallel.train import elastic
from hyperparallel.train.checkpointing import complete_checkpoints
from hyperparallel.train.preemption import EXIT_CODES, FORWARD_AS


def check_nproc(nproc: int, max_restarts: int) -> None:
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {max_restarts}")
    import torch

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} visible GPU(s), one per rank; "
                          f"use --nproc {torch.cuda.device_count()} or fewer (or set CUDA_VISIBLE_DEVICES)")


def _children() -> set[int]:
    """This process's child processes (the ranks the agent started), from /proc."""
    me, pids = os.getpid(), set()
    tasks = list(Path(f"/proc/{me}/task").glob("*/children"))
    for task in tasks:
        try:
            pids.update(int(pid) for pid in task.read_text().split())
        except OSError:
            continue
    if tasks:
        return pids
    for stat in Path("/proc").glob("[0-9]*/stat"):  # kernels without the children files
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                pids.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _quiet_agent() -> None:
    # the agent's warnings and its failure report: replaced by our one line
    agent_logs = logging.getLogger("torch.distributed.elastic")
    agent_logs.addHandler(logging.NullHandler())
    agent_logs.propagate = False


class _Signals:
    """The launcher's SIGTERM / SIGINT: the first is passed on to the ranks (as SIGUSR1 / SIGUSR2,
    `preemption.FORWARD_AS`), a second Ctrl-C kills them."""

    def __init__(self):
        self.received: str | None = None
        self.forwarded_to: set[int] = set()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            again = " (Ctrl-C again to stop at once)" if name == "SIGINT" else ""
            os.write(2, f"{name}: the ranks finish this step, save a checkpoint and stop{again}\n".encode())
            self.forwarded_to = _children()
            for pid in self.forwarded_to:
                _send(pid, FORWARD_AS[name], group=False)
        elif name == "SIGINT":
            kill_ranks()
            os.write(2, b"error: interrupted again: stopped at once; the newest complete checkpoint is kept\n")
            os._exit(EXIT_CODES["SIGINT"])


def kill_ranks() -> None:
    for pid in _children():
        _send(pid, signal.SIGKILL, group=True)


def _send(pid: int, signum: int, group: bool) -> None:
    try:
        os.killpg(pid, signum) if group else os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _drain(agent: threading.Thread) -> None:
    """Kill the ranks until the agent gives up restarting them: none may outlive the launcher."""
    while agent.is_alive():
        kill_ranks()
        agent.join(0.1)


def _report(failures: dict, max_restarts: int, checkpoint_root: Path, log_dir: Path, stopping: str | None) -> int:
    """One line for a run that failed (or, `stopping`, was told to stop and could not save): the
    rank that failed first, and where to continue from."""
    rank, failure = elastic.root_cause(failures)
    line, user_error = elastic.describe(rank, failure)
    if elastic.traceback_of(failure) is None:  # nothing there the line points to
        shutil.rmtree(log_dir, ignore_errors=True)
    if user_error:
        print(error_lines(line), file=sys.stderr)
        return 2
    newest = complete_checkpoints(checkpoint_root)
    hint = (f"; newest complete checkpoint: {newest[-1]} (continue with --set checkpoint.resume=latest)" if newest
            else "; no checkpoint was complete")
    if stopping and elastic.kind_of(failure) is None:  # ranks we stopped, or that died starting up
        print(f"error: stopped by {stopping} before the ranks saved a checkpoint{hint}", file=sys.stderr)
        return EXIT_CODES[stopping]
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    print(f"error: {line}; the run stopped{restarts}{hint}", file=sys.stderr)
    return 1


def launch(config: str | None, overrides: list[str], *, nproc: int, max_restarts: int, run_dir: Path,
           checkpoint_root: Path) -> int:
    """Run the ranks; the exit status of the whole run. (Made for the command line: it sets what
    the agent and the ranks read in this process's environment, and its signal handlers.)"""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_nproc(nproc, max_restarts)
    _quiet_agent()
    args = ["-m", "hyperparallel", "train"] + ([config] if config is not None else [])
    for item in [*overrides, f"logging.run_dir={json.dumps(str(run_dir))}"]:  # JSON: a YAML string, quoted
        args += ["--set", item]
    log_dir = Path(tempfile.mkdtemp(prefix="hyperparallel-ranks-"))
    result_file = log_dir / "result.json"
    os.environ.update({
        elastic.LAUNCHED: "1", elastic.RESULT: str(result_file),
        # restarted ranks must not share the agent's store with the attempt before (they can read
        # its addresses and hang); each attempt's rank 0 then hosts a fresh one
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    })
    if "OMP_NUM_THREADS" not in os.environ:  # the cores, shared out (torchrun would give each rank 1)
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
        rdzv_endpoint="localhost:0", max_restarts=max_restarts, monitor_interval=0.1,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    outcome: dict = {}

    def run_agent() -> None:
        try:
            elastic_launch(launch_config, sys.executable)(*args)
        except ChildFailedError as failed:
            outcome["failures"] = failed.failures
        except BaseException as error:  # the agent itself (rendezvous, a port): reported below
            outcome["error"] = error

    signals = _Signals()
    signals.install()
    agent = threading.Thread(target=run_agent, name="elastic-agent", daemon=True)
    agent.start()
    while agent.is_alive():
        agent.join(0.2)
        if signals.received and _children() - signals.forwarded_to:
            # stopping, yet ranks that were not asked to: started before the signal reached any,
            # or restarted after one failed while stopping. Not now.
            _drain(agent)
        mistake = elastic.user_error_in(log_dir)
        if mistake is not None:  # a restart would meet it again: stop here
            _drain(agent)
            shutil.rmtree(log_dir, ignore_errors=True)
            print(error_lines(mistake), file=sys.stderr)
            return 2
    result = elastic.read_json(result_file) or {}
    if "error" in outcome:
        print(f"error: the launcher failed: {elastic.one_line(outcome['error'])}", file=sys.stderr)
        return 1
    if result.get("stopped_by"):  # stopped and saved; rank 0 has said where
        shutil.rmtree(log_dir, ignore_errors=True)
        return EXIT_CODES.get(result["stopped_by"], 1)
    if "failures" in outcome:
        return _report(outcome["failures"], max_restarts, checkpoint_root, log_dir, signals.received)
    shutil.rmtree(log_dir, ignore_errors=True)  # (kept after a failure: the ranks' tracebacks are there)
    return EXIT_CODES[signals.received] if signals.received else 0

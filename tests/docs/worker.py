"""One Python process that runs the docs' commands and snippets, one request at a time.

Started once per test session by tests/docs/runner.py (`python tests/docs/worker.py`), so torch,
transformers and the package are imported once rather than once per documented command (that
alone would be most of the time of tests/docs). Requests come as JSON lines on stdin; each result
goes back as one JSON line on the process's original stdout, while the request's own output
(stdout and stderr, at the file-descriptor level: native code, child processes) goes to files:

    {"kind": "cli", "argv": [...], "cwd": ..., "env": {...}, "out": PATH, "err": PATH}
        `hyperparallel ARGV` (hyperparallel.cli.main); with "launch": false, `train --nproc N`
        stops where the ranks would start (everything before them runs: the config, the layout
        against N ranks, the run directory, preflight) and prints one line saying so
    {"kind": "script", "path": ..., "argv": [...], ...}   `python PATH ARGV` (runpy.run_path)
    {"kind": "module", "module": ..., "argv": [...], ...} `python -m MODULE ARGV`
    {"kind": "snippet", "path": ..., ...}                  a docs page's Python snippet, as a script
    -> {"rc": int, "seconds": float, "reused": bool}

A `train` request whose resolved config, launch and working directory equal an earlier successful
one's is answered with that one's result (`reused`): the docs repeat `hyperparallel train` with
overrides that the test's sizes replace. So is a `plan` request with the arguments of an earlier one. Everything a request changes in this process (environment,
working directory, sys.argv, torch's thread count, signal handlers, a default process group) is put
back after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback


def _run(request: dict, cache: dict) -> tuple[int, bool, str | None]:
    """(exit status, answered from the cache, the cache key to keep this result under)."""
    kind = request["kind"]
    if kind == "cli":
        from hyperparallel import cli
        from hyperparallel.train import launch

        argv = request["argv"]
        key = {"train": _train_key, "plan": _key}.get(argv[0] if argv else "", lambda *_: None)(argv, request)
        if key is not None and key in cache:
            out, err, rc = cache[key]
            print(out, end="")
            print(err, end="", file=sys.stderr)
            return rc, True, None

        def no_launch(config_path, overrides, *, nproc, **kwargs):
            print(f"(tests/docs: {nproc} ranks not started; everything before their start was run)")
            return 0

        real = launch.launch
        if not request.get("launch", True):
            launch.launch = no_launch
        try:
            rc = cli.main(argv)
        finally:
            launch.launch = real
        return rc, False, key if rc == 0 else None
    sys.argv = [request.get("path") or request.get("module"), *request.get("argv", [])]
    if kind == "module":
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:  # script, snippet
        sys.path.insert(0, os.path.dirname(os.path.abspath(request["path"])))
        runpy.run_path(request["path"], run_name="__main__")
    return 0, False, None


def _key(argv: list[str], request: dict) -> str:
    return json.dumps([argv, request["cwd"], request.get("env", {})])


def _train_key(argv: list[str], request: dict) -> str | None:
    """What decides a `train` command's run: the resolved config, the launch and the place."""
    from hyperparallel import cli
    from hyperparallel.train.config import dump, load_config

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = cli.build_parser().parse_args(argv)
            config = load_config(args.config, args.set)
    except BaseException:  # (the command itself reports it)
        return None
    return json.dumps([dump(config), args.nproc, args.max_restarts, args.print_config, request["cwd"],
                       request.get("env", {}), request.get("launch", True)])


def serve() -> None:
    results = os.fdopen(os.dup(1), "w")
    saved_fds = os.dup(1), os.dup(2)
    cache: dict = {}
    # before the first request, the imports every request needs
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401

    import hyperparallel.cli  # noqa: F401
    import hyperparallel.train.loop  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        env, cwd, argv, path = dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path)
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
        threads = torch.get_num_threads()
        os.environ.update(request.get("env", {}))
        os.chdir(request["cwd"])
        started = time.perf_counter()
        with open(request["out"], "w") as out, open(request["err"], "w") as err:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            key = None
            try:
                rc, reused, key = _run(request, cache)
            except SystemExit as exit_:
                code = exit_.code
                rc, reused = (code if isinstance(code, int) else int(code is not None)), False
                if code is not None and not isinstance(code, int):
                    print(code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                rc, reused = 1, False
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
        if key is not None:
            with open(request["out"]) as out, open(request["err"]) as err:
                cache[key] = (out.read(), err.read(), rc)
        seconds = time.perf_counter() - started
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv[:], sys.path[:] = argv, path
        results.write(json.dumps({"rc": rc, "seconds": seconds, "reused": reused}) + "\n")
        results.flush()


if __name__ == "__main__":
    serve()

"""The `hyperparallel` command: thin argument parsing that calls into the package.

Errors a user can cause print ``error: ...`` on stderr and exit with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from pathlib import Path

from hyperparallel import __version__
from hyperparallel.errors import HyperparallelError, error_lines
from hyperparallel.train import examples

DOCS = "docs/train.md"
CONFIG_HELP = "the YAML config, or an example config's name (none: the embedded default)"
# (the kernels benchmark is not kernels.py: run as a script, a file of that name in benchmarks/
# would be the `kernels` module transformers probes for, in every benchmark run from there)
BENCHMARKS = {"mx": "mx_ops.py", "train": "train.py", "lowp": "lowp.py", "fsdp": "fsdp.py", "checkpoint": "checkpoint.py",
              "fusion": "fusion.py", "moe": "moe.py", "parallel": "parallel.py", "kernels": "fused_kernels.py",
              "data": "data.py", "pipeline": "pipeline.py"}


def _benchmark_path(name: str) -> Path:
    # benchmarks/ lives next to the package in a source checkout (editable install)
    return Path(__file__).resolve().parent.parent / "benchmarks" / BENCHMARKS[name]


def _bench(args: argparse.Namespace) -> int:
    path = _benchmark_path(args.name)
    if not path.is_file():
        raise HyperparallelError(f"benchmark script {path} not found; benchmarks run from a source checkout")
    sys.argv = [str(path), *args.rest]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def _train(args: argparse.Namespace) -> int:
    from hyperparallel.train import elastic

    if elastic.launched_by_hyperparallel():
        # until training starts (and handles it), a Ctrl-C passed on by the launcher ends this
        # rank quietly instead of with a KeyboardInterrupt traceback from whatever it imports
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from hyperparallel.train.config import load_config

    notes: list[str] = []
    config = load_config(args.config, args.set, notes)  # bad input stops here, before any rank starts
    if not elastic.launched_by_hyperparallel() and os.environ.get("RANK", "0") == "0":  # (once, not per rank)
        for line in notes:
            print(f"note: {line}", file=sys.stderr if args.print_config else sys.stdout)
    if args.print_config:
        from hyperparallel.train.config import dump

        print(dump(config), end="")
        return 0
    if args.nproc != 1 or args.max_restarts:
        from hyperparallel.train import preflight, run_dir
        from hyperparallel.train.launch import check_nproc, launch

        check_nproc(args.nproc, args.max_restarts)
        resolved = run_dir.resolve(config)  # once: every rank and restart gets this one
        preflight.check(config, args.nproc, resolved)  # every problem, before any rank starts
        return launch(args.config, args.set, nproc=args.nproc, max_restarts=args.max_restarts, run_dir=resolved,
                      checkpoint_root=run_dir.checkpoint_root(resolved, config.checkpoint.dir))
    if not elastic.launched_by_hyperparallel():
        return _train_here(config)
    try:  # a rank of our launcher: it prints one line for the whole run, from what we record
        return _train_here(config)
    except SystemExit:
        raise
    except BaseException as error:
        from hyperparallel.train import roll_call

        elastic.record_failure(error)  # (first: the agent may stop this rank during the roll call)
        if elastic.waited_for_a_rank(error) and (absent := roll_call.missing()) is not None:
            elastic.record_failure(error, absent)
        return 2 if isinstance(error, HyperparallelError) else 1


def _train_here(config) -> int:
    from hyperparallel.train.loop import train
    from hyperparallel.train.planning import memory_summary, runtime_bytes
    from hyperparallel.train.preemption import EXIT_CODES

    runtime = runtime_bytes(config.training.compile)  # (before the data and the model exist)
    summary = train(config)
    if summary["stopped_by"] is not None:
        # a rank of torchrun's agent exits 0, or the agent would restart the run it was told to stop
        # (our launcher then exits with the signal's status); one process exits with it itself
        return 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_CODES.get(summary["stopped_by"], 1)
    if summary["last_loss"] is not None and os.environ.get("RANK", "0") == "0":  # once, not per rank
        run_dir = Path(summary["run_dir"])
        contents = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()))
        weights = [r["weights_from"] for r in summary["records"] if r.get("weights_from", "").startswith("model.path")]
        tuned = f" from {weights[0]}" if weights else ""
        print(f"done: {summary['steps']} steps{tuned}, {_losses(summary)}; "
              f"{memory_summary(config, int(os.environ.get('WORLD_SIZE', '1')), runtime, summary['records'])}\n"
              f"run dir {run_dir}: {contents}")
    return 0


def _losses(summary: dict) -> str:
    """The first step's loss, the last logged one (a mean over its window, as logged), and the
    last validation loss."""
    logged = [r for r in summary["records"] if "loss" in r]
    evaluated = [r for r in summary["records"] if "val_loss" in r]
    last = logged[-1] if logged else {"loss": summary["last_loss"], "window": 1}
    window = f" (the mean of the last {last['window']} steps)" if last["window"] > 1 else ""
    text = f"loss {summary['first_loss']:.4f} -> {last['loss']:.4f}{window}"
    return text + (f", validation loss {evaluated[-1]['val_loss']:.4f}" if evaluated else "")


def _export(args: argparse.Namespace) -> int:
    from hyperparallel.checkpoint.export import export_hf
    from hyperparallel.checkpoint.io import checkpoint_in

    source = checkpoint_in(args.checkpoint)  # (once: a run may save a newer one meanwhile)
    out = export_hf(source, args.out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size)
    print(f"exported {source} to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from hyperparallel.train.generate import generate

    result = generate(args.source, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed)
    print(result.text)
    print(f"{len(result.token_ids)} new tokens in {result.seconds:.2f} s ({result.tokens_per_s:,.1f} tokens/s), "
          f"stopped by {result.stop_reason.replace('_', ' ')}", file=sys.stderr)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hyperparallel.train.plot import plot_run

    print(plot_run(args.run_dir))
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from hyperparallel.errors import ConfigError
    from hyperparallel.train.config import load_config
    from hyperparallel.train.planning import format_plan, plan

    config = load_config(args.config, args.set)
    for flag in ("nproc", "nnodes", "gpus_per_node", "top"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    per_node = args.gpus_per_node
    if args.nnodes and args.nproc:
        if per_node is None and args.nproc % args.nnodes:
            raise ConfigError(f"--nproc {args.nproc} does not divide over --nnodes {args.nnodes}")
        per_node = per_node or args.nproc // args.nnodes
        if args.nnodes * per_node != args.nproc:
            raise ConfigError(f"--nproc {args.nproc} is not --nnodes {args.nnodes} x --gpus-per-node {per_node}")
    nproc = args.nproc or (args.nnodes or 1) * (per_node or (8 if args.nnodes else 1))
    if args.search and args.device is None:
        raise ConfigError("--search ranks layouts by predicted speed: give --device (cpu, h100, h200 or b200)")
    if args.top is not None and not args.search:
        raise ConfigError("--top is how many layouts --search prints: give --search too")
    model = None
    if args.device is not None:
        from hyperparallel.train.planning.device_model import device_model

        model = device_model(args.device, per_node if args.device != "cpu" else min(nproc, per_node or nproc),
                             config.device_model)
    if args.search:
        from hyperparallel.train.planning import format_search, search

        found = search(config, nproc, model, top=args.top or 5)
        print(json.dumps([c.to_json() for c in found]) if args.json else format_search(found, config, nproc, model))
        return 0
    result = plan(config, nproc, device_model=model)
    print(json.dumps(result.to_json()) if args.json else format_plan(result))
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from hyperparallel.errors import ConfigError
    from hyperparallel.train import data, preflight
    from hyperparallel.train.config import load_config

    config = load_config(args.config, args.set)
    cache = data.cache_root(config.data, config.logging.run_dir)
    problems = data.input_problems(config.data) + preflight.data_problems(config)
    unwritable = preflight.unwritable(cache)
    if unwritable:
        problems.append(f"data.cache_dir: {unwritable}")
    if problems:
        raise ConfigError("\n".join(problems))
    mask, no_mask_reason = preflight.document_mask(config)
    dataset = data.prepare(config.data, model_path=config.model.path, cache=cache, document_mask=mask, progress=True)
    held = "" if dataset.validation is None else f", {len(dataset.validation):,} held out"
    print(f"{dataset.num_tokens:,} tokens, {len(dataset.train):,} sequences of {config.data.seq_len}{held}")
    print(data.describe(dataset, config.data, no_mask_reason))
    return 0


class _WithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that states an option's default, where it has one worth stating."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def _config_arguments(command: argparse.ArgumentParser, example: str) -> None:
    """The config a command reads: a YAML file or an example config's name, and `--set` overrides
    (`example`: one for the help)."""
    command.add_argument("config", nargs="?", help=CONFIG_HELP)
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help=f"override a config key, e.g. --set {example} (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyperparallel",
        description="Low-precision (MXFP8) large-model training for PyTorch.",
        epilog=f"The config reference, with every key and its default: {DOCS}",
    )
    parser.add_argument("--version", action="version", version=f"hyperparallel {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser("train", help="train a model from a YAML config (default: the embedded default.yaml)",
                                formatter_class=_WithDefaults,
                                epilog=f"Every config key, its default and what it does: {DOCS}; `hyperparallel "
                                       f"train --print-config` prints them all, resolved. The example configs, by name "
                                       f"(`hyperparallel train qwen3_moe`): {', '.join(examples.names())}.")
    _config_arguments(train, "training.steps=20")
    train.add_argument("--nproc", type=int, default=1,
                       help="ranks to launch on this machine, through torchrun's elastic agent (1: in this process)")
    train.add_argument("--max-restarts", type=int, default=0, metavar="K",
                       help="after a rank fails, start every rank again up to K times, resuming from the newest "
                            "checkpoint")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config (the file, its defaults and the --set overrides) and exit")
    train.set_defaults(func=_train)
    export = commands.add_parser("export", help="write a training checkpoint as a Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint of `hyperparallel train` (RUN_DIR/checkpoints/step_N), or a "
                                           "run directory for its newest one (runs/latest: the newest run)")
    export.add_argument("out_dir", help="the directory to create (config.json, safetensors, the run's tokenizer.json)")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the weights' dtype (default: the dtype the model was trained in)")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="the most bytes of tensors in one safetensors file, as save_pretrained's max_shard_size: "
                             "a number of bytes or one with a unit (200MB, 5GB; default: 5GB)")
    export.set_defaults(func=_export)
    generate = commands.add_parser("generate", help="continue a prompt with a trained model (checkpoint or export)")
    generate.add_argument("source", metavar="CHECKPOINT_OR_HF_DIR",
                          help="a checkpoint of `hyperparallel train` (RUN_DIR/checkpoints/step_N, with the run's "
                               "tokenizer.json; a run directory for its newest one, runs/latest for the newest run) "
                               "or a Hugging Face directory with a tokenizer.json (`hyperparallel export`)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                          help="stop after N new tokens, or earlier at the end-of-text token (default: 64)")
    generate.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0: greedy; otherwise sample from softmax(logits / T) (default: 0, greedy)")
    generate.add_argument("--top-k", type=int, default=None, metavar="K",
                          help="sample among the K most likely tokens, with T > 0 (default: the whole vocabulary)")
    generate.add_argument("--seed", type=int, default=0, metavar="S",
                          help="the sampling generator's seed (default: 0)")
    generate.set_defaults(func=_generate)
    plot = commands.add_parser("plot", help="draw RUN_DIR/loss.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)
    plan = commands.add_parser("plan", help="the memory and communication plan of a training run, per rank, "
                                             "without allocating the model")
    _config_arguments(plan, "training.micro_batch=8")
    plan.add_argument("--nproc", type=int, default=None,
                      help="the ranks the run would have (default: --nnodes x --gpus-per-node, else 1); nothing is "
                           "launched")
    plan.add_argument("--nnodes", type=int, default=None, help="machines (the link model: groups that span them use "
                                                               "the inter-node links)")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="ranks per machine (default: 8 for a GPU)")
    plan.add_argument("--device", choices=("cpu", "h100", "h200", "b200"), default=None,
                      help="predict the step time on this device's model (cpu: this machine, measured now); "
                           "docs/train.md, \"Planning\"")
    plan.add_argument("--search", action="store_true",
                      help="rank the layouts that fit by predicted tokens/s and print the best as --set lines")
    plan.add_argument("--top", type=int, default=None, help="how many layouts --search prints (default: 5)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan.set_defaults(func=_plan)
    prepare = commands.add_parser("prepare", help="tokenize a config's data into token shards ahead of training "
                                                   "(on a cluster: once, on storage every node sees)")
    _config_arguments(prepare, "data.workers=16")
    prepare.set_defaults(func=_prepare)
    bench = commands.add_parser("bench", help="run a benchmark and print its side-by-side table")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark (see its --help)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hyperparallel.train.quiet import quiet_optional_imports

    quiet_optional_imports()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except HyperparallelError as error:
        print(error_lines(str(error)), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before training handles it (reading the config, say)
        print("error: interrupted", file=sys.stderr)
        return 130

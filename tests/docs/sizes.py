"""How tests/docs runs a documented command at a small size: each table says what it changes.

A command keeps everything the page gives it; the tables add options after its own (the last
`--set` of a key, the last use of an option, wins), except `TRAIN_DEFAULTS`, put before its own
so that a command choosing those keys keeps its choice.
"""

from __future__ import annotations

# What a page's placeholders stand for. Text, regex -> replacement; `{run_dir}` is the newest run
# of the page's working directory with a checkpoint (made by the default training when there is
# none yet), `{step}` its newest checkpoint, `{tmp}` the session's temporary directory.
PLACEHOLDERS = [
    (r"\bmy\.yaml\b", "configs/default.yaml"),  # "your config"
    (r"\bRUN_DIR\b|\bruns/\d{8}-\d{6}\b", "{run_dir}"),  # the run a reader has made
    (r"\bstep_N\b|\bstep_\d{8}\b", "{step}"),
    (r"(?<![\w./-])/tmp/", "{tmp}/"),  # (never the machine's /tmp)
]

# Paths a command reads that an earlier block of its page makes; run first when missing, so that
# a block runs alone too (pytest -k).
PREREQUISITES = {"my-model": "hyperparallel export {run_dir}/checkpoints/{step} my-model"}

# `hyperparallel train` / `prepare`: one optimizer step of short sequences from a small piece of
# the corpus, the validation loss over one global batch, a log line every step.
TRAIN_DEFAULTS = ["training.compile=none"]  # compiling costs seconds (Inductor: 20 s cold)
TRAIN_SIZES = ["training.steps=1", "data.seq_len=32", "data.max_corpus_bytes=100000", "training.eval_batches=1",
               "logging.every=1"]
RESUME_SIZES = ["training.steps=2"]  # with checkpoint.resume=latest: one step more than the run continued
PREPARE_SIZES = ["data.seq_len=32", "data.max_corpus_bytes=100000", "data.workers=2"]

# `hyperparallel plan CONFIG`: by config (others: as written). The published plans' models, with
# their layouts: fewer layers, shorter sequences.
PLAN_SIZES = {
    "configs/plans/qwen3_30b_a3b.yaml": ["model.config.num_hidden_layers=2", "data.seq_len=256"],
    "configs/plans/deepseek_v3_671b.yaml": ["model.config.num_hidden_layers=4", "model.config.n_routed_experts=64",
                                            "data.seq_len=256"],
}

GENERATE_SIZES = ["--max-new-tokens", "4"]

# A benchmark's options for a small run, by script (`hyperparallel bench NAME` runs
# benchmarks/cli.BENCHMARKS[NAME]). A script missing here cannot be run by tests/docs: add it, or
# mark its command not run on the page.
BENCH_SIZES = {
    "mx_ops.py": ["--m", "256", "--k", "256", "--n", "256", "--repeat", "1"],
    "lowp.py": ["--tokens", "64", "--hidden", "64", "--intermediate", "256", "--linear-tokens", "64",
                "--linear-width", "64", "--linear-layers", "1", "--repeat", "1"],
    "mx_gpu.py": [],  # the page runs it with --small
}

# A Python snippet's sizes, by (page, a line it contains): whole numbers replaced (a bf16 product
# of docs/mx.md's 8192 x 4096 x 1024 is slow on a CPU without bf16 dot products).
SNIPPET_SIZES = {
    ("docs/mx.md", "mx.mx_grouped_mm("): {"8192": "256", "4096": "128", "1000": "32", "5000": "160"},
}

# The environment a snippet runs in: one rank as torchrun starts it (`dist.init_process_group()`
# finds its rank, world and store there).
SNIPPET_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1"}

# Lines of shown output that a run at the sizes above does not print (regex -> why): not compared.
NOT_AT_THIS_SIZE = {r"^compiling the decoder layers": "training.compile=none (TRAIN_DEFAULTS)"}

# Commands whose shown output is mostly free text: only its first and last lines are compared.
FREE_TEXT = {"generate": "the continuation is sampled text; the prompt's line and the summary line are compared"}

"""What the trainer does with one architecture at a tiny size: the cells of docs/models.md.

For a text decoder-only model_type of transformers (models/catalog.py), at the size of
`models.tiny.tiny_config_values`: train it `STEPS` steps in one process (the reference), in
MXFP8, and over two ranks in each layout that applies (FSDP dp_shard=2; EP ep=2 for a MoE model;
TP tp=2; CP cp=2), each compared with the reference's losses; then export the one-process run's
checkpoint and load it with `AutoModelForCausalLM.from_pretrained`, which must give transformers'
own class and keys. A layout the trainer refuses (preflight, one line) is a cell with its
reason; one that runs but differs is a failure.

scripts/model_coverage.py sweeps every type and writes docs/models.md; tests/models/
test_coverage.py runs a representative subset in the test suite. Both call `reference` in one
process and `on_ranks` in each rank of a two-rank world.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

STEPS = 2
TOLERANCE = 1e-5  # relative, per step's loss (fp32)
# the two-rank layouts: the trainer's parallel section
LAYOUTS: dict[str, dict] = {"fsdp": {"dp_shard": 2}, "ep": {"dp_shard": 2, "ep": 2}, "tp": {"tp": 2}, "cp": {"cp": 2}}
VOCAB = 512


@dataclass
class Cell:
    """One layout's outcome: losses per step, or why it did not run."""

    losses: list[float] | None = None
    refused: str | None = None  # the trainer's own one-line refusal (a user's mistake to fix, or a limit)
    failed: str | None = None  # anything else: a bug, or a model the trainer cannot yet run
    note: str = ""

    @property
    def ran(self) -> bool:
        return self.losses is not None

    def to_json(self) -> dict:
        return asdict(self)


def corpus(directory: Path) -> Path:
    """The cases' text (Python's own `inspect` and `argparse` sources), written once into `directory`."""
    import argparse
    import inspect

    path = directory / "corpus.txt"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        text = inspect.getsource(inspect) + inspect.getsource(argparse)
        partial = path.with_name(f"corpus.{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)  # (every rank may write it: the same text, each whole)
    return path


def raw_config(model_type: str, run_dir: Path, parallel: dict | None = None, *, low_precision: bool = False,
               aux_loss: bool = True) -> dict:
    """The trainer's config of a coverage case (a mapping, as a YAML file would give it); its text
    is `corpus` beside the type's directory (run_dir's grandparent). `aux_loss` False: a MoE
    model's load-balancing loss times 0 (see `aux_loss_in`)."""
    from hyperparallel.models.tiny import tiny_config_values

    raw = {
        "model": {"family": model_type, "config": tiny_config_values(model_type, VOCAB)},
        "data": {"source": "files", "files": [str(corpus(run_dir.parent.parent))], "vocab_size": VOCAB,
                 "seq_len": 32, "validation": None},
        "training": {"steps": STEPS, "global_batch": 4, "micro_batch": 2, "compile": "none", "eval_every": 0,
                     "timeout_s": 120},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"warmup_steps": 0},
        "checkpoint": {"every": 0},
        "moe": {} if aux_loss else {"aux_loss_coef": 0.0},  # (0: still computed and added, x 0)
        "logging": {"run_dir": str(run_dir), "every": 1, "progress": False, "peak_tflops": 1.0},
        "parallel": dict(parallel or {}),
    }
    if low_precision:
        raw["low_precision"] = {"enabled": True}
    return raw


def aux_loss_in(layout: str) -> bool:
    """Whether a layout's cell trains with the MoE load-balancing loss: a rank computes it over its
    own tokens, as one process does per micro-batch, except under CP, where each rank holds half
    of every sequence (it then differs from one process's by design: CP's cells and the
    reference they are held to, "train_no_aux", train with it times 0)."""
    return layout != "cp"


def reference_of(cells: dict, layout: str):
    """The one-process cell a layout's losses are held to (`aux_loss_in`)."""
    return cells.get("train" if aux_loss_in(layout) else "train_no_aux", cells.get("train"))


def run_case(model_type: str, run_dir: Path, parallel: dict | None = None, *, low_precision: bool = False,
             aux_loss: bool = True) -> Cell:
    """Train one case (in this process's world: one process, or every rank of a two-rank one).
    A refusal must come before the run writes anything (the trainer's preflight): one that comes
    later is a failure."""
    from hyperparallel.errors import HyperparallelError
    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.loop import train

    losses: list[float] = []

    def on_step(step: int, record: dict | None) -> None:
        if record is not None and "loss" in record:
            losses.append(float(record["loss"]))

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            train(from_mapping(raw_config(model_type, run_dir, parallel, low_precision=low_precision,
                                          aux_loss=aux_loss)), on_step=on_step)
    except HyperparallelError as error:
        if run_dir.exists():
            return Cell(failed=f"refused after the run began ({type(error).__name__}): {_first_line(error)}",
                        note=traceback.format_exc(limit=-3))
        return Cell(refused=str(error))
    except Exception as error:  # noqa: BLE001 (whatever an architecture raises is its cell's content)
        return Cell(failed=f"{type(error).__name__}: {_first_line(error)}", note=traceback.format_exc(limit=-3))
    # (MXFP8: the conversion's summary, "MXFP8: N modules converted, M skipped")
    summary = next((line.strip() for line in printed.getvalue().splitlines() if line.strip().startswith("MXFP8:")), "")
    return Cell(losses=losses, note=summary)


def compare(cell: Cell, reference: Cell, model_type: str = "") -> Cell:
    """A layout's cell against the one-process losses: a failure where they are not finite, or
    differ by more than TOLERANCE."""
    if not cell.ran:
        return cell
    if not reference.ran:
        return Cell(losses=cell.losses, failed="its one-process reference did not run")
    if len(cell.losses) != len(reference.losses):
        return Cell(losses=cell.losses, failed=f"{len(cell.losses)} steps' losses, one process has "
                                                f"{len(reference.losses)}")
    if not all(math.isfinite(x) for x in cell.losses + reference.losses):
        return Cell(losses=cell.losses, failed="losses are not finite")
    worst = max((abs(a - b) / abs(b) for a, b in zip(cell.losses, reference.losses, strict=True)), default=0.0)
    if worst > TOLERANCE:
        from hyperparallel.models import get_family

        why = get_family(model_type).random_in_training if model_type else None
        return Cell(losses=cell.losses, failed=f"losses differ from one process by {worst:.1e} (relative)"
                                                + (f": {why}" if why else ""))
    cell.note = f"{worst:.1e}"
    return cell


def export_cell(model_type: str, run_dir: Path, out_dir: Path) -> Cell:
    """The one-process run's checkpoint exported, then loaded by AutoModelForCausalLM.from_pretrained:
    transformers' own class and keys (those of the model it builds from the config), and the
    checkpoint's values, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from hyperparallel.checkpoint.export import export_hf, model_from_checkpoint
    from hyperparallel.checkpoint.io import complete_checkpoints
    from hyperparallel.errors import HyperparallelError
    from hyperparallel.models import get_family
    from hyperparallel.train.quiet import progress_bars_off

    restore = progress_bars_off()  # (from_pretrained's)
    try:
        checkpoint = complete_checkpoints(run_dir / "checkpoints")[-1]
        with contextlib.redirect_stdout(io.StringIO()):
            export_hf(checkpoint, out_dir)
        loaded = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, use_safetensors=True)
        family = get_family(model_type)
        with torch.device("meta"):
            own = family.model_class._from_config(loaded.config)
    except HyperparallelError as error:
        return Cell(refused=_first_line(error))
    except Exception as error:  # noqa: BLE001
        return Cell(failed=f"{type(error).__name__}: {_first_line(error)}", note=traceback.format_exc(limit=-3))
    finally:
        restore()
    if type(loaded) is not family.model_class:
        return Cell(failed=f"from_pretrained gave {type(loaded).__name__}, not {family.model_class.__name__}")
    if list(loaded.state_dict()) != list(own.state_dict()):
        missing = sorted(set(own.state_dict()) ^ set(loaded.state_dict()))
        return Cell(failed=f"from_pretrained's keys differ from transformers' own model's: {missing[:3]}")
    trained, _ = model_from_checkpoint(checkpoint)  # (the checkpoint's values, whole in this process)
    got = loaded.state_dict()
    differ = [key for key, value in trained.state_dict().items() if not torch.equal(got[key], value)]
    if differ:
        return Cell(failed=f"from_pretrained's values differ from the checkpoint's: {differ[:3]}")
    return Cell(losses=[], note=type(loaded).__name__)


def applicable(model_type: str) -> dict[str, str | None]:
    """Per two-rank layout: None where it applies, else why not (no experts for EP)."""
    from hyperparallel.moe import GroupedExperts

    moe = any(isinstance(m, GroupedExperts) for m in _tiny_meta(model_type).modules())
    return {layout: (None if layout != "ep" or moe else "no routed experts") for layout in LAYOUTS}


def too_large(model_type: str) -> str | None:
    """Why `model_type`'s tiny config is not tiny (more than MAX_PARAMS parameters: its config
    nests sizes the table does not reach), or None."""
    count = sum(p.numel() for p in _tiny_meta(model_type).parameters())
    return f"its tiny config has {count / 1e6:.0f}M parameters" if count > MAX_PARAMS else None


@functools.cache
def _tiny_meta(model_type: str):
    """The model of `model_type`'s tiny config as the trainer builds it, on the meta device."""
    from hyperparallel.models import build_model
    from hyperparallel.models.tiny import tiny_config_values

    return build_model(model_type, config=tiny_config_values(model_type, VOCAB), materialize=False)


MAX_PARAMS = 20_000_000


def reference(model_type: str, root: Path) -> dict[str, dict]:
    """One process: the reference run, MXFP8, the export; cells as JSON."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        large = too_large(model_type)
    except Exception:  # noqa: BLE001 (the run below meets it again, and says so)
        large = None
    if large is not None:
        return {name: Cell(failed=large).to_json() for name in ("train", "mxfp8", "export")}
    cells = {"train": run_case(model_type, root / "one")}
    try:
        moe = applicable(model_type)["ep"] is None
    except Exception:  # noqa: BLE001 (a model that cannot be built: its train cell says why)
        moe = False
    if moe:  # (CP's reference, see aux_loss_in)
        cells["train_no_aux"] = run_case(model_type, root / "one_no_aux", aux_loss=False)
    cells["mxfp8"] = run_case(model_type, root / "mxfp8", low_precision=True)
    if cells["train"].ran:
        cells["export"] = export_cell(model_type, root / "one", root / "export")
    else:
        cells["export"] = Cell(refused="it did not train")
    return {name: cell.to_json() for name, cell in cells.items()}


def on_ranks(model_type: str, root: Path, layouts: list[str]) -> dict[str, dict]:
    """Every rank of a two-rank world: each of `layouts`, in order; cells as JSON (rank 0's)."""
    return {layout: run_case(model_type, root / layout, LAYOUTS[layout], aux_loss=aux_loss_in(layout)).to_json()
            for layout in layouts}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


def load_cells(path: Path) -> dict[str, dict]:
    """A sweep's results: model_type -> {cell name: Cell JSON}, from its JSON-lines file."""
    results: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            results.setdefault(record["model_type"], {}).update(record["cells"])
    return results


COLUMNS = (("train", "train"), ("fsdp", "FSDP dp_shard=2"), ("ep", "EP ep=2"), ("tp", "TP tp=2"), ("cp", "CP cp=2"),
           ("mxfp8", "MXFP8"), ("export", "export"))


def _cell_text(model_type: str, name: str, cell: dict | None, reference: dict | None) -> tuple[str, str]:
    """(the table's text, the outcome: "yes", "no" (a refusal or a failure), "n/a")."""
    if cell is None:
        return ("—", "n/a") if name == "ep" else ("not run", "no")
    result = Cell(**cell)
    if name in LAYOUTS and reference is not None:
        result = compare(result, Cell(**reference), model_type)
    if result.failed:
        return f"fails: {result.failed}".replace("|", "/"), "no"
    if result.refused:
        return f"refused: {result.refused}".replace("|", "/"), "no"
    if name == "mxfp8":
        converted = result.note.removeprefix("MXFP8: ").split(" modules converted")[0]
        if converted in ("", "0"):
            return "nothing to convert (no nn.Linear or experts it takes)", "no"
        fp32 = reference.get("losses") if reference else None
        apart = (f", loss {max(abs(m - f) / abs(f) for m, f in zip(result.losses, fp32, strict=True)):.0e} from fp32's"
                 if fp32 and len(fp32) == len(result.losses) else "")
        return f"yes ({converted} modules{apart})", "yes"
    if name in LAYOUTS:
        return f"yes ({result.note})", "yes"
    return "yes", "yes"


def render(results: dict[str, dict]) -> str:
    """docs/models.md from a sweep's results (model_type -> cells)."""
    import transformers

    from hyperparallel.models.catalog import causal_lm_types, left_out, text_decoder_types

    types = text_decoder_types()
    rows, counts = [], {name: 0 for name, _ in COLUMNS}
    moe = sum(1 for t in types if "ep" in results.get(t, {}))
    for model_type in types:
        cells = results.get(model_type, {})
        texts = []
        for name, _ in COLUMNS:
            text, outcome = _cell_text(model_type, name, cells.get(name), reference_of(cells, name))
            counts[name] += outcome == "yes"
            texts.append(text)
        rows.append(f"| `{model_type}` | {' | '.join(texts)} |")
    total = len(types)
    lines = [
        "# Models: what the trainer runs, per architecture",
        "",
        f"Every text decoder-only causal-LM type of transformers {transformers.__version__} ({total} of its "
        f"{len(causal_lm_types())} causal-LM types), at a tiny size (`hyperparallel/models/tiny.py`), through "
        f"`hyperparallel train`: {STEPS} steps in one process (fp32), then on two gloo ranks in each layout, whose "
        f"losses must equal the one process's within {TOLERANCE:.0e} relative (the figure in the cell is the largest "
        f"difference seen); MXFP8 (one process; the modules it converts and its largest relative loss difference "
        f"from fp32's); and the one-process checkpoint exported with `hyperparallel export` "
        f"and loaded by `AutoModelForCausalLM.from_pretrained` (transformers' own class and keys, the checkpoint's values "
        f"bit for bit). MoE models train with their load-balancing loss, except under CP: a rank computes it over its "
        f"own tokens, which there are half of every sequence, so CP's cells and the one-process run they are held to "
        f"train with `moe.aux_loss_coef: 0`. A refused cell gives the "
        f"trainer's one-line reason. Made by `python scripts/model_coverage.py --write` (its results, every cell's losses, in docs/models.jsonl) "
        f"(hyperparallel/train/coverage.py); `make test` runs a subset (tests/models/test_coverage.py).",
        "",
        "| | types | " + " | ".join(title for _, title in COLUMNS[1:]) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS[1:]) + " |",
        f"| run | {counts['train']} of {total} train | "
        + " | ".join(f"{counts[name]} of {moe if name == 'ep' else total}" for name, _ in COLUMNS[1:]) + " |",
        "",
        "| model_type | " + " | ".join(title for _, title in COLUMNS) + " |",
        "| --- | " + " | ".join("---" for _ in COLUMNS) + " |",
        *rows,
        "",
        "## Left out",
        "",
        "Causal-LM types of transformers that are not text decoder-only models (models/catalog.py decides, from "
        "transformers' own classes):",
        "",
        "| model_type | why |",
        "| --- | --- |",
        *(f"| `{t}` | {left_out(t)} |" for t in causal_lm_types() if left_out(t) is not None),
        "",
    ]
    return "\n".join(lines)

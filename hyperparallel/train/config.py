"""The training configuration: YAML validated into typed sections.

Every section rejects keys it does not know, so a typo is an error, not a silent default, and
every mistake of a config is reported together (one line each, with "did you mean" for unknown
keys). The `--set a.b=v` overrides of the command line are applied to the raw mapping before
validation, with their values parsed as YAML scalars (``--set training.steps=20``).

A component's section is the component's own config, composed here (`optimizer`, `scheduler`:
hyperparallel.optim's; `moe`: hyperparallel.moe's; `kernels`: models.kernels'; `low_precision`:
lowp's), so its defaults and ranges are written once, where they are read; the sections of the
trainer itself are here. The base, unknown keys and every problem at once, is hyperparallel.schema.

The defaults are those of configs/default.yaml (a test holds them equal), so a config that
leaves a section out behaves as the demo does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import GEOMETRIES
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.models import get_family
from hyperparallel.models.compile import BACKENDS as COMPILE_BACKENDS
from hyperparallel.models.kernels import KernelsConfig
from hyperparallel.moe.config import MoEConfig
from hyperparallel.optim import OptimizerConfig, SchedulerConfig
from hyperparallel.parallel import CP_MODES, PP_SCHEDULES, RECOMPUTE_MODES
from hyperparallel.schema import Section, choice, problems
from hyperparallel.train import examples
from hyperparallel.train.data import sources

DEFAULT_CONFIG = examples.DEFAULT


class ModelSection(Section):
    # a causal-LM model_type of transformers (any in its causal-LM mapping, or a tuned family's alias);
    # auto: the model_type of model.path's config.json, or of the inline config's `model_type` key
    family: str = "auto"
    path: str | None = None  # a local directory for from_pretrained
    # an inline Hugging Face config for from_config: a mapping, or a YAML file holding one
    # (configs/models/*.yaml; a relative path is looked for beside the config file first)
    config: dict[str, Any] | None = None
    dtype: choice(DTYPES) = "float32"
    # auto: sdpa where transformers' modeling code of the family supports it, else eager (DeepSeek-V4)
    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"

    def attention(self) -> str:
        """The attn_implementation the model is built with (auto resolved for the family)."""
        if self.attn_implementation != "auto":
            return self.attn_implementation
        return get_family(self.family).attention_implementations[0]

    @model_validator(mode="before")
    @classmethod
    def _family_from_model_type(cls, data):
        if not isinstance(data, dict) or data.get("family", "auto") != "auto":
            return data
        if isinstance(data.get("path"), str):
            return dict(data, family=_model_type_in(Path(data["path"]).expanduser()))
        inline = data.get("config")
        if isinstance(inline, dict) and isinstance(inline.get("model_type"), str):
            return dict(data, family=inline["model_type"])
        return data

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of model.path (a local directory) or model.config (an inline config)")
        if self.family == "auto":
            raise ValueError("model.family is auto, and the inline model.config has no model_type to name the model; "
                             "give model.config.model_type (as a config.json names it) or model.family")
        return self


def _model_type_in(path: Path) -> str:
    """The model_type model.path's config.json names (what model.family: auto trains)."""
    config_json = path / "config.json"
    if not path.is_dir():
        raise ValueError(f"model.path {path} is not a directory; give a local Hugging Face model directory")
    if not config_json.is_file():
        from hyperparallel.train.checkpointing import not_a_model_directory

        instead = not_a_model_directory(path)
        if instead is not None:
            raise ValueError(instead)
    try:
        model_type = json.loads(config_json.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if not isinstance(model_type, str):
        raise ValueError(f"model.family is auto and {config_json} names no model_type to infer it from; give "
                         f"model.family") from None
    return model_type


def _one_or_many(value):
    return [value] if isinstance(value, str) else value


class DataSection(Section):
    source: Literal["stdlib", "files"] = "stdlib"  # stdlib: this Python's own library sources
    # text files, .jsonl/.json, .parquet, .arrow, or Hugging Face `datasets` directories (written by
    # save_to_disk, or a dataset repository's files): a path or a list of them (globs allowed)
    files: list[str] = Field(default_factory=list)
    split: str = "train"  # the split read from a DatasetDict directory
    # auto: from the first record's fields (messages -> chat, prompt + completion ->
    # prompt_completion, else text)
    format: Literal["auto", "text", "chat", "prompt_completion"] = "auto"
    text_field: str = "text"  # the field of a text record (jsonl, parquet, arrow)
    # "builtin" (byte-level BPE trained here on the corpus), a tokenizer.json, or a Hugging Face
    # tokenizer or model directory; null: model.path's tokenizer when it has one, else builtin
    tokenizer: str | None = None
    chat_template: str | None = None  # a Jinja file rendering chat records (null: the tokenizer's)
    vocab_size: int = Field(4096, ge=256)  # of the builtin tokenizer
    max_corpus_bytes: int | None = Field(None, ge=10_000)  # how much text the corpus reads (null: all)
    seq_len: int = Field(256, ge=8)
    packing: bool = True  # concatenate documents into full sequences; else one document per row
    # packed documents attend only to themselves, positions restarting at each; null: on with
    # packing, except where the layout or the model cannot (context parallelism, DeepSeek-V4)
    document_mask: bool | None = None
    assistant_only_loss: bool = True  # chat: the loss counts the assistant turns' tokens only
    completion_only_loss: bool = True  # prompt_completion: the loss counts the completion only
    overlong: Literal["truncate", "drop"] = "truncate"  # a record longer than seq_len (fine-tuning, unpacked)
    # where token shards and the builtin tokenizer are kept (null: $HYPERPARALLEL_CACHE, else
    # data-cache/ beside the run directory's parent; on a cluster, storage every node sees)
    cache_dir: str | None = None
    workers: int | None = Field(None, ge=1)  # tokenizing processes (null: this machine's cores, at most 8)
    # held out for the validation loss: a fraction of the corpus's documents (its last ones), or
    # files of its own (a path or a list, globs allowed); null: no validation
    validation: float | list[str] | None = 0.05

    @field_validator("files", mode="before")
    @classmethod
    def _one_path_or_a_list(cls, value):
        return _one_or_many(value)

    @field_validator("validation", mode="before")
    @classmethod
    def _validation_kinds(cls, value):
        if value is False or value == 0:
            return None
        return _one_or_many(value)

    @model_validator(mode="after")
    def _files_given(self):
        if self.source == "files" and not self.files:
            raise ValueError("data.source is 'files' but data.files is empty")
        if isinstance(self.validation, float) and not 0 < self.validation <= 0.5:
            raise ValueError(f"data.validation: a held-out fraction is a number in (0, 0.5], got {self.validation}")
        if isinstance(self.validation, list) and not self.validation:
            raise ValueError("data.validation is an empty list of files; give files, a fraction, or null")
        return self


class TrainingSection(Section):
    steps: int = Field(150, ge=1)
    global_batch: int = Field(8, ge=1)  # sequences per optimizer step, all ranks together
    micro_batch: int = Field(4, ge=1)  # sequences per forward on one rank
    max_grad_norm: float | None = Field(1.0, gt=0)
    seed: int = 0
    deterministic: bool = False
    # bf16: forward under torch.autocast(bfloat16), as the HF Trainer's bf16=True; parameters,
    # gradients and optimizer state stay in model.dtype
    mixed_precision: Literal["none", "bf16"] = "none"
    compile: choice(COMPILE_BACKENDS) = "inductor"  # torch.compile each decoder layer with this backend
    fused_loss: bool = True  # cross-entropy from the hidden states in chunks; the logits are never made whole
    # seconds a collective may wait for the other ranks before the run fails (a dead or stuck
    # rank); default 600 on GPUs, 300 on the CPU
    timeout_s: int | None = Field(None, gt=0)
    eval_every: int = Field(50, ge=0)  # steps between validation losses (and always after the last); 0: the last only
    eval_batches: int = Field(4, ge=1)  # global batches of validation sequences per evaluation

    def collective_timeout_s(self, device_type: str) -> int:
        return self.timeout_s or (600 if device_type == "cuda" else 300)


class ParallelSection(Section):
    dp_shard: int = Field(1, ge=1)  # ranks that shard the model (FSDP), within each replica
    # HSDP: copies of that sharding (dp_shard x cp ranks each), their gradients all-reduced; with
    # the others, the ranks launched = dp_replicate x dp_shard x cp x tp (docs/parallel.md)
    dp_replicate: int = Field(1, ge=1)
    shard_geometry: choice(GEOMETRIES) = "chunk"  # how rows that do not divide are dealt out
    align: int = Field(1, ge=1)  # shard boundaries on multiples of this many rows (32: whole MXFP8 blocks)
    # tensor parallelism: attention heads, MLP columns and the vocabulary split over tp ranks
    # (consecutive ranks); sequence_parallel also splits the residual stream's sequence between blocks
    tp: int = Field(1, ge=1)
    sequence_parallel: bool = False
    # expert parallelism: every MoE layer's experts split over groups of this many ranks, borrowed
    # from the dp_shard x cp ranks (their product must be a multiple of it)
    ep: int = Field(1, ge=1)
    # context parallelism: every sequence split over cp ranks (load-balanced chunks); ring passes
    # keys and values around the ranks, ulysses exchanges heads for sequence (heads must divide by cp)
    cp: int = Field(1, ge=1)
    cp_mode: choice(CP_MODES) = "ring"
    recompute: choice(RECOMPUTE_MODES) = "off"
    # with gradient accumulation, sharded runs keep each micro-batch's gradients whole until the
    # step's last (one reduce-scatter a step); true reduce-scatters every micro-batch's into the
    # shards instead: accumulation times the reduce-scatters, no rank keeping the model's whole
    # gradients between micro-batches (what a model too large for them needs); sharded runs only
    sync_every_micro_batch: bool = False
    # the dtype gradients are summed in across ranks (FSDP's reduce-scatter, HSDP's and DDP's
    # all-reduce): float32, or bfloat16 for half the bytes (parallel/mixed_precision.py)
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # pipeline parallelism: the decoder layers split into pp stages (the outermost dimension: ranks
    # = pp x dp_replicate x dp_shard x cp x tp), the step's micro-batches flowing through them by
    # pp_schedule (torch.distributed.pipelining's); pp_virtual_stages: stages a rank holds
    # (interleaved_1f1b: 2 or more; zbv and dualpipev: 2, in a V); pp_layers: decoder layers per
    # stage, first to last (default: as even as they divide, docs/parallel.md "Pipeline")
    pp: int = Field(1, ge=1)
    pp_schedule: choice(PP_SCHEDULES) = "1f1b"
    pp_virtual_stages: int = Field(1, ge=1)
    pp_layers: list[int] | None = None

    @field_validator("recompute", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML 1.1 reads a bare `off` as false
        return "off" if value is False else value

    def model_parallel(self) -> int:
        """Ranks that read one batch together (pp x tp x cp): the world's ranks over this are the
        data-parallel ranks (dp_replicate x dp_shard)."""
        return self.pp * self.tp * self.cp


class CheckpointSection(Section):
    dir: str | None = None  # default: RUN_DIR/checkpoints
    every: int = Field(0, ge=0)  # steps between saves; 0 saves only at the end
    keep_last: int = Field(2, ge=1)
    resume: str = "none"  # none | latest | a checkpoint directory
    # save in the background: training waits only while the state is copied to CPU memory
    async_: bool = Field(False, alias="async")


class WandbSection(Section):
    # a W&B project name turns Weights & Biases logging on (rank 0; `pip install wandb`)
    project: str | None = Field(None, min_length=1)
    entity: str | None = None  # the W&B user or team (null: the login's default)
    name: str | None = None  # the run's name (null: the run directory's)
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] = "online"  # offline: files only, `wandb sync` later

    def enabled(self) -> bool:
        return self.project is not None and self.mode != "disabled"


class LoggingSection(Section):
    run_dir: str = "runs/{time}"  # {time}: the start time, YYYYmmdd-HHMMSS
    every: int = Field(10, ge=1)  # steps between printed and recorded metrics
    tensorboard: bool = False
    wandb: WandbSection = Field(default_factory=WandbSection)  # Weights & Biases (on when a project is named)
    progress: bool = True  # the live progress bar
    peak_tflops: float | None = Field(None, gt=0)  # for MFU; default: measured matmul peak (CPU) or table (GPU)
    trace: bool = False  # write RUN_DIR/trace.json: a timeline of trace_steps steps (Perfetto)
    trace_steps: int = Field(3, ge=1)  # traced from the second step of the run (the first warms up)

    @model_validator(mode="after")
    def _run_dir_template(self):
        try:
            self.run_dir.format(time="t")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"logging.run_dir {self.run_dir!r}: the only placeholder allowed is {{time}}") from None
        return self


class TrainConfig(Section):
    model: ModelSection
    data: DataSection = Field(default_factory=DataSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    # the components' own configs, their defaults and ranges written where they are read
    moe: MoEConfig = Field(default_factory=MoEConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    low_precision: LowPrecisionConfig = Field(default_factory=LowPrecisionConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    # `hyperparallel plan --device`: figures of the device model to use instead of its own
    # (train/planning/device_model.py: matmul_flops.bfloat16, memory_bytes_per_s, inter_node_bytes_per_s, ...)
    device_model: dict[str, float | dict[str, float]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _schedule_fits(self):
        if self.scheduler.warmup_steps is not None and self.scheduler.warmup_steps > self.training.steps:
            raise ValueError(f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) exceeds training.steps "
                             f"({self.training.steps})")
        return self

    def warmup_steps(self) -> int:
        return self.scheduler.warmup(self.training.steps)

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank; ConfigError if the batch does not split."""
        t = self.training
        # (tp x cp ranks read one batch: the others are data-parallel, dp_replicate x dp_shard of them)
        data_ranks = max(world_size // self.parallel.model_parallel(), 1)
        per_step = t.micro_batch * data_ranks
        if t.global_batch % per_step:
            ranks = (f"data-parallel ranks ({world_size} ranks / tp x cp {self.parallel.model_parallel()} = "
                     f"{data_ranks})" if self.parallel.model_parallel() > 1 else f"ranks ({world_size})")
            raise ConfigError(
                f"training.global_batch ({t.global_batch}) must be a multiple of training.micro_batch "
                f"({t.micro_batch}) x {ranks} = {per_step}"
            )
        return t.global_batch // per_step

    def fingerprinted(self) -> dict[str, Any]:
        """What decides the numbers of a run, as flat dotted keys: not where it logs or
        checkpoints, nor how it is laid out over ranks (a checkpoint loads into any sharding), nor
        the micro-batch split, nor how long it runs or how often it evaluates."""
        # (kernels: fused operations compute what the modules they replace do)
        data = self.model_dump(mode="json", exclude={"checkpoint", "logging", "parallel", "kernels", "device_model"})
        data["training"].pop("steps")  # a resumed run may go on for longer (its schedule stretches)
        data["training"].pop("micro_batch")  # the global batch decides the numbers; ranks may change
        for how in ("compile", "fused_loss", "timeout_s", "eval_every", "eval_batches"):
            data["training"].pop(how)  # how the same numbers are computed, waited for, and looked at
        for how in ("implementation", "waves", "dispatch"):
            # MegaMoE computes what the sequential layer does; the dispatch's format is expert
            # parallelism's, as the layout is (its forward the same to the bit)
            data["moe"].pop(how)
        for where in ("cache_dir", "workers"):
            data["data"].pop(where)  # where the same token shards are kept, and how many processes made them
        return _flatten(data)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprinted(), sort_keys=True).encode()).hexdigest()[:16]


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "config":  # (an inline model config: one value, compared whole)
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. training.steps=20")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({error.problem})") from None
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = _parse_override(item)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def _read_model_file(raw: dict, base_dir: Path | None) -> list[str]:
    """model.config naming a YAML file of HF config keys: read it in place; the problems found."""
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("config"), str):
        return []
    path = Path(model["config"]).expanduser()
    if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
        path = base_dir / path  # beside the config file, else (a --set, say) from where the command runs
    try:
        mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        return [f"model.config: cannot read the model config file {path} ({getattr(error, 'strerror', None) or error})"]
    except yaml.YAMLError as error:
        return [f"model.config: {path} is malformed YAML: {getattr(error, 'problem', error)}"]
    if not isinstance(mapping, dict):
        return [f"model.config: {path} must hold a mapping of Hugging Face config keys, got {type(mapping).__name__}"]
    model["config"] = mapping
    return []


def _data_files_beside(raw: dict, base_dir: Path) -> None:
    """The config file's own data.files and validation files, given relative and not found from
    where the command runs: beside the config file, as an example config names its data (so it
    runs from any directory). What is found where the command runs stays as written (a run's
    fingerprint holds it); --set values are the command line's, never moved."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return

    def beside(entry):
        if not isinstance(entry, str) or Path(entry).expanduser().is_absolute() or sources.matches(entry):
            return entry
        return str(base_dir / entry) if sources.matches(str(base_dir / entry)) else entry

    for key in ("files", "validation"):
        value = data.get(key)
        if isinstance(value, str):
            data[key] = beside(value)
        elif isinstance(value, list):
            data[key] = [beside(entry) for entry in value]


def from_mapping(raw: Any, source: str = "config", base_dir: Path | None = None) -> TrainConfig:
    """Validate a raw mapping; every problem found is in the ConfigError, one per line."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    found = _read_model_file(raw, base_dir)
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as error:
        unread = ("model", "config") if found else None  # (the file's problem is named already)
        found += problems(error, TrainConfig, skip=unread)
    if found:
        raise ConfigError("\n".join(found))
    return config


def _model_path_given(raw: dict, overrides: list[str]) -> list[str]:
    """`--set model.path=DIR` on a config written for a model of its own (every example config):
    the directory's model replaces the file's (its config.json names the family, so the file's
    model.config and model.family go) and its tokenizer replaces a builtin one (a pretrained
    model's token ids are its own), unless the command line sets those keys too. Edits `raw`;
    returns one line saying what was replaced, or none."""
    given = {tuple(key): value for key, value in map(_parse_override, overrides)}
    path = given.get(("model", "path"))
    model, data = raw.get("model"), raw.get("data")
    if not isinstance(path, str) or not isinstance(model, dict):
        return []
    replaced = []
    for key in ("config", "family"):
        if model.get(key) is not None and ("model", key) not in given:
            del model[key]
            replaced.append(f"model.{key}")
    if (isinstance(data, dict) and data.get("tokenizer") == "builtin" and ("data", "tokenizer") not in given
            and (Path(path).expanduser() / "tokenizer.json").is_file()):
        data["tokenizer"] = None
        replaced.append("data.tokenizer: builtin (its own tokenizer instead)")
    if not replaced:
        return []
    return [f"model.path {path} from the command line replaces the config's {', '.join(replaced)}"]


def config_path(given: str | Path | None) -> Path:
    """The config file a command reads: `given` as a path; else, when no such file is there and it
    is a bare name, NAME.yaml where the command runs, else the package's example of that name (with
    or without .yaml); None: the default."""
    if given is None:
        return DEFAULT_CONFIG
    path = Path(given).expanduser()
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; give a YAML file, or an example config's name")
    if path.is_file():
        return path
    if len(path.parts) == 1:
        if (local := path.with_name(f"{path.name}.yaml")).is_file():  # (`train my` for ./my.yaml)
            return local
        example = examples.find(path.name)
        if example is not None:
            return example
        raise ConfigError(f"config file {path} does not exist, and no example config has that name "
                          f"(the examples: {', '.join(examples.names())})")
    raise ConfigError(f"config file {path} does not exist")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                notes: list[str] | None = None) -> TrainConfig:
    """Read, override and validate a YAML config (the embedded default when `path` is None).
    What the overrides replaced beyond their own keys is appended to `notes` (one line each)."""
    path = config_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text (byte {error.start + 1}); a config is a YAML file") from None
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read ({error.strerror})") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(error, 'problem', error)}") from None
    if isinstance(raw, dict):
        _data_files_beside(raw, path.resolve().parent)
        replaced = _model_path_given(raw, overrides or [])
        raw = apply_overrides(raw, overrides or [])
        if notes is not None:
            notes += replaced
    return from_mapping(raw, str(path), base_dir=path.resolve().parent)


def dump(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)

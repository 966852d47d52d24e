"""The training configuration: YAML validated into typed sections.

Every section rejects keys it does not know, so a typo is an error, not a silent default. The
`--set a.b=v` overrides of the command line are applied to the raw mapping before validation,
with their values parsed as YAML scalars (``--set training.steps=20``, ``--set model.dtype=bfloat16``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import GEOMETRIES
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.models import family_names
from hyperparallel.models.compile import BACKENDS as COMPILE_BACKENDS
from hyperparallel.optim import OPTIMIZER_NAMES, SCHEDULE_KINDS, check_hyperparameters, validate_schedule
from hyperparallel.parallel import RECOMPUTE_MODES

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent.parent / "configs" / "default.yaml"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def choice(names) -> Any:
    """A Literal of the names a registry implements (model families, compile backends, ...): the
    choices are stated once, where they are implemented."""
    return Literal[tuple(names)]


class ModelSection(Section):
    family: choice(family_names())
    path: str | None = None  # a local directory for from_pretrained
    config: dict[str, Any] | None = None  # an inline Hugging Face config for from_config
    dtype: choice(DTYPES) = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of model.path (a local directory) or model.config (an inline config)")
        return self


class DataSection(Section):
    source: Literal["stdlib", "files"] = "stdlib"  # stdlib: this Python's own library sources
    files: list[str] = Field(default_factory=list)  # .txt/.md/.py text, .jsonl, .parquet (globs allowed)
    text_field: str = "text"  # the field of jsonl records and parquet columns
    tokenizer: str = "builtin"  # "builtin" (byte-level BPE trained here on the corpus) or a local path
    vocab_size: int = Field(4096, ge=256)  # of the builtin tokenizer
    max_corpus_bytes: int = Field(8_000_000, ge=10_000)  # how much text the corpus reads
    seq_len: int = Field(256, ge=8)
    packing: bool = True  # concatenate documents into full sequences; else one document per row

    @model_validator(mode="after")
    def _files_given(self):
        if self.source == "files" and not self.files:
            raise ValueError("data.source is 'files' but data.files is empty")
        return self


class TrainingSection(Section):
    steps: int = Field(100, ge=1)
    global_batch: int = Field(8, ge=1)  # sequences per optimizer step, all ranks together
    micro_batch: int = Field(4, ge=1)  # sequences per forward on one rank
    max_grad_norm: float | None = Field(1.0, gt=0)
    seed: int = 0
    deterministic: bool = False
    # bf16: forward under torch.autocast(bfloat16), as the HF Trainer's bf16=True; parameters,
    # gradients and optimizer state stay in model.dtype
    mixed_precision: Literal["none", "bf16"] = "none"
    compile: choice(COMPILE_BACKENDS) = "none"  # torch.compile each decoder layer with this backend
    fused_loss: bool = True  # cross-entropy from the hidden states in chunks; the logits are never made whole
    # seconds a collective may wait for the other ranks before the run fails (a dead or stuck
    # rank); default 600 on GPUs, 300 on the CPU
    timeout_s: int | None = Field(None, gt=0)

    def collective_timeout_s(self, device_type: str) -> int:
        return self.timeout_s or (600 if device_type == "cuda" else 300)


class ParallelSection(Section):
    dp_shard: int = Field(1, ge=1)  # ranks that shard the model (FSDP); must equal the ranks launched
    shard_geometry: choice(GEOMETRIES) = "chunk"  # how rows that do not divide are dealt out
    align: int = Field(1, ge=1)  # shard boundaries on multiples of this many rows (32: whole MXFP8 blocks)
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    recompute: choice(RECOMPUTE_MODES) = "off"

    @field_validator("recompute", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML 1.1 reads a bare `off` as false
        return "off" if value is False else value

    @model_validator(mode="after")
    def _only_wired_values(self):
        for key, issue in (("tp", "tensor parallelism"), ("ep", "expert parallelism"), ("cp", "context parallelism")):
            if getattr(self, key) != 1:
                raise ValueError(f"parallel.{key} = {getattr(self, key)} is not supported yet ({issue} is not wired "
                                 f"into the trainer); use 1. Extra ranks from --nproc replicate the model instead")
        return self


class OptimizerSection(Section):
    """Types here; the ranges are hyperparallel.optim's (`check_hyperparameters`), stated there once."""

    name: choice(OPTIMIZER_NAMES) = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_lr: float | None = None  # Muon's own lr (default: lr)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5

    @model_validator(mode="after")
    def _in_range(self):
        try:
            check_hyperparameters(**self.model_dump())
        except ConfigError as error:
            raise ValueError(str(error)) from None
        return self


class SchedulerSection(Section):
    kind: choice(SCHEDULE_KINDS) = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    @model_validator(mode="after")
    def _in_range(self):
        try:
            validate_schedule(self.kind, self.warmup_steps, None, self.min_lr_ratio)
        except ConfigError as error:
            raise ValueError(str(error)) from None
        return self


class CheckpointSection(Section):
    dir: str | None = None  # default: RUN_DIR/checkpoints
    every: int = Field(0, ge=0)  # steps between saves; 0 saves only at the end
    keep_last: int = Field(2, ge=1)
    resume: str = "none"  # none | latest | a checkpoint directory
    # save in the background: training waits only while the state is copied to CPU memory
    async_: bool = Field(False, alias="async")


class LoggingSection(Section):
    run_dir: str = "runs/{time}"  # {time}: the start time, YYYYmmdd-HHMMSS
    every: int = Field(10, ge=1)  # steps between printed and recorded metrics
    tensorboard: bool = False
    progress: bool = True  # the live progress bar
    peak_tflops: float | None = Field(None, gt=0)  # for MFU; default: measured matmul peak (CPU) or table (GPU)

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
    low_precision: LowPrecisionConfig = Field(default_factory=LowPrecisionConfig)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)

    @model_validator(mode="after")
    def _schedule_fits(self):
        if self.scheduler.warmup_steps > self.training.steps:
            raise ValueError(f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) exceeds training.steps "
                             f"({self.training.steps})")
        return self

    def grad_accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank; ConfigError if the batch does not split."""
        t = self.training
        per_step = t.micro_batch * world_size
        if t.global_batch % per_step:
            raise ConfigError(
                f"training.global_batch ({t.global_batch}) must be a multiple of training.micro_batch "
                f"({t.micro_batch}) x ranks ({world_size}) = {per_step}"
            )
        return t.global_batch // per_step

    def fingerprint(self) -> str:
        """A hash of what decides the numbers of a run: not where it logs or checkpoints, nor how
        it is laid out over ranks (a checkpoint loads into any sharding), nor the micro-batch split."""
        data = self.model_dump(mode="json", exclude={"checkpoint", "logging", "parallel"})
        data["training"].pop("steps")  # a resumed run may go on for longer
        data["training"].pop("micro_batch")  # the global batch decides the numbers; ranks may change
        for how in ("compile", "fused_loss", "timeout_s"):  # how the same numbers are computed, and waited for
            data["training"].pop(how)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


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


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if not where:
        return message
    if first["type"] == "extra_forbidden":
        return f"unknown key {where!r}"
    if first["type"] == "missing":
        return f"missing key {where!r}"
    if "input" in first and first["type"] not in ("value_error", "assertion_error"):
        return f"{where}: {message} (got {first['input']!r})"
    return f"{where}: {message}"


def from_mapping(raw: Any, source: str = "config") -> TrainConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as error:
        extra = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        raise ConfigError(f"{source}: {_describe(error)}{extra}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read, override and validate a YAML config (the embedded default when `path` is None)."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(error, 'problem', error)}") from None
    if isinstance(raw, dict):
        raw = apply_overrides(raw, overrides or [])
    return from_mapping(raw, str(path))


def dump(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)

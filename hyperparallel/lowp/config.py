"""LowPrecisionConfig: which modules train in MXFP8, and how. It is the trainer's
`low_precision:` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hyperparallel.mx.format import SCALE_MODES
from hyperparallel.schema import Section, choice

# the LM head, embeddings and MoE routers stay in high precision unless a user says otherwise
DEFAULT_EXCLUDE = ["lm_head", "*embed*", "*.mlp.gate", "*router*"]


class LowPrecisionConfig(Section):
    enabled: bool = False
    format: Literal["mxfp8"] = "mxfp8"
    scale_mode: choice(SCALE_MODES) = "rceil"
    include: list[str] = Field(default_factory=lambda: ["*"])  # globs on module names
    exclude: list[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    modules: list[Literal["linear", "experts"]] = Field(default_factory=lambda: ["linear", "experts"])
    wgrad: Literal["mxfp8", "high_precision"] = "mxfp8"
    # what forward keeps of the input for the weight gradient: its column-wise MX copy (about
    # half of bf16 bytes) or the input itself
    save_input: Literal["columnwise", "original"] = "columnwise"

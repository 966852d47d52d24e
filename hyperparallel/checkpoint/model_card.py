"""The model card a training checkpoint carries: what `hyperparallel export` needs to rebuild the
model from the checkpoint alone. The trainer writes it into the manifest's `extra["model"]`;
export reads it back. One definition of its fields and their checks, here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hyperparallel.errors import CheckpointError

# The dtypes a model is trained and exported in, by the names configs and model cards use.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KEY = "model"  # its key in the manifest's `extra`


@dataclass(frozen=True)
class ModelCard:
    family: str  # a name hyperparallel.models.get_family knows
    dtype: str  # one of DTYPES: the dtype the parameters were trained in
    hf_config: dict  # the full Hugging Face config, `config.to_dict()` style

    @classmethod
    def of(cls, family: str, dtype: str, hf_config) -> ModelCard:
        """The card of a live model: `hf_config` is its transformers config object. (Its dict as the
        config makes it, through JSON: an infinite float stays a float, which `from_dict` takes back;
        `to_json_string` would tag it as an object.)"""
        return cls(family, dtype, json.loads(json.dumps(hf_config.to_dict())))

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_manifest(cls, directory: Path, manifest: dict) -> ModelCard:
        """The card in a checkpoint's manifest; CheckpointError naming what is missing or wrong."""
        card = (manifest.get("extra") or {}).get(KEY)
        if card is None:
            raise CheckpointError(
                f"checkpoint {directory} has no model card (extra['{KEY}'] in its manifest): it was not written by "
                f"`hyperparallel train`; save it with extra={{'{KEY}': ModelCard.of(...).to_json()}} to export it, "
                f"or call the model's save_pretrained yourself"
            )
        if not isinstance(card, dict) or not isinstance(card.get("family"), str) \
                or not isinstance(card.get("hf_config"), dict):
            raise CheckpointError(f"checkpoint {directory}: the model card must hold 'family' (a name) and 'hf_config' "
                                  f"(a mapping); got {card!r}")
        dtype = card.get("dtype", "float32")
        if dtype not in DTYPES:
            raise CheckpointError(f"checkpoint {directory}: the model card's dtype is {dtype!r}; expected one of "
                                  f"{', '.join(DTYPES)}")
        return cls(card["family"], dtype, card["hf_config"])

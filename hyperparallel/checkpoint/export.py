"""Export a training checkpoint to a Hugging Face model directory.

The trainer's checkpoints carry a model card in their manifest (`model_card.ModelCard`: the
family, the training dtype and the full HF config), so a checkpoint alone is enough: the family's own
transformers class is rebuilt from the config (on the meta device, then given memory), the
checkpoint is loaded into it whatever sharding layout saved it, and `save_pretrained` writes
`config.json` and safetensors. transformers 5 keeps MoE experts fused in memory
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) but writes them per expert
(`experts.N.gate_proj.weight`, ...), the layout of the published checkpoints, and fuses them
again in `from_pretrained`; GroupedExperts keeps the fused names, so the round trip is exact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from hyperparallel.checkpoint.io import load, read_manifest
from hyperparallel.checkpoint.model_card import DTYPES, ModelCard
from hyperparallel.errors import CheckpointError, ConfigError

TOKENIZER_FILE = "tokenizer.json"
# The trainer's choice of end-of-text and padding tokens (hyperparallel.train.data): the first of
# these in the vocabulary ends every document, and padding falls back to it.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|im_end|>")
_PAD_TOKEN = "<|pad|>"


def end_of_text_token(vocab: dict[str, int]) -> str | None:
    """The token that ends every document in training (the trainer's choice), or None."""
    return next((token for token in _EOS_TOKENS if token in vocab), None)


def run_tokenizer_file(checkpoint_dir: str | os.PathLike) -> Path:
    """Where the run's tokenizer is when the checkpoint sits in its run directory
    (RUN_DIR/checkpoints/step_N -> RUN_DIR/tokenizer.json); it may not exist."""
    return Path(checkpoint_dir).parent.parent / TOKENIZER_FILE


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ConfigError(f"the export dtype is {value!r}; expected one of {', '.join(DTYPES)}")


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a file" if not out.is_dir() else "a non-empty directory"
        raise ConfigError(f"export destination {out} is {what}; choose a new or empty directory")


def build_from_card(card: ModelCard, directory: str | os.PathLike):
    """The card's transformers model, in the card's dtype on the CPU, its parameters and persistent
    buffers not yet filled: `load(directory, model)` fills them (and refuses a checkpoint that
    lacks any). `directory` (the checkpoint's) only names it in errors."""
    # imported here: `hyperparallel.checkpoint` stays usable without loading transformers
    from hyperparallel.models import get_family

    try:
        family = get_family(card.family)
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {directory}: its model card names {error}") from None
    model_type = card.hf_config.get("model_type")
    if model_type not in family.model_types:
        raise CheckpointError(
            f"checkpoint {directory}: the model card says family {card.family!r} but its HF config has model_type "
            f"{model_type!r} (expected {' or '.join(family.model_types)})"
        )
    try:
        config = family.config_class.from_dict(dict(card.hf_config))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {directory}: the HF config in its model card is invalid: {error}") from None
    config.use_cache = True  # the trainer turns the KV cache off; inference with the export wants it
    with torch.device("meta"):
        model = family.model_class._from_config(config, dtype=card.torch_dtype)
    model.to_empty(device="cpu")
    # Non-persistent buffers (the rotary frequencies) are in no checkpoint, and to_empty left
    # them as uninitialized memory: the model's own init computes them, as from_pretrained does.
    # (save_pretrained never writes them either, so an export was right without this; a model
    # used in memory, by `hyperparallel generate`, was not.)
    with torch.no_grad():
        for module in model.modules():
            if module._non_persistent_buffers_set:
                model._init_weights(module)
    model.tie_weights()
    return model


def model_from_checkpoint(checkpoint_dir: str | os.PathLike):
    """The model of a `hyperparallel train` checkpoint, whole in this process (whatever layout
    saved it), in its training dtype, on the CPU, in eval mode; and its model card."""
    directory = Path(checkpoint_dir)
    card = ModelCard.from_manifest(directory, read_manifest(directory))
    model = build_from_card(card, directory)
    load(directory, model)
    return model.eval(), card


def _tokenizer_config(tokenizer_file: Path) -> dict:
    """Without it AutoTokenizer picks the family's tokenizer class (Qwen2Tokenizer for Qwen3),
    which rebuilds the pre-tokenizer and encodes text to other ids than training did."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab()
    except Exception as error:  # tokenizers raises its own Exception type
        first = str(error).splitlines()[0] if str(error) else repr(error)  # (one line: the CLI prints each)
        raise CheckpointError(f"{tokenizer_file} is not a tokenizers file: {first}") from None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    eos = end_of_text_token(vocab)
    if eos is not None:
        config.update(eos_token=eos, pad_token=_PAD_TOKEN if _PAD_TOKEN in vocab else eos)
    return config


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              dtype: str | torch.dtype | None = None) -> Path:
    """Write the model of a `hyperparallel train` checkpoint as a Hugging Face directory.

    `out_dir` gets `config.json`, `generation_config.json` and `model*.safetensors` in the family's
    own layout (loadable with `AutoModelForCausalLM.from_pretrained`, or as the trainer's
    `model.path`), and, when the checkpoint sits in a run directory (`RUN_DIR/checkpoints/step_N`),
    the run's `tokenizer.json` with a `tokenizer_config.json` for `AutoTokenizer`.
    `dtype` (float32 | bfloat16) defaults to the training dtype.
    The directory appears whole or not at all; an existing non-empty `out_dir` is refused.
    """
    directory, out = Path(checkpoint_dir), Path(out_dir)
    manifest = read_manifest(directory)
    card = ModelCard.from_manifest(directory, manifest)
    out_dtype = card.torch_dtype if dtype is None else _dtype(dtype)
    _check_out_dir(out)

    model = build_from_card(card, directory)
    load(directory, model)
    model.to(out_dtype).eval()

    final = out.resolve()  # "." has no name to put ".tmp" after
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.is_dir() and not tmp.is_symlink():  # left by an export that was killed
        shutil.rmtree(tmp)
    try:
        model.save_pretrained(tmp)
        tokenizer = run_tokenizer_file(directory)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
            (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n")
        _check_out_dir(out)  # nothing appeared there meanwhile
        os.replace(tmp, final)  # an empty directory is replaced too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

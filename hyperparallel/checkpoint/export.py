"""Export a training checkpoint to a Hugging Face model directory, streamed.

The trainer's checkpoints carry a model card in their manifest (`model_card.ModelCard`: the
family, the training dtype and the full HF config), so a checkpoint alone is enough: the family's
own transformers class is rebuilt from the config on the meta device (shapes, no memory), and the
checkpoint's tensors are read a few at a time (whatever sharding layout saved them), turned into
the on-disk names and layout exactly as `save_pretrained` turns them (transformers'
`revert_weight_conversion`, one model tensor at a time, or a few together where several are saved
as one: a fused query_key_value; tied aliases written once), and written
into safetensors shards whose headers were laid out beforehand from the shapes alone
(`safetensors_stream`). So the export holds about one batch of tensors (`batch_bytes`), never the
model. transformers 5 keeps MoE experts fused in memory (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]) but writes them per expert (`experts.N.gate_proj.weight`, ...),
the layout of the published checkpoints, and fuses them again in `from_pretrained`; GroupedExperts
keeps the fused names, so the round trip is exact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from hyperparallel.checkpoint.hf_files import INDEX_FILE, SAFETENSORS_FILE
from hyperparallel.checkpoint.io import (
    _check_fits,
    _first_failure,
    checkpoint_in,
    hush_single_process_notice,
    load,
    no_gc_pauses,
    read_manifest,
)
from hyperparallel.checkpoint.model_card import DTYPES, ModelCard
from hyperparallel.checkpoint.safetensors_stream import SafetensorsWriter, TensorSpec
from hyperparallel.checkpoint.sharded import ShardedLoadPlanner
from hyperparallel.checkpoint.storage import SafeFileSystemReader
from hyperparallel.errors import CheckpointError, ConfigError

TOKENIZER_FILE = "tokenizer.json"
# The trainer's choice of end-of-text and padding tokens (hyperparallel.train.data): the first of
# these in the vocabulary ends every document, and padding falls back to it.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|im_end|>")
_PAD_TOKEN = "<|pad|>"
DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_BATCH_BYTES = 64 * 2**20  # read at once from the checkpoint (a larger tensor is read alone)
# save_pretrained's units (huggingface_hub's parse_size_to_int), and the binary ones
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def parse_size(value: int | str) -> int:
    """Bytes, from a number of bytes or a string such as "5GB", "200MB", "1.5GiB" (KB, MB, GB and
    TB are powers of 1000, as in save_pretrained's `max_shard_size`)."""
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
        if found:
            number = int(float(found[1]) * _SIZE_UNITS[(found[2] or "").upper()])
    if number is None or number < 1:
        raise ConfigError(f"max_shard_size {value!r} is not a size: give a number of bytes or one with a unit, "
                          f"such as 5GB or 200MB")
    return number


def meta_model_from_card(card: ModelCard, directory: str | os.PathLike):
    """The card's transformers model on the meta device, in the card's dtype (shapes and dtypes,
    no memory). `directory` (the checkpoint's) only names it in errors."""
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
        return family.model_class._from_config(config, dtype=card.torch_dtype)


def build_from_card(card: ModelCard, directory: str | os.PathLike):
    """The card's transformers model, in the card's dtype on the CPU, its parameters and persistent
    buffers not yet filled: `load(directory, model)` fills them (and refuses a checkpoint that
    lacks any). `directory` (the checkpoint's) only names it in errors."""
    from hyperparallel.models.init import init_non_persistent_buffers

    model = meta_model_from_card(card, directory)
    model.to_empty(device="cpu")
    # Non-persistent buffers (the rotary frequencies) are in no checkpoint, and to_empty left
    # them as uninitialized memory: the model's own init computes them, as from_pretrained does.
    # (save_pretrained never writes them either, so an export was right without this; a model
    # used in memory, by `hyperparallel generate`, was not.)
    init_non_persistent_buffers(model, meta_model_from_card(card, directory))
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
              dtype: str | torch.dtype | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
              batch_bytes: int = DEFAULT_BATCH_BYTES) -> Path:
    """Write the model of a `hyperparallel train` checkpoint as a Hugging Face directory.

    `out_dir` gets `config.json`, `generation_config.json` and the weights in the family's own
    layout, as `save_pretrained` writes them: `model.safetensors`, or shards of at most
    `max_shard_size` bytes of tensors each (`model-00001-of-0000N.safetensors`, a tensor larger
    than that alone in its own) with `model.safetensors.index.json` (loadable with
    `AutoModelForCausalLM.from_pretrained`, or as the trainer's `model.path`), and, when the
    checkpoint sits in a run directory (`RUN_DIR/checkpoints/step_N`; a run directory given is its
    newest checkpoint, `io.checkpoint_in`), the run's `tokenizer.json`
    with a `tokenizer_config.json` for `AutoTokenizer`. `dtype` (float32 | bfloat16) defaults to
    the training dtype. The weights are streamed: read from the checkpoint `batch_bytes` at a time
    (a larger tensor alone), never the whole model at once.
    The directory appears whole or not at all; an existing non-empty `out_dir` is refused.
    """
    directory, out = checkpoint_in(checkpoint_dir), Path(out_dir)
    shard_limit = parse_size(max_shard_size)
    manifest = read_manifest(directory)
    card = ModelCard.from_manifest(directory, manifest)
    out_dtype = card.torch_dtype if dtype is None else _dtype(dtype)
    _check_out_dir(out)

    model = meta_model_from_card(card, directory).to(out_dtype).eval()
    reader = SafeFileSystemReader(str(directory))
    metadata = reader.read_metadata()  # kept by the reader for every batch's dcp.load
    _check_fits(directory, metadata, {"model": model.state_dict()}, {})
    weights = _plan_weights(model, shard_limit)

    final = out.resolve()  # "." has no name to put ".tmp" after
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.is_dir() and not tmp.is_symlink():  # left by an export that was killed
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        _save_configs(model, tmp)
        _stream_weights(directory, reader, metadata, model, weights, tmp, batch_bytes)
        tokenizer = run_tokenizer_file(directory)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
            run_config = tokenizer.with_name("tokenizer_config.json")
            if run_config.is_file():  # (the run's own: its special tokens and chat template)
                shutil.copyfile(run_config, tmp / "tokenizer_config.json")
            else:
                (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer), indent=2) + "\n")
        _check_out_dir(out)  # nothing appeared there meanwhile
        os.replace(tmp, final)  # an empty directory is replaced too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class _Weights:
    """What the export writes, from shapes alone: each model tensor's on-disk tensors (as
    save_pretrained converts them), and the shard files with the tensors of each, in
    save_pretrained's order."""

    def __init__(self, outputs: dict[str, list[TensorSpec]], shards: list[list[TensorSpec]], total_parameters: int):
        self.outputs = outputs  # model keys (a group converted together) -> their tensors on disk; in writing order
        self.shards = shards
        self.total_parameters = total_parameters

    @property
    def file_names(self) -> list[str]:
        """save_pretrained's names of the shard files."""
        count = len(self.shards)
        if count == 1:
            return [SAFETENSORS_FILE]
        return [SAFETENSORS_FILE.replace(".safetensors", f"-{i + 1:05d}-of-{count:05d}.safetensors")
                for i in range(count)]

    def index(self) -> dict | None:
        """`model.safetensors.index.json` as save_pretrained writes it (None for one file)."""
        if len(self.shards) == 1:
            return None
        weight_map = {spec.name: name for name, specs in zip(self.file_names, self.shards, strict=True)
                      for spec in specs}
        total = sum(spec.nbytes for specs in self.shards for spec in specs)
        return {"metadata": {"total_parameters": self.total_parameters, "total_size": total}, "weight_map": weight_map}


def _plan_weights(model, shard_limit: int) -> _Weights:
    """The tensors save_pretrained would write for `model` (on the meta device, in the export
    dtype), by the model tensor each comes from, and their shards: tensors in save_pretrained's
    order, each shard filled until the next would pass `shard_limit` (huggingface_hub's rule)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)  # a tied alias is written once
    order = {name: i for i, name in enumerate(revert_weight_conversion(model, dict(state)))}
    outputs = {}
    for unit in _units(model, state):  # (several model tensors saved as one: converted together)
        converted = revert_weight_conversion(model, {key: state[key] for key in unit})
        outputs[unit] = [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in converted.items()]
    written = [spec.name for specs in outputs.values() for spec in specs]
    if sorted(written) != sorted(order):
        config = getattr(model, "config", None)
        raise CheckpointError(f"a streamed export does not support model type {getattr(config, 'model_type', None)!r} "
                              f"({type(model).__name__}): converting its tensors group by group does not give what "
                              f"save_pretrained writes")
    outputs = dict(sorted(outputs.items(), key=lambda item: min((order[s.name] for s in item[1]), default=-1)))
    for specs in outputs.values():
        specs.sort(key=lambda spec: order[spec.name])
    specs = sorted((spec for specs in outputs.values() for spec in specs), key=lambda spec: order[spec.name])
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.nbytes > shard_limit:  # alone in a shard of its own, the current one goes on
            shards.append([spec])
            continue
        if size + spec.nbytes > shard_limit:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    return _Weights(outputs, shards, model.num_parameters())


def _units(model, state: dict) -> list[tuple[str, ...]]:
    """The model's tensors in groups that save_pretrained converts into the same on-disk tensors
    (q_proj, k_proj and v_proj saved as one query_key_value, say), each group in state-dict order;
    most groups are one tensor. (Converted alone, a tensor of a group already gives its on-disk
    name: tensors sharing a name are one group.)"""
    from transformers.core_model_loading import revert_weight_conversion

    keys = list(state)
    root = {key: key for key in keys}

    def find(key: str) -> str:
        while root[key] != key:
            key = root[key] = root[root[key]]
        return key

    first_of: dict[str, str] = {}  # an on-disk name -> the first model tensor writing it
    for key in keys:
        for name in revert_weight_conversion(model, {key: state[key]}):
            if name in first_of:
                root[find(key)] = find(first_of[name])
            else:
                first_of[name] = key
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(find(key), []).append(key)
    return [tuple(group) for group in groups.values()]


def _save_configs(model, out: Path) -> None:
    """config.json and generation_config.json as save_pretrained writes them for the model in the
    export dtype."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)


def _batches(model_keys: list, nbytes: dict, budget: int) -> Iterator[list]:
    """Consecutive keys (or groups of them), up to `budget` bytes together (one larger than that alone)."""
    batch, size = [], 0
    for key in model_keys:
        if batch and size + nbytes[key] > budget:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += nbytes[key]
    if batch:
        yield batch


def _stream_weights(directory: Path, reader, metadata, model, weights: _Weights, out: Path, batch_bytes: int) -> None:
    """Read the checkpoint's model tensors a batch at a time, convert each as save_pretrained
    does, and write each result into its place in its shard file. A file is opened when its
    first tensor comes and closed when its last is written (files fill in order)."""
    from transformers.core_model_loading import revert_weight_conversion

    file_of = {spec.name: name for name, specs in zip(weights.file_names, weights.shards, strict=True) for spec in specs}
    specs_of = dict(zip(weights.file_names, weights.shards, strict=True))
    remaining = {name: len(specs) for name, specs in specs_of.items()}
    open_files: dict[str, SafetensorsWriter] = {}
    saved = metadata.state_dict_metadata
    state = model.state_dict()
    units = list(weights.outputs)
    nbytes = {unit: sum(state[key].numel() * saved[f"model.{key}"].properties.dtype.itemsize for key in unit)
              for unit in units}
    hush_single_process_notice()
    try:
        for batch_units in _batches(units, nbytes, batch_bytes):
            batch = [key for unit in batch_units for key in unit]
            tensors = {f"model.{key}": torch.empty(state[key].shape, dtype=saved[f"model.{key}"].properties.dtype)
                       for key in batch}
            with no_gc_pauses():
                try:
                    dcp.load(tensors, storage_reader=reader, planner=ShardedLoadPlanner({}), no_dist=True)
                except (Exception, CheckpointException) as error:  # a truncated or missing data file
                    raise CheckpointError(f"checkpoint {directory} cannot be read: {_first_failure(error)}") from None
            for unit in batch_units:
                values = {key: tensors.pop(f"model.{key}").to(state[key].dtype) for key in unit}
                for name, tensor in revert_weight_conversion(model, values).items():
                    file = file_of[name]
                    if file not in open_files:
                        open_files[file] = SafetensorsWriter(out / file, specs_of[file], {"format": "pt"})
                    open_files[file].write(name, tensor)
                    remaining[file] -= 1
                    if not remaining[file]:
                        open_files.pop(file).close()
                del values
        for file, specs in specs_of.items():
            if not specs:  # (a model without weights: one empty file, as save_pretrained writes)
                SafetensorsWriter(out / file, specs, {"format": "pt"}).close()
            elif remaining[file] and file not in open_files:
                raise CheckpointError(f"export of checkpoint {directory}: no tensor of {file} was written")
        for writer in open_files.values():
            writer.close()  # refuses a file with a tensor never written
    finally:
        for writer in open_files.values():
            writer.abandon()  # (nothing once closed)
    index = weights.index()
    if index is not None:
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

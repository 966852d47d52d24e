"""Build a Hugging Face causal LM for training: from an inline config or a local checkpoint.

An inline config is built on the meta device (no memory, no init), its MoE blocks are swapped
for hyperparallel.moe's (router, GroupedExperts, shared experts), and only then is it materialized on the CPU and initialized from a seed with
the family's own `_init_weights`. A checkpoint directory is loaded with `from_pretrained`, from
local files only and from safetensors only (nothing is unpickled).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import CheckpointError, ConfigError, HyperparallelError
from .families import ModelFamily, family_for_model_type, get_family
from .init import init_weights
from .moe_blocks import swap_moe_blocks

# Spellings older config.json files use; the config classes turn them into `rope_parameters`.
_LEGACY_CONFIG_KEYS = frozenset({"rope_theta", "rope_scaling"})
# Keys that build_model sets from its own arguments; an inline value would be ignored or conflict.
_KEYS_SET_BY_ARGUMENTS = {
    "dtype": "dtype",
    "torch_dtype": "dtype",
    "attn_implementation": "attn_implementation",
    "_attn_implementation": "attn_implementation",
    "experts_implementation": "grouped_experts",
}


def build_model(
    family: str,
    *,
    path: str | Path | None = None,
    config: Mapping | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    seed: int = 0,
    grouped_experts: bool = True,
    materialize: bool = True,
) -> PreTrainedModel:
    """A family's causal LM (any text decoder-only model_type of transformers, or a tuned family's
    name) in train mode with `config.use_cache = False`.

    Exactly one of `path` (a local Hugging Face checkpoint directory; `seed` is then unused) or
    `config` (a mapping of the family's HF config keys; weights initialized from `seed`).
    With `grouped_experts`, MoE layers run on hyperparallel.moe's modules (moe_blocks.py: GroupedExperts
    for every experts module, the tuned families' blocks as MoEBlocks; same parameter names);
    without, on transformers' own. `attn_implementation` None: sdpa where the model class
    supports it, else eager. `materialize=False` leaves it on the meta device: shapes and dtypes, no weights read or
    initialized (what `hyperparallel plan` measures).
    """
    spec = get_family(family)
    if (path is None) == (config is None):
        raise ConfigError(
            "build_model needs exactly one of path= (a local checkpoint directory) or config= (a mapping of HF config keys)"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16; got {dtype!r}")
    supported = spec.attention_implementations
    if attn_implementation is None:
        attn_implementation = supported[0]
    valid_attention = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if attn_implementation not in valid_attention:
        raise ConfigError(f"attn_implementation {attn_implementation!r} is not one of {', '.join(valid_attention)}")
    if attn_implementation in ("sdpa", "eager") and attn_implementation not in supported:
        raise ConfigError(f"attn_implementation {attn_implementation!r}: transformers' {spec.name} supports "
                          f"{', '.join(supported)} only")

    if config is not None or not materialize:
        hf_config = make_config(spec, config) if config is not None else pretrained_config(spec, path)
        with torch.device("meta"):
            model = _construct(spec, hf_config, dtype, attn_implementation)
        if grouped_experts:
            swap_moe_blocks(model)
        if materialize:
            model.to_empty(device="cpu")
            init_weights(model, seed)
    else:
        model = _load_pretrained(spec, Path(path), dtype, attn_implementation)
        if grouped_experts:
            swap_moe_blocks(model)
    model.config.use_cache = False  # training never reads a KV cache; building one costs memory
    return model.train()


def _construct(spec: ModelFamily, hf_config: PretrainedConfig, dtype: torch.dtype,
               attn_implementation: str) -> PreTrainedModel:
    """transformers' model class built from the config; what its constructor refuses (shapes that
    do not fit together, say), one line naming the model type."""
    try:
        return spec.model_class._from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    except HyperparallelError:
        raise
    except Exception as error:  # (whatever the constructor raises for a config it cannot build: one line)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, (TypeError, ValueError, AssertionError, StrictDataclassError)) or not first:
            first = f"{type(error).__name__}: {first}".rstrip(": ")
        raise ConfigError(f"transformers' {spec.model_class.__name__} cannot be built from this config "
                          f"(model_type {hf_config.model_type!r}): {first}") from error


def make_config(spec: ModelFamily | str, values: Mapping) -> PretrainedConfig:
    """The family's config class built from an inline mapping, every key checked against it."""
    if isinstance(spec, str):
        spec = get_family(spec)
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"the inline config of family {spec.name!r} must be a mapping of HF config keys; got {type(values).__name__}"
        )
    known = [*_known_config_keys(spec.config_class), *spec.extra_config_keys]
    problems = []  # every key's, together (one per line)
    for key in values:
        if key in _KEYS_SET_BY_ARGUMENTS:
            problems.append(f"inline config key {key!r} (family {spec.name!r}) is set by build_model's "
                            f"{_KEYS_SET_BY_ARGUMENTS[key]}= argument; remove it from the config")
        elif key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"unknown key {key!r} in the inline config of family {spec.name!r} "
                            f"({spec.config_class.__name__} has no such field){hint}")
    model_type = values.get("model_type", spec.model_types[0])
    if model_type not in spec.model_types:
        problems.append(f"inline config key 'model_type' is {model_type!r} but family {spec.name!r} expects "
                        f"{spec.model_types[0]!r}")
    if problems:
        raise ConfigError("\n".join(problems))
    fields = {k: v for k, v in values.items() if k != "model_type"}
    try:
        hf_config = spec.config_class(**fields)
    except (TypeError, ValueError, StrictDataclassError) as error:
        raise ConfigError(f"invalid inline config for family {spec.name!r}: {error}") from error
    if spec.check is not None:
        try:
            spec.check(hf_config)
        except ConfigError as error:
            raise ConfigError(f"invalid inline config for family {spec.name!r}: {error}") from error
    return hf_config


def declared_config_keys(config_class: type[PretrainedConfig]) -> set[str]:
    """The keys `config_class(**kwargs)` takes by name: its fields and attribute_map's aliases."""
    keys = set(inspect.signature(config_class.__init__).parameters) - {"self", "args", "kwargs"}
    keys |= {name for name in getattr(config_class, "__dataclass_fields__", {}) if not name.startswith("_")}
    return keys | set(getattr(config_class, "attribute_map", {}) or {})


@functools.cache
def _known_config_keys(config_class: type[PretrainedConfig]) -> list[str]:
    fields = declared_config_keys(config_class) | _LEGACY_CONFIG_KEYS
    try:
        fields |= set(config_class().to_dict())  # (what the defaults set beyond the declared fields)
    except (TypeError, ValueError, StrictDataclassError):
        pass  # (a config class whose defaults alone do not validate: its declared fields suffice)
    return sorted(k for k in fields if not k.startswith("_"))


def pretrained_config(spec: ModelFamily | str, path: str | Path) -> PretrainedConfig:
    """The config of a local Hugging Face checkpoint directory, checked to be of `spec`'s family
    (what build_model(path=...) loads; nothing of the weights is read)."""
    if isinstance(spec, str):
        spec = get_family(spec)
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(
            f"model path {str(path)!r} is not a directory; expected a local Hugging Face checkpoint directory"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model path {str(path)!r} has no config.json; expected a Hugging Face checkpoint directory")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ConfigError(f"{config_file} is not a JSON object: {error}") from error
    if model_type not in spec.model_types:
        owner = family_for_model_type(model_type)
        hint = f"; use family {owner.name!r}" if owner else ""
        raise ConfigError(f"family {spec.name!r} does not match model_type {model_type!r} in {config_file}{hint}")
    try:
        return spec.config_class.from_pretrained(path, local_files_only=True)
    except (OSError, TypeError, ValueError, StrictDataclassError) as error:
        first = str(error).splitlines()[0] if str(error) else repr(error)
        raise ConfigError(f"{config_file} is not a valid {spec.config_class.__name__}: {first}") from error


def _load_pretrained(spec: ModelFamily, path: Path, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    pretrained_config(spec, path)
    try:
        return spec.model_class.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            use_safetensors=True,
        )
    except OSError as error:
        raise CheckpointError(
            f"cannot load the checkpoint in {str(path)!r} (safetensors weights expected): {error}"
        ) from error
    except (TypeError, ValueError, AssertionError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"transformers' {spec.model_class.__name__} cannot be built from {path}/config.json: "
                          f"{first}") from error

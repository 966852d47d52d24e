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

from ..errors import CheckpointError, ConfigError
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
    """A family's causal LM in train mode with `config.use_cache = False`.

    Exactly one of `path` (a local Hugging Face checkpoint directory; `seed` is then unused) or
    `config` (a mapping of the family's HF config keys; weights initialized from `seed`).
    With `grouped_experts`, MoE blocks are hyperparallel.moe.MoEBlocks: our router and
    GroupedExperts (same parameter names); without, transformers' own modules.
    `attn_implementation` None: the family's first (sdpa; eager for DeepSeek-V4, which supports
    nothing else). `materialize=False` leaves it on the meta device: shapes and dtypes, no weights read or
    initialized (what `hyperparallel plan` measures).
    """
    spec = get_family(family)
    if (path is None) == (config is None):
        raise ConfigError(
            "build_model needs exactly one of path= (a local checkpoint directory) or config= (a mapping of HF config keys)"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16; got {dtype!r}")
    if attn_implementation is None:
        attn_implementation = spec.attn_implementations[0]
    valid_attention = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if attn_implementation not in valid_attention:
        raise ConfigError(f"attn_implementation {attn_implementation!r} is not one of {', '.join(valid_attention)}")
    if attn_implementation in ("sdpa", "eager") and attn_implementation not in spec.attn_implementations:
        raise ConfigError(f"attn_implementation {attn_implementation!r}: transformers' {spec.name} supports "
                          f"{', '.join(spec.attn_implementations)} only")

    if config is not None or not materialize:
        hf_config = make_config(spec, config) if config is not None else pretrained_config(spec, path)
        with torch.device("meta"):
            model = spec.model_class._from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
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


@functools.cache
def _known_config_keys(config_class: type[PretrainedConfig]) -> list[str]:
    fields = set(config_class().to_dict())
    fields |= set(inspect.signature(config_class.__init__).parameters) - {"self", "args", "kwargs"}
    fields |= set(getattr(config_class, "attribute_map", {}))
    fields |= _LEGACY_CONFIG_KEYS
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
    except (OSError, TypeError, ValueError) as error:
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

"""What transformers ships: every causal-LM model type, and which of them are text decoder-only
models the trainer takes. Read from transformers' own Auto mappings and classes, so a type
transformers adds is here the day it ships.

A causal-LM type is left out, with its reason, when transformers' classes say it is not a
decoder-only language model over text:
- an encoder-decoder (its config's `is_encoder_decoder`);
- an encoder that a causal-LM head runs causally only with `is_decoder=True` (BERT and its kin,
  the decoders of encoder-decoder models), or a masked language model (its type is also in
  transformers' masked-LM mapping);
- a multimodal model (its config nests vision, audio or image-token configs), whose text model,
  where transformers has one of its own, is a type of its own (`gemma3_text` for `gemma3`);
- a model whose forward does not compute transformers' causal-LM loss (`self.loss_function`,
  which predicts each next token): XLNet's and CPM-Ant's losses read unshifted labels, Gemma 4's
  assistants (draft models) compute none.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

_MULTIMODAL_PARTS = ("vision", "audio", "vq", "image", "speech", "video")


@functools.cache
def causal_lm_types() -> dict[str, tuple[str, str]]:
    """model_type -> (config class name, causal-LM class name), for every type of transformers'
    causal-LM mapping."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {model_type: (CONFIG_MAPPING_NAMES[model_type], model)
            for model_type, model in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
            if isinstance(model, str) and model_type in CONFIG_MAPPING_NAMES}


@functools.cache
def left_out(model_type: str) -> str | None:
    """Why `model_type`, a causal-LM type of transformers, is not a text decoder-only model (None:
    it is one)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    config_name, model_name = causal_lm_types()[model_type]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    if _default(config_class, "is_encoder_decoder"):
        return "an encoder-decoder model (its causal-LM class is its decoder)"
    if "is_decoder" in inspect.getsource(model_class.__init__):
        return "an encoder, or an encoder-decoder's decoder, that runs causally only with is_decoder=True"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "a masked language model"
    nested = [name for name in getattr(config_class, "sub_configs", {}) or {}
              if any(part in name for part in _MULTIMODAL_PARTS)]
    if nested:
        text = f"{model_type}_text"
        own = f"; its text model is {text!r}" if text in causal_lm_types() else ""
        return f"a multimodal model ({', '.join(nested)}){own}"
    if "loss_function" not in inspect.getsource(model_class.forward):
        return (f"a model whose forward does not compute transformers' causal-LM loss ({model_name}.forward "
                f"never calls self.loss_function, which predicts each next token)")
    return None


def text_decoder_types() -> list[str]:
    """The causal-LM types that are text decoder-only models (what `model.family` may name)."""
    return [model_type for model_type in causal_lm_types() if left_out(model_type) is None]


def _default(config_class, field: str):
    fields = getattr(config_class, "__dataclass_fields__", {})
    if field in fields and fields[field].default is not dataclasses.MISSING:
        default = fields[field].default
        return default if not callable(default) else None
    return getattr(config_class, field, None)

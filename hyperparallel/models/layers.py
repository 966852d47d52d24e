"""Where a Hugging Face causal LM keeps its decoder layers, found from the model itself.

transformers names, per model class, the blocks it never splits across devices
(`_no_split_modules`): its decoder layers (and, in some, their parts). The decoder layers are the
longest nn.ModuleList whose every entry is one of those classes: `model.layers` in Llama-like
models, `transformer.h` in GPT-2, `gpt_neox.layers`, `backbone.layers` in Mamba, mixed attention
and state-space layers in Jamba. FSDP shards, recompute and torch.compile wrap, and tensor
parallelism walks each of them; nothing names a family's attribute path.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

from torch import nn

from ..errors import ConfigError


class LayerOnAnotherStage(nn.Module):
    """The place of a decoder layer another pipeline stage holds (parallel/pipeline.py): no
    parameters, so the layers this rank holds keep their names (`model.layers.5` stays 5). The
    model's loop may pass through it on the way to this stage's layers; what it returns is
    replaced by the previous stage's activations before the first layer held here."""

    def __init__(self, index: int, returns_tuple: bool):
        super().__init__()
        self.index = index
        self.returns_tuple = returns_tuple  # (what the model's loop unpacks from its layers)

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.returns_tuple else hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index}, held by another pipeline stage"


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers as it is, with the places of layers other pipeline
    stages hold (LayerOnAnotherStage); ConfigError naming the class where it has none."""
    layers = _find_layers(model)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} has no decoder layers hyperparallel can find: no nn.ModuleList of "
                          f"its _no_split_modules classes ({', '.join(_no_split(model)) or 'none declared'})")
    return layers


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face causal LM this rank holds (see the module docstring;
    all of them but under pipeline parallelism), in order; ConfigError naming the class where it
    has none."""
    return [layer for layer in layer_list(model) if not isinstance(layer, LayerOnAnotherStage)]


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Each decoder layer's qualified name in `model` (what checkpoints and plans call it), of the
    layers this rank holds."""
    layers = layer_list(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return [f"{prefix}.{i}" for i, layer in enumerate(layers) if not isinstance(layer, LayerOnAnotherStage)]


def _no_split(model: nn.Module) -> set[str]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():  # (a composite model's inner PreTrainedModels declare their own)
        names |= set(getattr(module, "_no_split_modules", None) or ())
    return names


def _find_layers(model: nn.Module) -> nn.ModuleList | None:
    blocks = _no_split(model)
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)]
    declared = [m for m in lists if all(type(layer).__name__ in blocks or isinstance(layer, LayerOnAnotherStage)
                                        for layer in m) and not all(isinstance(layer, LayerOnAnotherStage) for layer in m)]
    if declared:
        return max(declared, key=len)  # (the first of the longest: the outermost list)
    # no class declared: the longest list of one class of block (models whose class sets no
    # _no_split_modules)
    uniform = [m for m in lists if len({type(layer) for layer in m}) == 1 and not isinstance(m[0], nn.ModuleList)]
    return max(uniform, key=len) if uniform else None


def layer_configs(config) -> list:
    """The config each decoder layer is built from: transformers' heterogeneous configs
    (`per_layer_config`: DOTS-3, Gemma 4) let attributes such as the head counts vary by layer and
    refuse to give them globally; any other config is every layer's."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config]


def layer_config(config, index: int | None):
    """Decoder layer `index`'s config (the config itself where it is uniform, or no index is known)."""
    if getattr(config, "is_heterogeneous", False) and isinstance(index, int):
        return config.per_layer_config[index]
    return config


def config_values(config, key: str) -> set:
    """`key`'s values over the decoder layers' configs (one for a uniform config), None left out."""
    return {value for layer in layer_configs(config) if (value := getattr(layer, key, None)) is not None}


def config_value(config, key: str, default=None):
    """`key`'s value where every decoder layer has the same (the config's own for a uniform
    config), else `default`."""
    values = config_values(config, key)
    return next(iter(values)) if len(values) == 1 else default


def attention_window(module: nn.Module, config) -> int | None:
    """An attention module's sliding window (None for full attention), as the module hands it to
    its kernel; `config`: the model's (text) config."""
    if getattr(module, "is_sliding", None) is False:  # (Exaone-4 keeps the window and passes it when sliding)
        return None
    if hasattr(module, "sliding_window"):  # most set it per layer: the config's window or None
        return positive_int(module.sliding_window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = layer_type(module, config) == "sliding_attention"
        return positive_int(getattr(config, "sliding_window", None)) if sliding else None
    # Mistral, Mixtral, Phi-3: every layer passes the config's window
    return positive_int(getattr(config, "sliding_window", None))


def layer_type(module: nn.Module, config) -> str | None:
    """The config's layer_types entry of the layer `module` belongs to (or the module's own)."""
    own = getattr(module, "layer_type", None)
    if isinstance(own, str):
        return own
    layer_types, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(layer, int) and isinstance(layer_types, (list, tuple)) and 0 <= layer < len(layer_types):
        return layer_types[layer]
    return None


def positive_int(value) -> int | None:
    """`value` where it is an int above 0 (a config's size or count that is set), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def text_config(model: nn.Module):
    """The config of `model`'s text decoder: a multimodal model's language model's, else its own
    (None: a module without a transformers config)."""
    config = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None


# Class names of token mixers that run over the whole sequence apart from attention (state-space,
# linear-attention, recurrent and convolutional layers, and the indexers of DeepSeek sparse
# attention, which score every key to pick the ones attended to): a sequence split over ranks
# would cut them, and a document's restarting positions do not reset them (the indexers aside:
# they score keys under the model's own mask, `token_mixers(indexers=False)`).
SEQUENCE_MIXERS = re.compile(r"Mamba|Mixer|SSM|LinearAttention|GatedDeltaNet|DeltaNet|DeltaAttention|ShortConv|"
                             r"(?<!^)Recurrent|Rglru|RWKV|Rwkv|LSTM|Lightning|Hyena|Indexer")
# (case matters: SeedOssMLP is no SSM; nor is RecurrentGemmaMlp a recurrent layer)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS):
    Hugging Face's attention layers, whatever their attributes."""
    return [m for m in model.modules() if _source_has(type(m), "ALL_ATTENTION_FUNCTIONS")]


def token_mixers(layer: nn.Module, *, indexers: bool = True) -> list[str]:
    """The class names of what mixes tokens in `layer` besides attention through transformers'
    interface: `SEQUENCE_MIXERS` and convolutions over the sequence (nn.Conv1d: Zaya's CCA);
    `indexers` False leaves DeepSeek sparse attention's indexers out (they score keys under the
    model's own mask)."""
    named = {type(m).__name__ for m in layer.modules()
             if m is not layer and SEQUENCE_MIXERS.search(type(m).__name__)}
    convolutions = {type(m).__name__ for m in layer.modules() if isinstance(m, nn.modules.conv._ConvNd)}
    return [*sorted(n for n in named if indexers or not n.endswith("Indexer")), *sorted(convolutions - named)]


def document_mask_problem(model: nn.Module) -> str | None:
    """Why packed documents whose positions restart would still see each other in `model` (on the
    meta device is enough), or None: transformers masks attention between them (masking_utils,
    from the position ids), which keeps them apart only where every token mixer is attention
    through its interface (a recurrent, convolutional or linear-attention mixer carries its state
    along the whole row) and every causal mask the model builds is given the position ids."""
    attention = {id(m) for m in attention_modules(model)}
    for i, layer in enumerate(decoder_layers(model)):
        mixers = token_mixers(layer, indexers=False)
        if mixers:
            return f"decoder layer {i}'s {mixers[0]} carries its state along the whole row, whatever the positions say"
        if not any(id(m) in attention for m in layer.modules()):
            return f"decoder layer {i} mixes tokens without attention through transformers' attention interface"
    calls = [(type(m).__name__, given) for m in model.modules() for given in _mask_calls(type(m))]
    if not calls:
        return f"{type(model).__name__} does not build its attention masks from the position ids"
    without = next((name for name, given in calls if not given), None)
    if without is not None:
        return f"{without} builds a causal mask without the position ids"
    return None


_MASK_FUNCTION = re.compile(r"^create_\w*mask")
_NOT_CAUSAL = {"create_bidirectional_mask"}  # (an encoder's or a cross-attention's mask)


@functools.cache
def _mask_calls(cls: type) -> tuple[bool, ...]:
    """For each call in `cls.forward` of one of masking_utils' causal create_*mask functions (by
    name, or through a variable or table it assigned them to): whether it hands it the position ids
    (as a keyword, or in a dict of keyword arguments passed as **kwargs; not the constant None)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return ()
    names = lambda node: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}  # noqa: E731
    functions = {name for name in names(tree) if _MASK_FUNCTION.match(name) and name not in _NOT_CAUSAL}
    with_positions = set()  # variables holding keyword arguments that include the position ids
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            if names(value) & functions:  # (mask_function = create_causal_mask if ... else ...)
                functions.add(target)
            if isinstance(value, ast.Dict) and any(
                    (isinstance(k, ast.Constant) and k.value == "position_ids" and not _is_none(v))
                    or (k is None and isinstance(v, ast.Name) and v.id in with_positions)  # ({**mask_kwargs, ...})
                    for k, v in zip(value.keys, value.values, strict=True)):
                with_positions.add(target)
            copied = value.func.value if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
                and value.func.attr == "copy" else None  # (sliding_kwargs = mask_kwargs.copy())
            if isinstance(copied, ast.Name) and copied.id in with_positions:
                with_positions.add(target)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.value if isinstance(node.func, ast.Subscript) else node.func  # (table[layer_type](...))
        if isinstance(callee, ast.Name) and callee.id in functions and (node.args or node.keywords):
            # (a call with no arguments runs a table's thunk, `lambda: create_causal_mask(**kw)`, whose own call counts)
            calls.append(any((k.arg == "position_ids" and not _is_none(k.value)) or (
                k.arg is None and isinstance(k.value, ast.Name) and k.value.id in with_positions) for k in node.keywords))
    return tuple(calls)


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


@functools.cache
def _source_has(cls: type, pattern: str | re.Pattern) -> bool:
    """Whether `cls.forward`'s source contains `pattern` (a string, or a compiled regex)."""
    try:
        source = inspect.getsource(cls.forward)
    except (AttributeError, OSError, TypeError):
        return False
    return pattern in source if isinstance(pattern, str) else pattern.search(source) is not None

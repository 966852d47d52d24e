"""torch.compile per decoder layer, the way large-model trainers compile (one graph per block).

Each layer's `forward` is replaced on the instance by its compiled version, so module names,
state-dict keys and module hooks (FSDP's gathers run in them) stay outside the graph and as they
were. With Inductor, MXFP8 modules (lowp) are left out of the graphs and run as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .layers import decoder_layers

BACKENDS = ("none", "inductor", "dvm")


def compile_layers(model: nn.Module, backend: str) -> int:
    """Compile every decoder layer (layers.py finds them) with `backend`; returns how many."""
    if backend not in BACKENDS:
        raise ConfigError(f"training.compile must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "none":
        return 0
    if backend == "dvm":
        import hyperparallel.fusion  # noqa: F401  (registers the "dvm" backend)
    layers = decoder_layers(model)
    from hyperparallel.lowp import MXLinear, is_mx_experts  # (here: training.compile's choices load without lowp)

    for layer in layers:
        # MXFP8 modules run between the graphs, as they are, with every backend: Inductor's CPU code
        # generator has no float8_e8m0fnu (the MX scales' dtype; it fails with a KeyError), and
        # under FSDP their weights' MX copies are gathered state a trace cannot hold (lowp/gather.py)
        for module in layer.modules():
            if isinstance(module, MXLinear) or is_mx_experts(module):
                module.forward = torch.compiler.disable(module.forward, recursive=True)
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)

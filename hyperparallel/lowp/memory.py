"""How many bytes autograd keeps between forward and backward: the activation memory that
low precision and recompute are meant to cut."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_activation_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every tensor autograd saves while `forward()` runs; a tensor saved twice counts
    twice. Tensors sharing storage with one in `exclude` (say, the model's parameters, which
    exist anyway) are not counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in skip:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total

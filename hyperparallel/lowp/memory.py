"""How many bytes autograd keeps between forward and backward: the activation memory that
low precision and recompute are meant to cut."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_activation_bytes(forward: Callable[[], object]) -> int:
    """Bytes of every tensor autograd saves while `forward()` runs (parameters it saves included;
    a tensor saved twice counts twice, as it is referenced twice)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total

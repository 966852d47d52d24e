"""Weight generations: a count, per tensor, of the times its values were replaced wholesale.

Caches of derived copies (the FP8 copies of a weight that MXLinear and MX experts keep across
micro-batches and recompute) are keyed on a weight's generation together with its `_version`.
`_version` counts in-place writes through autograd-visible ops; a generation covers the writes
that do not bump it: a fused optimizer's kernel (torch's fused AdamW), and a sharded-data-parallel
gather that refills a full parameter from new shards. Those writers call `bump`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_ATTRIBUTE = "_hp_generation"
_hook = None


def generation(t: torch.Tensor) -> int:
    return getattr(t, _ATTRIBUTE, 0)


def bump(tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        setattr(t, _ATTRIBUTE, generation(t) + 1)


def _bump_stepped(optimizer, args, kwargs) -> None:
    bump(p for group in optimizer.param_groups for p in group["params"])


def watch_optimizers() -> None:
    """Every optimizer step from now on bumps the generation of the parameters it updated.

    Called by the caches on first use (not at import): a process without them pays nothing."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_bump_stepped)


def key(t: torch.Tensor) -> tuple:
    """What a copy derived from `t` is valid for: its storage, dtype, version and generation."""
    return t.data_ptr(), t.dtype, t._version, generation(t)

"""The dtype a module's products run in: torch.autocast's for the input's device when it is on (as
nn.Linear's under autocast), else the input's own."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return torch.get_autocast_dtype(device)
    return x.dtype

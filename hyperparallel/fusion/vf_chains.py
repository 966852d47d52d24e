"""The element-wise chains DVM's VFs are made for, as a model's Python writes them.

One list serves three users: scripts/dvm_vf_harvest.py lowers each chain (forward, and backward where it has
gradients; fp32 and bf16) to collect the segments the VF table must hold, tests/fusion/test_vf.py
checks the table holds them and that VFs and the per-op path agree bit for bit on each, and
benchmarks/fusion.py times them. The default model's decoder layers and the fused loss chunk are
harvested too (by that script), so the table also covers what the trainer compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def silu(x):
    return x * torch.sigmoid(x)


def silu_mul(x, y):
    return x * torch.sigmoid(x) * y


def swiglu(gate, up):
    return F.silu(gate) * up


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476))


def sigmoid(x):
    return torch.sigmoid(x)


def softmax(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def rmsnorm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def cast_chain(x):
    y = x.float()
    return (torch.tanh(y * 0.5 + 0.1) * y).to(x.dtype)


def residual_scale(x, residual):
    return residual + x * 0.5


@dataclass(frozen=True)
class Chain:
    name: str
    fn: Callable
    make: Callable[[int, int, torch.dtype, torch.Generator], tuple]  # (rows, cols, dtype, generator) -> inputs
    native: Callable | None = None  # PyTorch's own fused op for it, where there is one (benchmarks)


def _one(rows, cols, dtype, g):
    return (torch.randn(rows, cols, generator=g).to(dtype),)


def _two(rows, cols, dtype, g):
    return torch.randn(rows, cols, generator=g).to(dtype), torch.randn(rows, cols, generator=g).to(dtype)


def _with_weight(rows, cols, dtype, g):
    return torch.randn(rows, cols, generator=g).to(dtype), torch.randn(cols, generator=g).to(dtype)


def _rotary_inputs(rows, cols, dtype, g):
    """q as [batch, heads, seq, head_dim] (rows = batch * heads * seq), cos / sin [seq, head_dim]."""
    heads, seq = 4, max(1, rows // 4)
    q = torch.randn(1, seq, heads, cols, generator=g).to(dtype).transpose(1, 2)  # as attention lays it out
    angles = torch.randn(seq, cols, generator=g)
    return q, angles.cos().to(dtype), angles.sin().to(dtype)


def _rms_norm_native(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


CHAINS = [
    Chain("SiLU", silu, _one, F.silu),
    Chain("SiLU-mul", silu_mul, _two, lambda x, y: F.silu(x) * y),
    Chain("SwiGLU", swiglu, _two),
    Chain("GELU-tanh", gelu_tanh, _one, lambda x: F.gelu(x, approximate="tanh")),
    Chain("GELU-erf", gelu_erf, _one, F.gelu),
    Chain("sigmoid", sigmoid, _one),
    Chain("softmax", softmax, _one, lambda x: torch.softmax(x, -1)),
    Chain("RMSNorm", rmsnorm, _with_weight, _rms_norm_native),
    Chain("rotary", rotary, _rotary_inputs),
    Chain("cast chain", cast_chain, _one),
    Chain("residual add + scale", residual_scale, _two),
]
BY_NAME = {c.name: c for c in CHAINS}

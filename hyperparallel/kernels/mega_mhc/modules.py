"""MegaMHC's modules: MegaHyperConnection and MegaHyperHead take over the Parameters of
transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead (no copy) and run the fused
mhc_pre and mhc_head (models.deepseek_v4 swaps them into DeepSeek-V4's decoder layers)."""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.errors import ShapeError
from hyperparallel.kernels.mega_mhc.op import mhc_head, mhc_pre


def _hf_shape(module: nn.Module, fn_name: str, rows) -> tuple[int, int]:
    """(N, D) of an HF hyper-connection module, checked against its parameters."""
    n = module.hc_mult
    fn = getattr(module, fn_name)
    if fn.dim() != 2 or fn.shape[1] % n or fn.shape[0] != rows(n):
        raise ShapeError(f"{type(module).__name__}.{fn_name} has shape {tuple(fn.shape)}; hc_mult={n} needs "
                         f"[{rows(n)}, {n} * hidden_size]")
    return n, fn.shape[1] // n


def hf_norm_eps(norm: nn.Module) -> float:
    """The epsilon of an HF DeepseekV4UnweightedRMSNorm: `eps` up to transformers 5.24,
    `variance_epsilon` (as every other RMSNorm of transformers names it) from 5.25."""
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    raise ShapeError(f"{type(norm).__name__} has neither `variance_epsilon` nor `eps`: a transformers release "
                     "MegaMHC does not know (set kernels.mega_mhc: false)")


class MegaHyperConnection(nn.Module):
    """DeepseekV4HyperConnection on MegaMHC's fused mhc_pre: the same Parameters (fn, base, scale)
    and the same outputs (post, comb, collapsed)."""

    def __init__(self, hc_mult: int, hidden_size: int, *, sinkhorn_iters: int = 20, hc_eps: float = 1e-6,
                 norm_eps: float = 1e-6, device=None, dtype=torch.float32):
        super().__init__()
        self.hc_mult = hc_mult
        self.hidden_size = hidden_size
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        factory = {"device": device, "dtype": dtype}
        weights = (2 + hc_mult) * hc_mult  # pre (N), post (N), comb (N * N)
        self.fn = nn.Parameter(torch.empty(weights, hc_mult * hidden_size, **factory))
        self.base = nn.Parameter(torch.empty(weights, **factory))
        self.scale = nn.Parameter(torch.empty(3, **factory))

    @classmethod
    def from_hf(cls, hc: nn.Module) -> MegaHyperConnection:
        """Take over a DeepseekV4HyperConnection's Parameter objects (no copy, any device, meta included)."""
        n, hidden = _hf_shape(hc, "fn", lambda n: (2 + n) * n)
        with torch.device("meta"):
            mega = cls(n, hidden, sinkhorn_iters=hc.hc_sinkhorn_iters, hc_eps=hc.hc_eps, norm_eps=hf_norm_eps(hc.input_norm))
        mega.fn, mega.base, mega.scale = hc.fn, hc.base, hc.scale
        return mega

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # transformers' _init_weights for DeepseekV4HyperConnection, in its order
        nn.init.normal_(self.fn, mean=0.0, std=std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., N, D] -> (post [..., N], comb [..., N, N], collapsed [..., D])."""
        *lead, n, d = hidden_streams.shape
        post, comb, collapsed = mhc_pre(hidden_streams.reshape(-1, n, d), self.fn, self.base, self.scale,
                                        sinkhorn_iters=self.sinkhorn_iters, hc_eps=self.hc_eps,
                                        norm_eps=self.norm_eps)
        return post.view(*lead, n), comb.view(*lead, n, n), collapsed.view(*lead, d)

    def extra_repr(self) -> str:
        return (f"hc_mult={self.hc_mult}, hidden_size={self.hidden_size}, sinkhorn_iters={self.sinkhorn_iters}, "
                f"hc_eps={self.hc_eps}, norm_eps={self.norm_eps}")


class MegaHyperHead(nn.Module):
    """DeepseekV4HyperHead on MegaMHC's fused mhc_head: the same Parameters (hc_fn, hc_base,
    hc_scale) and the same output."""

    def __init__(self, hc_mult: int, hidden_size: int, *, hc_eps: float = 1e-6, norm_eps: float = 1e-6,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.hc_mult = hc_mult
        self.hidden_size = hidden_size
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        factory = {"device": device, "dtype": dtype}
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, **factory))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, **factory))
        self.hc_scale = nn.Parameter(torch.empty(1, **factory))

    @classmethod
    def from_hf(cls, head: nn.Module) -> MegaHyperHead:
        """Take over a DeepseekV4HyperHead's Parameter objects (no copy, any device, meta included)."""
        n, hidden = _hf_shape(head, "hc_fn", lambda n: n)
        with torch.device("meta"):
            mega = cls(n, hidden, hc_eps=head.eps, norm_eps=hf_norm_eps(head.input_norm))
        mega.hc_fn, mega.hc_base, mega.hc_scale = head.hc_fn, head.hc_base, head.hc_scale
        return mega

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # transformers' _init_weights for DeepseekV4HyperHead, in its order
        nn.init.normal_(self.hc_fn, mean=0.0, std=std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N, D] -> [..., D]."""
        *lead, n, d = x.shape
        out = mhc_head(x.reshape(-1, n, d), self.hc_fn, self.hc_base, self.hc_scale, hc_eps=self.hc_eps,
                       norm_eps=self.norm_eps)
        return out.view(*lead, d)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc_mult}, hidden_size={self.hidden_size}, hc_eps={self.hc_eps}, norm_eps={self.norm_eps}"


__all__ = ["MegaHyperConnection", "MegaHyperHead"]

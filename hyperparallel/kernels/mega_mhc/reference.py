"""MegaMHC in torch ops: transformers' operations one for one (the specification every fused
backend is held to; differentiable through autograd; the mix in fp32), and the checks of every
argument a caller can get wrong (run before any kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.kernels.mega_mhc.native import MAX_STREAMS

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------- checks


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def _check_streams(streams, where: str) -> tuple[int, int, int]:
    if not isinstance(streams, torch.Tensor) or streams.dim() != 3 or streams.dtype not in _FLOATS:
        raise ShapeError(f"{where} streams must be a [tokens, streams, hidden] float32, bfloat16 or float16 "
                         f"tensor; got {_describe(streams)}")
    T, N, D = streams.shape
    if not 1 <= N <= MAX_STREAMS:
        raise ShapeError(f"{where} streams has {N} streams (dimension 1); the fused kernels take 1 to "
                         f"{MAX_STREAMS}")
    if D < 1:
        raise ShapeError(f"{where} streams has hidden size 0 (dimension 2)")
    return T, N, D


def _check_tensor(where: str, name: str, t, shape: tuple[int, ...], device: torch.device) -> None:
    if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.dtype.is_floating_point
            or t.device != device):
        raise ShapeError(f"{where} {name} must be a {list(shape)} floating-point tensor on {device}; "
                         f"got {_describe(t)}")


def _check_iters(where: str, sinkhorn_iters) -> None:
    if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ConfigError(f"{where} sinkhorn_iters must be an integer >= 1; got {sinkhorn_iters!r}")


def check_pre(streams, fn, base, scale, sinkhorn_iters) -> None:
    T, N, D = _check_streams(streams, "mhc_pre")
    M = (2 + N) * N
    for name, t, shape in (("fn", fn, (M, N * D)), ("base", base, (M,)), ("scale", scale, (3,))):
        _check_tensor("mhc_pre", name, t, shape, streams.device)
    _check_iters("mhc_pre", sinkhorn_iters)


def check_head(streams, hc_fn, hc_base, hc_scale) -> None:
    T, N, D = _check_streams(streams, "mhc_head")
    for name, t, shape in (("hc_fn", hc_fn, (N, N * D)), ("hc_base", hc_base, (N,)), ("hc_scale", hc_scale, (1,))):
        _check_tensor("mhc_head", name, t, shape, streams.device)


def check_post(block_out, streams, post, comb) -> None:
    T, N, D = _check_streams(streams, "mhc_post")
    for name, t, shape in (("block_out", block_out, (T, D)), ("post", post, (T, N)), ("comb", comb, (T, N, N))):
        _check_tensor("mhc_post", name, t, shape, streams.device)


# ------------------------------------------------------------------------------- reference
# transformers' operations, one for one (differentiable through autograd); the mix in fp32.


def _normed_projection(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.float())


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_pre_reference(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                      sinkhorn_iters: int, hc_eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_pre in torch ops: DeepseekV4HyperConnection.forward for tokens [T, N, D]."""
    N = streams.shape[1]
    mixes = _normed_projection(streams, fn, norm_eps)
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.float().split([N, N, N * N])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (N, N)) * comb_s + comb_b.view(N, N), dim=-1) + hc_eps
    return post, _sinkhorn(comb, sinkhorn_iters, hc_eps), _collapse(pre, streams)


def mhc_head_reference(streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *,
                       hc_eps: float, norm_eps: float) -> torch.Tensor:
    """mhc_head in torch ops: DeepseekV4HyperHead.forward for tokens [T, N, D]."""
    mixes = _normed_projection(streams, hc_fn, norm_eps)
    pre = torch.sigmoid(mixes * hc_scale.float() + hc_base.float()) + hc_eps
    return _collapse(pre, streams)


def mhc_post_reference(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                       comb: torch.Tensor) -> torch.Tensor:
    """mhc_post in torch ops: post_k block_out + sum_j comb_jk streams_j, in fp32, then rounded."""
    mixed = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(
        comb.float().transpose(-1, -2), streams.float())
    return mixed.to(streams.dtype)


__all__ = ["check_head", "check_post", "check_pre", "mhc_head_reference", "mhc_post_reference", "mhc_pre_reference"]

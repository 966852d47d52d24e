"""MegaMHC: DeepSeek-V4's manifold-constrained hyper-connections as fused operations.

transformers' DeepseekV4HyperConnection turns a token's N residual streams [N, D] into three sets
of weights and the input of the next block: an unweighted RMSNorm of the flattened streams, a
projection by fn [(2 + N) N, N D], then pre = sigmoid(.) + eps, post = 2 sigmoid(.) and
comb = Sinkhorn-Knopp(softmax(.) + eps), and the collapse sum_n pre_n x_n. After the block its
decoder layer expands and mixes: out_k = post_k block_out + sum_j comb_jk x_j. Eager PyTorch runs
some 60 small operations for that, each keeping its inputs for backward. Here it is three fused
operations, each forward and backward:

  mhc_pre(streams, fn, base, scale, ...)   -> (post [T, N], comb [T, N, N], collapsed [T, D])
  mhc_post(block_out, streams, post, comb) -> the mixed streams [T, N, D]
  mhc_head(streams, hc_fn, hc_base, hc_scale, ...) -> collapsed [T, D] (DeepseekV4HyperHead)

and two modules that take over transformers' Parameters: MegaHyperConnection, MegaHyperHead.

Backends, chosen by the streams' device: the native C kernels on CPU tensors (csrc/mega_mhc.c,
float32 and bfloat16; float16 and an unbuilt library run the reference), Triton on CUDA tensors
(`mega_mhc_triton`), and the pure-torch references (`mhc_pre_reference`, ..., the specification
in code) on any other device. The native and Triton paths are `torch.library` custom ops with
fake implementations and their backward as custom ops too, so torch.compile traces them whole.

[Note: the projection] rmsnorm-then-linear is (x . fn^T) r with r = rsqrt(mean(x^2) + eps): one
pass over a token's row gives both z = x . fn^T and the sum of squares. Backward, with
gz = (dL/da) r for a = z r, needs grad_x = gz . fn - (r^2 / K)(gz . z) x + the collapse's term,
and grad_fn = gz^T . x.

[Note: what backward keeps] mhc_pre keeps z [T, M] and r [T] (fp32, some 100 bytes a token) and
references to its inputs; the weights and all Sinkhorn iterates are recomputed per token in
backward, which differentiates exactly the finite iterations forward ran. mhc_post and mhc_head
keep only their inputs. transformers' modules keep several fp32 copies of the streams.

[Note: precision] Everything is computed in fp32 and rounded once to the output's dtype.
transformers computes the collapse in fp32 too, but the mix in the streams' dtype (post and comb
rounded to it first), so for bf16 streams the mix here is the more exact of the two; for fp32
they agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.models import mega_mhc_native as native
from hyperparallel.models import mega_mhc_triton as triton_mhc
from hyperparallel.mx.backends.host_cache import empty as host_empty

BACKENDS = ("native", "triton", "reference")
MAX_STREAMS = native.MAX_STREAMS  # the most streams the fused kernels take
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


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


def _check_pre(streams, fn, base, scale, sinkhorn_iters) -> None:
    T, N, D = _check_streams(streams, "mhc_pre")
    M = (2 + N) * N
    for name, t, shape in (("fn", fn, (M, N * D)), ("base", base, (M,)), ("scale", scale, (3,))):
        _check_tensor("mhc_pre", name, t, shape, streams.device)
    _check_iters("mhc_pre", sinkhorn_iters)


def _check_head(streams, hc_fn, hc_base, hc_scale) -> None:
    T, N, D = _check_streams(streams, "mhc_head")
    for name, t, shape in (("hc_fn", hc_fn, (N, N * D)), ("hc_base", hc_base, (N,)), ("hc_scale", hc_scale, (1,))):
        _check_tensor("mhc_head", name, t, shape, streams.device)


def _check_post(block_out, streams, post, comb) -> None:
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


# ------------------------------------------------------------------------- backward, shared
# Both fused backends run the pre backward in the same three steps: a kernel for the per-token
# weights (gu, the gradient w.r.t. u = a * scale + base), small [T, M] torch ops for gz, coef and
# the base and scale gradients, a kernel for grad_x and grad_fn (see [Note: the projection]).


def _groups(N: int, head: bool) -> list[int]:
    return [N] if head else [N, N, N * N]


def _finish_pre_backward(kernels, x, fn, base, scale, z, r, g_post, g_comb, g_col, iters, hc_eps, head, need_x,
                         need_params):
    T, N, D = x.shape
    groups = _groups(N, head)
    gu, pre = kernels.weights_backward(x, z, r, base, scale, g_post, g_comb, g_col, iters, hc_eps, head)
    per_weight_scale = torch.cat([s.expand(g) for s, g in zip(scale.float().unbind(0), groups, strict=True)])
    gz = gu * per_weight_scale * r[:, None]
    coef = (gz * z).sum(dim=1) * (r * r / (N * D))
    grad_x, grad_fn = kernels.inputs_backward(x, fn, gz, coef, pre, g_col, need_x, need_params)
    empty = x.new_empty(0, dtype=torch.float32)
    if not need_params:
        return grad_x, grad_fn, empty, empty
    grad_base = gu.sum(dim=0)
    grad_scale = torch.stack([part.sum() for part in (gu * (z * r[:, None])).split(groups, dim=1)])
    return grad_x, grad_fn, grad_base, grad_scale


# --------------------------------------------------------------------------------- native


def _code(t: torch.Tensor) -> int:
    return native.DTYPE_CODES[str(t.dtype).removeprefix("torch.")]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _raise_for(status: int, what: str) -> None:
    if status == native.NO_MEMORY:
        raise MemoryError(f"{what}: the native kernel could not allocate its buffers")
    if status != native.OK:
        raise ShapeError(f"{what}: the native kernel refused its arguments (status {status})")


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the kernels read it. Callers keep the result in a variable until the kernel has run:
    a converted copy passed as _ptr(_f32(t)) would be freed before the call."""
    return None if t is None else t.float().contiguous()


class _Native:
    """The native kernels (csrc/mega_mhc.c) behind the ops' common signatures."""

    @staticmethod
    def pre_forward(x, fn, base, scale, iters, hc_eps, norm_eps, head):
        x = x.contiguous()
        T, N, D = x.shape
        M = fn.shape[0]
        fn, base, scale = _f32(fn), _f32(base), _f32(scale)  # (held: the kernel reads them)
        post, comb, collapsed, z, r = _pre_outputs(x, M, head, empty=_host_empty)
        status = native.LIB.hp_mega_mhc_pre_forward(
            _ptr(x), _code(x), T, N, D, _ptr(fn), _ptr(base), _ptr(scale), int(head), iters,
            hc_eps, norm_eps, _ptr(z), _ptr(r), _ptr(post), _ptr(comb), _ptr(collapsed), _code(collapsed),
            torch.get_num_threads())
        _raise_for(status, "mhc_head" if head else "mhc_pre")
        return post, comb, collapsed, z, r

    @staticmethod
    def weights_backward(x, z, r, base, scale, g_post, g_comb, g_col, iters, hc_eps, head):
        x = x.contiguous()
        T, N, D = x.shape
        g_col = None if g_col is None else g_col.to(x.dtype).contiguous()
        base, scale, g_post, g_comb = _f32(base), _f32(scale), _f32(g_post), _f32(g_comb)
        gu = x.new_empty(T, z.shape[1], dtype=torch.float32)
        pre = x.new_empty(T, N, dtype=torch.float32)
        status = native.LIB.hp_mega_mhc_pre_backward_weights(
            _ptr(x), _code(x), T, N, D, _ptr(z), _ptr(r), _ptr(base), _ptr(scale), int(head), iters,
            hc_eps, _ptr(g_post), _ptr(g_comb), _ptr(g_col), _code(x), _ptr(gu), _ptr(pre),
            torch.get_num_threads())
        _raise_for(status, "mhc_pre backward")
        return gu, pre

    @staticmethod
    def inputs_backward(x, fn, gz, coef, pre, g_col, need_x, need_fn):
        x = x.contiguous()
        T, N, D = x.shape
        g_col = None if g_col is None else g_col.to(x.dtype).contiguous()
        fn, gz, coef = _f32(fn), _f32(gz), _f32(coef)
        grad_x = host_empty(x.shape, x.dtype) if need_x else x.new_empty(0)
        grad_fn = fn.new_empty(fn.shape) if need_fn else fn.new_empty(0)
        status = native.LIB.hp_mega_mhc_pre_backward_inputs(
            _ptr(x), _code(x), T, N, D, _ptr(fn), fn.shape[0], _ptr(gz), _ptr(coef),
            _ptr(pre), _ptr(g_col), _code(x), _ptr(grad_x) if need_x else None, _code(x),
            _ptr(grad_fn) if need_fn else None, torch.get_num_threads())
        _raise_for(status, "mhc_pre backward")
        return grad_x, grad_fn

    @staticmethod
    def post_forward(block_out, x, post, comb):
        block_out, x = block_out.contiguous(), x.contiguous()
        T, N, D = x.shape
        post, comb = _f32(post), _f32(comb)
        out = host_empty(x.shape, x.dtype)
        status = native.LIB.hp_mega_mhc_post_forward(
            _ptr(block_out), _code(block_out), _ptr(x), _code(x), T, N, D, _ptr(post), _ptr(comb),
            _ptr(out), _code(out), torch.get_num_threads())
        _raise_for(status, "mhc_post")
        return out

    @staticmethod
    def post_backward(g, block_out, x, post, comb, need_bo, need_x, need_post, need_comb):
        block_out, x = block_out.contiguous(), x.contiguous()
        g = g.to(x.dtype).contiguous()
        T, N, D = x.shape
        g_bo, g_x, g_post, g_comb = _post_grads(block_out, x, post, comb, need_bo, need_x, need_post, need_comb,
                                                empty=_host_empty)
        post32, comb32 = _f32(post), _f32(comb)
        status = native.LIB.hp_mega_mhc_post_backward(
            _ptr(g), _code(g), _ptr(block_out), _code(block_out), _ptr(x), _code(x), T, N, D, _ptr(post32),
            _ptr(comb32), _ptr(g_bo) if need_bo else None, _code(block_out), _ptr(g_x) if need_x else None,
            _code(x), _ptr(g_post) if need_post else None, _ptr(g_comb) if need_comb else None,
            torch.get_num_threads())
        _raise_for(status, "mhc_post backward")
        return g_bo, g_x, g_post, g_comb


def _host_empty(*shape, dtype, device) -> torch.Tensor:
    """torch.empty's signature on the host buffer cache: large CPU outputs without fresh pages
    (glibc maps every large block anew; the page faults would cost more than the kernels)."""
    if len(shape) == 1 and not isinstance(shape[0], int):
        shape = tuple(shape[0])
    return host_empty(shape, dtype)


def _pre_outputs(x: torch.Tensor, M: int, head: bool, empty=torch.empty):
    """post [T, N], comb [T, N, N] (both [0] for the head), collapsed [T, D], z [T, M], r [T]."""
    T, N, D = x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    post = empty(0 if head else T, N, **f32)
    comb = empty(0 if head else T, N, N, **f32)
    return (post, comb, empty(T, D, dtype=x.dtype, device=x.device), empty(T, M, **f32), empty(T, **f32))


def _post_grads(block_out, x, post, comb, need_bo, need_x, need_post, need_comb, empty=torch.empty):
    """The gradients mhc_post's backward gives; [0] where one is not needed (ops return tensors)."""
    def like(t, needed, dtype=None):
        dtype = dtype or t.dtype
        return empty(t.shape if needed else (0,), dtype=dtype, device=t.device)
    return (like(block_out, need_bo), like(x, need_x), like(post, need_post, torch.float32),
            like(comb, need_comb, torch.float32))


# ------------------------------------------------------------------------------ custom ops
# For each fused backend: pre, head and post forward ops, a pre backward op (the head's too) and
# a post backward op, all with fake implementations.


def _define_ops(name: str, kernels):
    prefix = f"hyperparallel::mega_mhc_{{}}_{name}"

    @torch.library.custom_op(prefix.format("pre"), mutates_args=())
    def pre_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
        return kernels.pre_forward(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False)

    @pre_op.register_fake
    def _(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
        return _pre_outputs(streams, fn.shape[0], False)

    @torch.library.custom_op(prefix.format("head"), mutates_args=())
    def head_op(streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor,
             hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, _, collapsed, z, r = kernels.pre_forward(streams, hc_fn, hc_base, hc_scale, 1, hc_eps, norm_eps, True)
        return collapsed, z, r

    @head_op.register_fake
    def _(streams, hc_fn, hc_base, hc_scale, hc_eps, norm_eps):
        return _pre_outputs(streams, hc_fn.shape[0], True)[2:]

    @torch.library.custom_op(prefix.format("pre_backward"), mutates_args=())
    def pre_backward(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     z: torch.Tensor, r: torch.Tensor, g_post: torch.Tensor | None, g_comb: torch.Tensor | None,
                     g_col: torch.Tensor | None, sinkhorn_iters: int, hc_eps: float, head: bool, need_x: bool,
                     need_params: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _finish_pre_backward(kernels, streams, fn, base, scale, z, r, g_post, g_comb, g_col, sinkhorn_iters,
                                    hc_eps, head, need_x, need_params)

    @pre_backward.register_fake
    def _(streams, fn, base, scale, z, r, g_post, g_comb, g_col, sinkhorn_iters, hc_eps, head, need_x, need_params):
        f32 = {"dtype": torch.float32, "device": streams.device}
        if not need_params:
            return (torch.empty_like(streams) if need_x else streams.new_empty(0), streams.new_empty(0, **f32),
                    streams.new_empty(0, **f32), streams.new_empty(0, **f32))
        return (torch.empty_like(streams) if need_x else streams.new_empty(0), torch.empty(fn.shape, **f32),
                torch.empty(base.shape, **f32), torch.empty(scale.shape, **f32))

    @torch.library.custom_op(prefix.format("post"), mutates_args=())
    def post_op(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return kernels.post_forward(block_out, streams, post, comb)

    @post_op.register_fake
    def _(block_out, streams, post, comb):
        return torch.empty_like(streams, memory_format=torch.contiguous_format)

    @torch.library.custom_op(prefix.format("post_backward"), mutates_args=())
    def post_backward(grad: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, need_bo: bool, need_x: bool, need_post: bool, need_comb: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.post_backward(grad, block_out, streams, post, comb, need_bo, need_x, need_post, need_comb)

    @post_backward.register_fake
    def _(grad, block_out, streams, post, comb, need_bo, need_x, need_post, need_comb):
        return _post_grads(block_out, streams, post, comb, need_bo, need_x, need_post, need_comb)

    _register_pre_autograd(pre_op, pre_backward)
    _register_head_autograd(head_op, pre_backward)
    _register_post_autograd(post_op, post_backward)
    return pre_op, head_op, post_op


def _as(grad: torch.Tensor, like: torch.Tensor, needed: bool) -> torch.Tensor | None:
    """A backward op's output as autograd wants it: None where not needed, else in like's dtype."""
    return grad.to(like.dtype) if needed else None


def _register_pre_autograd(pre, pre_backward) -> None:
    def setup_context(ctx, inputs, output):
        streams, fn, base, scale, sinkhorn_iters, hc_eps, _ = inputs
        z, r = output[3], output[4]
        ctx.save_for_backward(streams, fn, base, scale, z, r)  # see [Note: what backward keeps]
        ctx.mark_non_differentiable(z, r)
        ctx.config = (sinkhorn_iters, hc_eps)
        ctx.set_materialize_grads(False)  # an output nothing used gets None, not a zero tensor

    def backward(ctx, g_post, g_comb, g_col, _gz, _gr):
        streams, fn, base, scale, z, r = ctx.saved_tensors
        need_x, need_fn, need_base, need_scale = ctx.needs_input_grad[:4]
        need_params = need_fn or need_base or need_scale
        if not (need_x or need_params) or (g_post is None and g_comb is None and g_col is None):
            return None, None, None, None, None, None, None
        grad_x, grad_fn, grad_base, grad_scale = pre_backward(
            streams, fn, base, scale, z, r, g_post, g_comb, g_col, *ctx.config, False, need_x, need_params)
        return (_as(grad_x, streams, need_x), _as(grad_fn, fn, need_fn), _as(grad_base, base, need_base),
                _as(grad_scale, scale, need_scale), None, None, None)

    pre.register_autograd(backward, setup_context=setup_context)


def _register_head_autograd(head, pre_backward) -> None:
    def setup_context(ctx, inputs, output):
        streams, hc_fn, hc_base, hc_scale, hc_eps, _ = inputs
        ctx.save_for_backward(streams, hc_fn, hc_base, hc_scale, output[1], output[2])
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.hc_eps = hc_eps
        ctx.set_materialize_grads(False)

    def backward(ctx, g_col, _gz, _gr):
        streams, hc_fn, hc_base, hc_scale, z, r = ctx.saved_tensors
        need_x, need_fn, need_base, need_scale = ctx.needs_input_grad[:4]
        need_params = need_fn or need_base or need_scale
        if not (need_x or need_params) or g_col is None:
            return None, None, None, None, None, None
        grad_x, grad_fn, grad_base, grad_scale = pre_backward(
            streams, hc_fn, hc_base, hc_scale, z, r, None, None, g_col, 1, ctx.hc_eps, True, need_x, need_params)
        return (_as(grad_x, streams, need_x), _as(grad_fn, hc_fn, need_fn), _as(grad_base, hc_base, need_base),
                _as(grad_scale, hc_scale, need_scale), None, None)

    head.register_autograd(backward, setup_context=setup_context)


def _register_post_autograd(post, post_backward) -> None:
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # block_out, streams, post, comb: nothing else
        ctx.set_materialize_grads(False)

    def backward(ctx, grad):
        block_out, streams, post_w, comb = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if grad is None or not any(needs):
            return None, None, None, None
        grads = post_backward(grad, block_out, streams, post_w, comb, *needs)
        return tuple(_as(g, like, need) for g, like, need in zip(grads, ctx.saved_tensors, needs, strict=True))

    post.register_autograd(backward, setup_context=setup_context)


_NATIVE_OPS = _define_ops("cpu", _Native)
_TRITON_OPS = _define_ops("triton", triton_mhc)


# ------------------------------------------------------------------------------------ API


def backend_for(streams: torch.Tensor, *others: torch.Tensor) -> str:
    """The backend the API runs these tensors on: one of BACKENDS."""
    device = streams.device
    if device.type == "cpu":
        dtypes_ok = all(t.dtype in _NATIVE_DTYPES for t in (streams, *others))
        return "native" if native.LIB is not None and dtypes_ok else "reference"
    if device.type == "cuda" and triton_mhc.unavailable_reason(device) is None:
        return "triton"
    return "reference"


def _ops(backend: str, where: str, *tensors: torch.Tensor):
    if backend not in BACKENDS:
        raise ConfigError(f"{where} backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "native":
        if native.LIB is None:
            raise ConfigError(f"{where} backend 'native' needs hyperparallel._mega_mhc_native (run `make setup`)")
        if any(t.dtype not in _NATIVE_DTYPES for t in tensors):
            raise ConfigError(f"{where} backend 'native' takes float32 and bfloat16 tensors; got "
                              f"{', '.join(sorted({str(t.dtype) for t in tensors}))}")
        return _NATIVE_OPS
    if backend == "triton" and (reason := triton_mhc.unavailable_reason(tensors[0].device)) is not None:
        raise ConfigError(f"{where} backend 'triton': {reason}")
    return _TRITON_OPS if backend == "triton" else None


def run_pre(backend: str, streams, fn, base, scale, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """mhc_pre on a named backend (tests and benchmarks compare them on the same inputs)."""
    _check_pre(streams, fn, base, scale, sinkhorn_iters)
    ops = _ops(backend, "mhc_pre", streams)
    if ops is None:
        return mhc_pre_reference(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                                 norm_eps=norm_eps)
    post, comb, collapsed, _, _ = ops[0](streams, fn, base, scale, sinkhorn_iters, float(hc_eps), float(norm_eps))
    return post, comb, collapsed


def run_head(backend: str, streams, hc_fn, hc_base, hc_scale, *, hc_eps: float, norm_eps: float):
    """mhc_head on a named backend."""
    _check_head(streams, hc_fn, hc_base, hc_scale)
    ops = _ops(backend, "mhc_head", streams)
    if ops is None:
        return mhc_head_reference(streams, hc_fn, hc_base, hc_scale, hc_eps=hc_eps, norm_eps=norm_eps)
    return ops[1](streams, hc_fn, hc_base, hc_scale, float(hc_eps), float(norm_eps))[0]


def run_post(backend: str, block_out, streams, post, comb):
    """mhc_post on a named backend."""
    _check_post(block_out, streams, post, comb)
    ops = _ops(backend, "mhc_post", streams, block_out)
    if ops is None:
        return mhc_post_reference(block_out, streams, post, comb)
    return ops[2](block_out, streams, post, comb)


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] (float32 / bfloat16 / float16), fn [(2+N)*N, N*D], base [(2+N)*N], scale [3]
    (float32 parameters) -> (post [T, N] float32, comb [T, N, N] float32, collapsed [T, D] in streams' dtype);
    what DeepseekV4HyperConnection.forward returns, for flattened tokens."""
    return run_pre(backend_for(streams), streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                   norm_eps=norm_eps)


def mhc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """block_out [T, D], streams [T, N, D], post [T, N], comb [T, N, N] -> [T, N, D] in streams' dtype:
    out[t,k,:] = post[t,k] * block_out[t,:] + sum_j comb[t,j,k] * streams[t,j,:]."""
    return run_post(backend_for(streams, block_out), block_out, streams, post, comb)


def mhc_head(streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *,
             hc_eps: float, norm_eps: float) -> torch.Tensor:
    """DeepseekV4HyperHead.forward for flattened tokens -> [T, D] in streams' dtype."""
    return run_head(backend_for(streams), streams, hc_fn, hc_base, hc_scale, hc_eps=hc_eps, norm_eps=norm_eps)


# -------------------------------------------------------------------------------- modules


def _hf_shape(module: nn.Module, fn_name: str, rows) -> tuple[int, int]:
    """(N, D) of an HF hyper-connection module, checked against its parameters."""
    n = module.hc_mult
    fn = getattr(module, fn_name)
    if fn.dim() != 2 or fn.shape[1] % n or fn.shape[0] != rows(n):
        raise ShapeError(f"{type(module).__name__}.{fn_name} has shape {tuple(fn.shape)}; hc_mult={n} needs "
                         f"[{rows(n)}, {n} * hidden_size]")
    return n, fn.shape[1] // n


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
            mega = cls(n, hidden, sinkhorn_iters=hc.hc_sinkhorn_iters, hc_eps=hc.hc_eps, norm_eps=hc.input_norm.eps)
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
            mega = cls(n, hidden, hc_eps=head.eps, norm_eps=head.input_norm.eps)
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


__all__ = ["BACKENDS", "MAX_STREAMS", "MegaHyperConnection", "MegaHyperHead", "backend_for", "mhc_head",
           "mhc_head_reference", "mhc_post", "mhc_post_reference", "mhc_pre", "mhc_pre_reference", "run_head",
           "run_post", "run_pre"]

"""MegaMHC's fused backends (native C, Triton) as custom ops, and the API that picks one.

See the package's docstring for what MegaMHC computes and its Notes; kernels.backends' [Note:
fused backends] for how a backend is chosen.
"""

from __future__ import annotations

import torch

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.kernels.backends import FusedBackends, custom_op, ptr
from hyperparallel.kernels.host_cache import empty as host_empty
from hyperparallel.kernels.mega_mhc import native
from hyperparallel.kernels.mega_mhc import triton as triton_mhc
from hyperparallel.kernels.mega_mhc.reference import (
    check_head,
    check_post,
    check_pre,
    mhc_head_reference,
    mhc_post_reference,
    mhc_pre_reference,
)

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)
_BACKENDS = FusedBackends("mega_mhc", native)


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


def _raise_for(status: int, what: str) -> None:
    if status == native.NO_MEMORY:
        raise MemoryError(f"{what}: the native kernel could not allocate its buffers")
    if status != native.OK:
        raise ShapeError(f"{what}: the native kernel refused its arguments (status {status})")


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the kernels read it. Callers keep the result in a variable until the kernel has run:
    a converted copy passed as ptr(_f32(t)) would be freed before the call."""
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
            ptr(x), _code(x), T, N, D, ptr(fn), ptr(base), ptr(scale), int(head), iters,
            hc_eps, norm_eps, ptr(z), ptr(r), ptr(post), ptr(comb), ptr(collapsed), _code(collapsed),
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
            ptr(x), _code(x), T, N, D, ptr(z), ptr(r), ptr(base), ptr(scale), int(head), iters,
            hc_eps, ptr(g_post), ptr(g_comb), ptr(g_col), _code(x), ptr(gu), ptr(pre),
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
            ptr(x), _code(x), T, N, D, ptr(fn), fn.shape[0], ptr(gz), ptr(coef),
            ptr(pre), ptr(g_col), _code(x), ptr(grad_x) if need_x else None, _code(x),
            ptr(grad_fn) if need_fn else None, torch.get_num_threads())
        _raise_for(status, "mhc_pre backward")
        return grad_x, grad_fn

    @staticmethod
    def post_forward(block_out, x, post, comb):
        block_out, x = block_out.contiguous(), x.contiguous()
        T, N, D = x.shape
        post, comb = _f32(post), _f32(comb)
        out = host_empty(x.shape, x.dtype)
        status = native.LIB.hp_mega_mhc_post_forward(
            ptr(block_out), _code(block_out), ptr(x), _code(x), T, N, D, ptr(post), ptr(comb),
            ptr(out), _code(out), torch.get_num_threads())
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
            ptr(g), _code(g), ptr(block_out), _code(block_out), ptr(x), _code(x), T, N, D, ptr(post32),
            ptr(comb32), ptr(g_bo) if need_bo else None, _code(block_out), ptr(g_x) if need_x else None,
            _code(x), ptr(g_post) if need_post else None, ptr(g_comb) if need_comb else None,
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
    def pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
        return kernels.pre_forward(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False)

    def pre_fake(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
        return _pre_outputs(streams, fn.shape[0], False)

    def head(streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor,
             hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, _, collapsed, z, r = kernels.pre_forward(streams, hc_fn, hc_base, hc_scale, 1, hc_eps, norm_eps, True)
        return collapsed, z, r

    def head_fake(streams, hc_fn, hc_base, hc_scale, hc_eps, norm_eps):
        return _pre_outputs(streams, hc_fn.shape[0], True)[2:]

    def pre_backward(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     z: torch.Tensor, r: torch.Tensor, g_post: torch.Tensor | None, g_comb: torch.Tensor | None,
                     g_col: torch.Tensor | None, sinkhorn_iters: int, hc_eps: float, head: bool, need_x: bool,
                     need_params: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _finish_pre_backward(kernels, streams, fn, base, scale, z, r, g_post, g_comb, g_col, sinkhorn_iters,
                                    hc_eps, head, need_x, need_params)

    def pre_backward_fake(streams, fn, base, scale, z, r, g_post, g_comb, g_col, sinkhorn_iters, hc_eps, head, need_x,
                          need_params):
        f32 = {"dtype": torch.float32, "device": streams.device}
        if not need_params:
            return (torch.empty_like(streams) if need_x else streams.new_empty(0), streams.new_empty(0, **f32),
                    streams.new_empty(0, **f32), streams.new_empty(0, **f32))
        return (torch.empty_like(streams) if need_x else streams.new_empty(0), torch.empty(fn.shape, **f32),
                torch.empty(base.shape, **f32), torch.empty(scale.shape, **f32))

    def post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return kernels.post_forward(block_out, streams, post, comb)

    def post_fake(block_out, streams, post, comb):
        return torch.empty_like(streams, memory_format=torch.contiguous_format)

    def post_backward(grad: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor, need_bo: bool, need_x: bool, need_post: bool, need_comb: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.post_backward(grad, block_out, streams, post, comb, need_bo, need_x, need_post, need_comb)

    def post_backward_fake(grad, block_out, streams, post, comb, need_bo, need_x, need_post, need_comb):
        return _post_grads(block_out, streams, post, comb, need_bo, need_x, need_post, need_comb)

    pre_op = custom_op(f"mega_mhc_pre_{name}", pre, pre_fake)
    head_op = custom_op(f"mega_mhc_head_{name}", head, head_fake)
    pre_backward_op = custom_op(f"mega_mhc_pre_backward_{name}", pre_backward, pre_backward_fake)
    post_op = custom_op(f"mega_mhc_post_{name}", post, post_fake)
    post_backward_op = custom_op(f"mega_mhc_post_backward_{name}", post_backward, post_backward_fake)
    _register_pre_autograd(pre_op, pre_backward_op)
    _register_head_autograd(head_op, pre_backward_op)
    _register_post_autograd(post_op, post_backward_op)
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
    """The backend the API runs these tensors on: one of BACKENDS (the native kernels take
    float32 and bfloat16)."""
    return _BACKENDS.for_device(streams.device,
                                native_takes=all(t.dtype in _NATIVE_DTYPES for t in (streams, *others)))


def _ops(backend: str, where: str, *tensors: torch.Tensor):
    _BACKENDS.require(backend, tensors[0].device, where)
    if backend == "native" and any(t.dtype not in _NATIVE_DTYPES for t in tensors):
        raise ConfigError(f"{where} backend 'native' takes float32 and bfloat16 tensors; got "
                          f"{', '.join(sorted({str(t.dtype) for t in tensors}))}")
    return {"native": _NATIVE_OPS, "triton": _TRITON_OPS}.get(backend)


def run_pre(backend: str, streams, fn, base, scale, *, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """mhc_pre on a named backend (tests and benchmarks compare them on the same inputs)."""
    check_pre(streams, fn, base, scale, sinkhorn_iters)
    ops = _ops(backend, "mhc_pre", streams)
    if ops is None:
        return mhc_pre_reference(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, hc_eps=hc_eps,
                                 norm_eps=norm_eps)
    post, comb, collapsed, _, _ = ops[0](streams, fn, base, scale, sinkhorn_iters, float(hc_eps), float(norm_eps))
    return post, comb, collapsed


def run_head(backend: str, streams, hc_fn, hc_base, hc_scale, *, hc_eps: float, norm_eps: float):
    """mhc_head on a named backend."""
    check_head(streams, hc_fn, hc_base, hc_scale)
    ops = _ops(backend, "mhc_head", streams)
    if ops is None:
        return mhc_head_reference(streams, hc_fn, hc_base, hc_scale, hc_eps=hc_eps, norm_eps=norm_eps)
    return ops[1](streams, hc_fn, hc_base, hc_scale, float(hc_eps), float(norm_eps))[0]


def run_post(backend: str, block_out, streams, post, comb):
    """mhc_post on a named backend."""
    check_post(block_out, streams, post, comb)
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


__all__ = ["backend_for", "mhc_head", "mhc_post", "mhc_pre", "run_head", "run_post", "run_pre"]

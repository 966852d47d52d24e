"""MegaMHC's Triton kernels: the fused hyper-connections forward and backward on the GPU.

The same three-step plan as the native kernels (see csrc/mega_mhc.c and mega_mhc's notes), with
the per-token weights on [BLOCK_T, N_PAD] and [BLOCK_T, N_PAD, N_PAD] tiles (N padded to a power
of two, the padding held at zero) and the long products on tl.dot in IEEE fp32 (never TF32: the
weights must match transformers' fp32 projection):
  _project_kernel          z = x . fn^T and r = rsqrt(mean(x^2) + eps), one pass over the rows
  _weights_kernel          pre, post, softmax, Sinkhorn; the collapse sum_n pre_n x_n
  _weights_backward_kernel the collapse's gradient w.r.t. pre, then back through the sigmoids,
                           Sinkhorn (its iterates on a scratch buffer that lives for this launch
                           only, written and read by the same program) and softmax: gu [T, M]
  _grad_fn_kernel          grad_fn = gz^T . x, one program per column block (no atomics)
  _grad_x_kernel           grad_x = gz . fn - coef x + grad_collapsed pre
  _post_kernel             out_k = post_k block_out + sum_j comb_jk x_j
  _post_backward_kernel    the gradients w.r.t. block_out, x, post and comb, one pass over D

The kernels are jitted on first use (kernels.triton_support's [Note: kernels jitted on first
use]): this module imports without triton, and the tests run them on Triton's interpreter.
"""

from __future__ import annotations

import torch

from hyperparallel.kernels.triton_support import JitKernels, on_device, reduce_max, reduce_sum, rounded, tl, triton

_TILE = 4096  # elements of a program's element-wise tile
_BLOCK_K = 64  # columns of a projection step (tl.dot wants 16 or more on every side)
_DOT_ROWS = 16  # tokens of a tl.dot tile
_NUM_WARPS = 4


# ------------------------------------------------------------------------------------ kernels
# Plain functions, made triton.jit functions of this module by _KERNELS.build() on first use; the
# reductions and the rounding are kernels.triton_support's (its [Note: shared jit helpers]).

_KERNELS = JitKernels(globals(), shared=("reduce_max", "reduce_sum", "rounded"))
_jit = _KERNELS.register


@_jit
def _project_kernel(x_ptr, fn_ptr, z_ptr, r_ptr, T, K, M, norm_eps, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    M_PAD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    # tl.full, not tl.zeros: tl.zeros is a jit function made when triton is imported, which the
    # interpreter cannot call when triton was imported before the interpreter mode was set
    acc = tl.full((BLOCK_T, M_PAD), 0, dtype=tl.float32)
    squares = tl.full((BLOCK_T, BLOCK_K), 0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        f = tl.load(fn_ptr + m[None, :] * K + k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x, f, input_precision="ieee")
        squares += x * x
    r = 1.0 / tl.sqrt_rn(reduce_sum(squares, 1) / K + norm_eps)
    tl.store(z_ptr + rows[:, None] * M + m[None, :], acc, mask=row_ok[:, None] & m_ok[None, :])
    tl.store(r_ptr + rows, r, mask=row_ok)


@_jit
def _gate(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, first, which: tl.constexpr, N: tl.constexpr,
          N_PAD: tl.constexpr):
    """sigmoid(a * scale[which] + base) of the N weights from column `first`: [BLOCK_T, N_PAD]."""
    i = tl.arange(0, N_PAD)
    ok = row_ok[:, None] & (i[None, :] < N)
    z = tl.load(z_ptr + rows[:, None] * M + first + i[None, :], mask=ok, other=0.0)
    b = tl.load(base_ptr + first + i, mask=i < N, other=0.0)
    s = tl.load(scale_ptr + which)
    u = z * r[:, None] * s + b[None, :]
    return tl.where(ok, 1.0 / (1.0 + tl.exp(-u)), 0.0)


@_jit
def _softmax_rows(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, N: tl.constexpr, N_PAD: tl.constexpr):
    """softmax(a_comb * scale[2] + base_comb) per row: [BLOCK_T, N_PAD, N_PAD], padding 0."""
    j = tl.arange(0, N_PAD)[None, :, None]
    k = tl.arange(0, N_PAD)[None, None, :]
    ok = (j < N) & (k < N)
    col = 2 * N + j * N + k
    z = tl.load(z_ptr + rows[:, None, None] * M + col, mask=row_ok[:, None, None] & ok, other=0.0)
    b = tl.load(base_ptr + col, mask=ok, other=0.0)
    s = tl.load(scale_ptr + 2)
    logit = tl.where(ok, z * r[:, None, None] * s + b, float("-inf"))
    top = tl.where(j < N, reduce_max(logit, 2)[:, :, None], 0.0)  # padded rows: no -inf - -inf
    e = tl.where(ok, tl.exp(logit - top), 0.0)
    total = reduce_sum(e, 2)[:, :, None]
    return e * (1.0 / tl.where(j < N, total, 1.0))


@_jit
def _normalize(c, eps, AXIS: tl.constexpr):
    """c / (its sums along AXIS (1: columns, 2: rows) + eps); zero padding stays zero."""
    if AXIS == 1:
        d = reduce_sum(c, 1)[:, None, :] + eps
    else:
        d = reduce_sum(c, 2)[:, :, None] + eps
    return c / d


@_jit
def _normalize_backward(g, c, ok, eps, AXIS: tl.constexpr):
    """The gradient w.r.t. c of _normalize(c), from g w.r.t. its output; padding held at zero."""
    if AXIS == 1:
        d = reduce_sum(c, 1)[:, None, :] + eps
        gc = reduce_sum(g * c, 1)[:, None, :]
    else:
        d = reduce_sum(c, 2)[:, :, None] + eps
        gc = reduce_sum(g * c, 2)[:, :, None]
    return tl.where(ok, g / d - gc / (d * d), 0.0)


@_jit
def _weights_kernel(x_ptr, z_ptr, r_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, col_ptr, T, D, M, iters, hc_eps,
                    N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r = tl.load(r_ptr + rows, mask=row_ok, other=1.0)
    i = tl.arange(0, N_PAD)
    pre = _gate(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, 0, 0, N, N_PAD) + hc_eps
    if not HEAD:
        post = 2.0 * _gate(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, N, 1, N, N_PAD)
        tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=row_ok[:, None] & (i[None, :] < N))
        j = i[None, :, None]
        k = i[None, None, :]
        ok = (j < N) & (k < N)
        c = tl.where(ok, _softmax_rows(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, N, N_PAD) + hc_eps, 0.0)
        c = _normalize(c, hc_eps, 1)
        for _ in range(iters - 1):
            c = _normalize(c, hc_eps, 2)
            c = _normalize(c, hc_eps, 1)
        tl.store(comb_ptr + rows[:, None, None] * (N * N) + j * N + k, c, mask=row_ok[:, None, None] & ok)
    stream_ok = i[None, :, None] < N
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok3 = row_ok[:, None, None] & stream_ok & (d[None, None, :] < D)
        x = tl.load(x_ptr + (rows[:, None, None] * N + i[None, :, None]) * D + d[None, None, :], mask=ok3, other=0.0)
        out = reduce_sum(tl.where(ok3, pre[:, :, None] * x.to(tl.float32), 0.0), 1)
        tl.store(col_ptr + rows[:, None] * D + d[None, :], rounded(out, col_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d[None, :] < D))


@_jit
def _weights_backward_kernel(x_ptr, z_ptr, r_ptr, base_ptr, scale_ptr, gpost_ptr, gcomb_ptr, gcol_ptr, trace_ptr,
                             gu_ptr, pre_ptr, T, D, M, iters, hc_eps, N: tl.constexpr, N_PAD: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr,
                             HAS_GPOST: tl.constexpr, HAS_GCOMB: tl.constexpr, HAS_GCOL: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r = tl.load(r_ptr + rows, mask=row_ok, other=1.0)
    i = tl.arange(0, N_PAD)
    i_ok = row_ok[:, None] & (i[None, :] < N)

    g_pre = tl.full((BLOCK_T, N_PAD), 0, dtype=tl.float32)
    if HAS_GCOL:  # the collapse's gradient w.r.t. pre: grad_collapsed . x_n
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < D
            g = tl.load(gcol_ptr + rows[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            ok3 = i_ok[:, :, None] & d_ok[None, None, :]
            x = tl.load(x_ptr + (rows[:, None, None] * N + i[None, :, None]) * D + d[None, None, :], mask=ok3,
                        other=0.0)
            g_pre += reduce_sum(x.to(tl.float32) * g.to(tl.float32)[:, None, :], 2)
    sig = _gate(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, 0, 0, N, N_PAD)
    tl.store(pre_ptr + rows[:, None] * N + i[None, :], sig + hc_eps, mask=i_ok)
    tl.store(gu_ptr + rows[:, None] * M + i[None, :], g_pre * (1.0 - sig) * sig, mask=i_ok)
    if not HEAD:
        sig = _gate(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, N, 1, N, N_PAD)
        gu_post = tl.full((BLOCK_T, N_PAD), 0, dtype=tl.float32)
        if HAS_GPOST:
            g_post = tl.load(gpost_ptr + rows[:, None] * N + i[None, :], mask=i_ok, other=0.0)
            gu_post = g_post * 2.0 * (1.0 - sig) * sig
        tl.store(gu_ptr + rows[:, None] * M + N + i[None, :], gu_post, mask=i_ok)
        j = i[None, :, None]
        k = i[None, None, :]
        ok = (j < N) & (k < N)
        row_ok3 = row_ok[:, None, None] & ok
        gu_comb = tl.full((BLOCK_T, N_PAD, N_PAD), 0, dtype=tl.float32)
        if HAS_GCOMB:
            prob = _softmax_rows(z_ptr, base_ptr, scale_ptr, rows, row_ok, r, M, N, N_PAD)
            c = tl.where(ok, prob + hc_eps, 0.0)
            # Sinkhorn again, each step's input kept: trace[t, s] for step s (s even: columns)
            steps = 2 * iters - 1
            slot = trace_ptr + (rows[:, None, None] * steps * N_PAD + j) * N_PAD + k
            tl.store(slot, c, mask=row_ok[:, None, None])
            c = _normalize(c, hc_eps, 1)
            for it in range(iters - 1):
                tl.store(slot + (2 * it + 1) * N_PAD * N_PAD, c, mask=row_ok[:, None, None])
                c = _normalize(c, hc_eps, 2)
                tl.store(slot + (2 * it + 2) * N_PAD * N_PAD, c, mask=row_ok[:, None, None])
                c = _normalize(c, hc_eps, 1)
            tl.debug_barrier()  # the iterates stored above, visible to every thread of the program
            g = tl.load(gcomb_ptr + rows[:, None, None] * (N * N) + j * N + k, mask=row_ok3, other=0.0)
            for back in range(iters - 1):
                it = iters - 2 - back
                c = tl.load(slot + (2 * it + 2) * N_PAD * N_PAD, mask=row_ok[:, None, None], other=0.0)
                g = _normalize_backward(g, c, ok, hc_eps, 1)
                c = tl.load(slot + (2 * it + 1) * N_PAD * N_PAD, mask=row_ok[:, None, None], other=0.0)
                g = _normalize_backward(g, c, ok, hc_eps, 2)
            c = tl.load(slot, mask=row_ok[:, None, None], other=0.0)
            g = _normalize_backward(g, c, ok, hc_eps, 1)
            dot = reduce_sum(g * prob, 2)[:, :, None]  # softmax's backward, per row
            gu_comb = prob * (g - dot)
        tl.store(gu_ptr + rows[:, None, None] * M + 2 * N + j * N + k, gu_comb, mask=row_ok3)


@_jit
def _grad_fn_kernel(x_ptr, gz_ptr, gfn_ptr, T, K, M, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    M_PAD: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    acc = tl.full((M_PAD, BLOCK_K), 0, dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = t < T
        gz_t = tl.load(gz_ptr + t[None, :] * M + m[:, None], mask=m_ok[:, None] & t_ok[None, :], other=0.0)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(gz_t, x.to(tl.float32), input_precision="ieee")
    tl.store(gfn_ptr + m[:, None] * K + k[None, :], acc, mask=m_ok[:, None] & k_ok[None, :])


@_jit
def _grad_x_kernel(x_ptr, fn_ptr, gz_ptr, coef_ptr, pre_ptr, gcol_ptr, gx_ptr, T, D, K, M, N,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, HAS_GCOL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = tl.arange(0, M_PAD)
    t_ok, k_ok, m_ok = t < T, k < K, m < M
    ok = t_ok[:, None] & k_ok[None, :]
    gz = tl.load(gz_ptr + t[:, None] * M + m[None, :], mask=t_ok[:, None] & m_ok[None, :], other=0.0)
    f = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    acc = tl.dot(gz, f, input_precision="ieee")
    x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
    coef = tl.load(coef_ptr + t, mask=t_ok, other=0.0)
    acc = acc - coef[:, None] * x
    if HAS_GCOL:
        g = tl.load(gcol_ptr + t[:, None] * D + (k % D)[None, :], mask=ok, other=0.0).to(tl.float32)
        p = tl.load(pre_ptr + t[:, None] * N + (k // D)[None, :], mask=ok, other=0.0)
        acc += g * p
    tl.store(gx_ptr + t[:, None] * K + k[None, :], rounded(acc, gx_ptr.dtype.element_ty), mask=ok)


@_jit
def _post_kernel(bo_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, T, D, N: tl.constexpr, N_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    kk = tl.arange(0, N_PAD)
    t_ok, d_ok, k_ok = t < T, d < D, kk < N
    wk_ok = t_ok[:, None] & k_ok[None, :]
    td_ok = t_ok[:, None] & d_ok[None, :]
    bo = tl.load(bo_ptr + t[:, None] * D + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t[:, None] * N + kk[None, :], mask=wk_ok, other=0.0)
    acc = post[:, :, None] * bo[:, None, :]
    for j in tl.static_range(N):
        c_j = tl.load(comb_ptr + (t[:, None] * N + j) * N + kk[None, :], mask=wk_ok, other=0.0)
        x_j = tl.load(x_ptr + (t[:, None] * N + j) * D + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        acc += c_j[:, :, None] * x_j[:, None, :]
    out = out_ptr + (t[:, None, None] * N + kk[None, :, None]) * D + d[None, None, :]
    tl.store(out, rounded(acc, out_ptr.dtype.element_ty), mask=wk_ok[:, :, None] & d_ok[None, None, :])


@_jit
def _post_backward_kernel(g_ptr, bo_ptr, x_ptr, post_ptr, comb_ptr, gbo_ptr, gx_ptr, gpost_ptr, gcomb_ptr, T, D,
                          N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          NEED_BO: tl.constexpr, NEED_X: tl.constexpr, NEED_POST: tl.constexpr,
                          NEED_COMB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, N_PAD)
    t_ok, k_ok = t < T, kk < N
    wk_ok = t_ok[:, None] & k_ok[None, :]
    post = tl.load(post_ptr + t[:, None] * N + kk[None, :], mask=wk_ok, other=0.0)
    acc_post = tl.full((BLOCK_T, N_PAD), 0, dtype=tl.float32)
    acc_comb = tl.full((BLOCK_T, N_PAD, N_PAD), 0, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        td_ok = t_ok[:, None] & d_ok[None, :]
        ok3 = wk_ok[:, :, None] & d_ok[None, None, :]
        g = tl.load(g_ptr + (t[:, None, None] * N + kk[None, :, None]) * D + d[None, None, :], mask=ok3, other=0.0)
        g = g.to(tl.float32)
        if NEED_BO:
            g_bo = reduce_sum(post[:, :, None] * g, 1)
            tl.store(gbo_ptr + t[:, None] * D + d[None, :], rounded(g_bo, gbo_ptr.dtype.element_ty), mask=td_ok)
        if NEED_POST:
            bo = tl.load(bo_ptr + t[:, None] * D + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
            acc_post += reduce_sum(g * bo[:, None, :], 2)
        for j in tl.static_range(N):
            if NEED_X:
                c_j = tl.load(comb_ptr + (t[:, None] * N + j) * N + kk[None, :], mask=wk_ok, other=0.0)
                g_x = reduce_sum(c_j[:, :, None] * g, 1)
                tl.store(gx_ptr + (t[:, None] * N + j) * D + d[None, :], rounded(g_x, gx_ptr.dtype.element_ty),
                         mask=td_ok)
            if NEED_COMB:
                x_j = tl.load(x_ptr + (t[:, None] * N + j) * D + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
                row = reduce_sum(g * x_j[:, None, :], 2)  # [BLOCK_T, N_PAD]: g_comb[t, j, :]
                acc_comb += tl.where(kk[None, :, None] == j, row[:, None, :], 0.0)
    if NEED_POST:
        tl.store(gpost_ptr + t[:, None] * N + kk[None, :], acc_post, mask=wk_ok)
    if NEED_COMB:
        j3 = kk[None, :, None]
        k3 = kk[None, None, :]
        tl.store(gcomb_ptr + (t[:, None, None] * N + j3) * N + k3, acc_comb,
                 mask=t_ok[:, None, None] & (j3 < N) & (k3 < N))


# ----------------------------------------------------------------------------------- launches


def _pow2(n: int, lo: int = 1) -> int:
    return max(triton.next_power_of_2(max(n, 1)), lo)


def _tiles(N: int, D: int, tokens: int) -> tuple[int, int, int]:
    """(N_PAD, BLOCK_D, BLOCK_T) of the element-wise kernels: about _TILE elements a program."""
    n_pad = _pow2(N)
    block_d = min(_pow2(D), 128)
    block_t = max(1, min(_TILE // (n_pad * block_d), _pow2(tokens)))
    return n_pad, block_d, block_t


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def pre_forward(x, fn, base, scale, iters, hc_eps, norm_eps, head):
    """(post, comb, collapsed, z, r) of mhc_pre (post, comb: [0] for the head)."""
    _KERNELS.build()
    x = x.contiguous()
    fn, base, scale = _f32(fn), _f32(base), _f32(scale)
    T, N, D = x.shape
    M, K = fn.shape
    device = x.device
    f32 = {"dtype": torch.float32, "device": device}
    z, r = torch.empty(T, M, **f32), torch.empty(T, **f32)
    post = torch.empty(0 if head else T, N, **f32)
    comb = torch.empty(0 if head else T, N, N, **f32)
    collapsed = torch.empty(T, D, dtype=x.dtype, device=device)
    if T == 0:
        return post, comb, collapsed, z, r
    n_pad, block_d, block_t = _tiles(N, D, T)
    with on_device(device):
        _project_kernel[(triton.cdiv(T, _DOT_ROWS),)](
            x, fn, z, r, T, K, M, float(norm_eps), BLOCK_T=_DOT_ROWS, BLOCK_K=_BLOCK_K, M_PAD=_pow2(M, 16),
            num_warps=_NUM_WARPS)
        _weights_kernel[(triton.cdiv(T, block_t),)](
            x, z, r, base, scale, post if not head else z, comb if not head else z, collapsed, T, D, M, iters,
            float(hc_eps), N=N, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d, HEAD=bool(head),
            num_warps=_NUM_WARPS)
    return post, comb, collapsed, z, r


def weights_backward(x, z, r, base, scale, g_post, g_comb, g_col, iters, hc_eps, head):
    """(gu [T, M], pre [T, N]) of mhc_pre's backward (see op._finish_pre_backward)."""
    _KERNELS.build()
    x = x.contiguous()
    base, scale = _f32(base), _f32(scale)
    T, N, D = x.shape
    M = z.shape[1]
    f32 = {"dtype": torch.float32, "device": x.device}
    gu, pre = torch.empty(T, M, **f32), torch.empty(T, N, **f32)
    if T == 0:
        return gu, pre
    n_pad, block_d, block_t = _tiles(N, D, T)
    has_comb = g_comb is not None and not head
    steps = 2 * iters - 1
    trace = torch.empty(T * steps * n_pad * n_pad if has_comb else 1, **f32)  # this launch's scratch
    has_post = g_post is not None and not head
    g_post = _f32(g_post) if has_post else z  # (z: any tensor, unread)
    g_comb = _f32(g_comb) if has_comb else z
    g_col_t = g_col.contiguous() if g_col is not None else x
    with on_device(x.device):
        _weights_backward_kernel[(triton.cdiv(T, block_t),)](
            x, z, r, base, scale, g_post, g_comb, g_col_t, trace, gu, pre, T, D, M, iters, float(hc_eps), N=N,
            N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d, HEAD=bool(head), HAS_GPOST=has_post,
            HAS_GCOMB=has_comb, HAS_GCOL=g_col is not None, num_warps=_NUM_WARPS)
    return gu, pre


def inputs_backward(x, fn, gz, coef, pre, g_col, need_x, need_fn):
    """(grad_x or [0], grad_fn or [0]) of mhc_pre's backward."""
    _KERNELS.build()
    x = x.contiguous()
    fn = _f32(fn)
    T, N, D = x.shape
    M, K = fn.shape
    gz, coef = gz.contiguous(), coef.contiguous()
    grad_x = torch.empty_like(x) if need_x else x.new_empty(0)
    grad_fn = (torch.empty(M, K, dtype=torch.float32, device=x.device) if need_fn
               else x.new_empty(0, dtype=torch.float32))
    m_pad = _pow2(M, 16)
    with on_device(x.device):
        if need_fn and T > 0:
            _grad_fn_kernel[(triton.cdiv(K, _BLOCK_K),)](
                x, gz, grad_fn, T, K, M, BLOCK_T=_DOT_ROWS, BLOCK_K=_BLOCK_K, M_PAD=m_pad, num_warps=_NUM_WARPS)
        elif need_fn:
            grad_fn.zero_()
        if need_x and T > 0:
            g_col_t = g_col.contiguous() if g_col is not None else x
            _grad_x_kernel[(triton.cdiv(T, _DOT_ROWS), triton.cdiv(K, _BLOCK_K))](
                x, fn, gz, coef, pre, g_col_t, grad_x, T, D, K, M, N, BLOCK_T=_DOT_ROWS, BLOCK_K=_BLOCK_K,
                M_PAD=m_pad, HAS_GCOL=g_col is not None, num_warps=_NUM_WARPS)
    return grad_x, grad_fn


def post_forward(block_out, x, post, comb):
    """mhc_post's output [T, N, D] in x's dtype."""
    _KERNELS.build()
    block_out, x = block_out.contiguous(), x.contiguous()
    post, comb = _f32(post), _f32(comb)
    T, N, D = x.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    n_pad, block_d, block_t = _tiles(N, D, T)
    with on_device(x.device):
        _post_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
            block_out, x, post, comb, out, T, D, N=N, N_PAD=n_pad, BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=_NUM_WARPS)
    return out


def post_backward(g, block_out, x, post, comb, need_bo, need_x, need_post, need_comb):
    """(g_bo, g_x, g_post, g_comb) of mhc_post's backward, [0] where not needed."""
    _KERNELS.build()
    block_out, x = block_out.contiguous(), x.contiguous()
    g = g.contiguous()
    post32, comb32 = _f32(post), _f32(comb)
    T, N, D = x.shape
    f32 = {"dtype": torch.float32, "device": x.device}
    g_bo = torch.empty_like(block_out) if need_bo else block_out.new_empty(0)
    g_x = torch.empty_like(x) if need_x else x.new_empty(0)
    g_post = torch.empty(T, N, **f32) if need_post else torch.empty(0, **f32)
    g_comb = torch.empty(T, N, N, **f32) if need_comb else torch.empty(0, **f32)
    if T == 0:
        return g_bo, g_x, g_post, g_comb
    n_pad, block_d, block_t = _tiles(N, D, T)
    with on_device(x.device):
        # (an output not asked for gets g in its place: never written, and a valid pointer, where
        # an empty tensor's may not be)
        _post_backward_kernel[(triton.cdiv(T, block_t),)](
            g, block_out, x, post32, comb32, g_bo if need_bo else g, g_x if need_x else g,
            g_post if need_post else post32, g_comb if need_comb else comb32, T, D, N=N, N_PAD=n_pad, BLOCK_T=block_t,
            BLOCK_D=block_d, NEED_BO=bool(need_bo), NEED_X=bool(need_x), NEED_POST=bool(need_post),
            NEED_COMB=bool(need_comb), num_warps=_NUM_WARPS)
    return g_bo, g_x, g_post, g_comb

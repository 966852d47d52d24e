"""MegaGate's Triton kernels: the fused router forward and backward on the GPU.

Each program takes a block of tokens, all of their experts in registers. The forward tile is
[BLOCK_T, G_PAD, PER_PAD], the experts laid out as groups of consecutive experts (one group when
the choice is not group-limited), each axis padded to a power of two as Triton's tiles must be:
a group's two best are a reduction along the last axis, the top k a reduction along both.
  _forward_kernel   scores, choice, groups, k rounds of max (lowest index among equal values:
                    torch.topk's order), weights; loads and probability sums by atomic adds
                    (one add per expert per program for the sums)
  _backward_kernel  scores again from the logits, the weights' gradient scattered into the
                    row, the score's backward: grad_logits [BLOCK_T, E_PAD]

The kernels are jitted on first use (kernels.triton_support's [Note: kernels jitted on first
use]): this module imports without triton, and the tests run them on Triton's interpreter.

Atomic float adds make prob_sum's rounding depend on the order programs finish in (the loads
are integers: exact). Expert ids in hash_indices outside [0, E) are not checked here (a kernel
cannot raise); their loads are masked, their weight is 0 and they are not counted.
"""

from __future__ import annotations

import torch

from hyperparallel.kernels.triton_support import JitKernels, on_device, reduce_max, reduce_min, reduce_sum, tl, triton

_SCORE_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
_TILE = 4096  # logits per program: 32 per thread at 4 warps
_MAX_BLOCK_T = 64
_NUM_WARPS = 4


# ------------------------------------------------------------------------------------ kernels
# Plain functions, made triton.jit functions of this module by _KERNELS.build() on first use; the
# reductions are kernels.triton_support's (its [Note: shared jit helpers]).

_KERNELS = JitKernels(globals(), shared=("reduce_max", "reduce_min", "reduce_sum"))
_jit = _KERNELS.register


@_jit
def _softplus(x):
    # log1p(e^x) as log(u) * z / (u - 1), u = 1 + z: exact to a few ulp also where z is tiny
    # (u - 1 is the part of z that u holds); above 20 softplus is x (PyTorch's threshold).
    z = tl.exp(x)
    u = 1.0 + z
    log1p = tl.where(u == 1.0, z, tl.log(u) * (z / (u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@_jit
def _elementwise_score(x, SCORE: tl.constexpr):
    if SCORE == 1:
        p = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.sqrt_rn(_softplus(x))
    return p


@_jit
def _forward_kernel(logits_ptr, bias_ptr, hash_ptr, w_ptr, idx_ptr, counts_ptr, psum_ptr, T, E, PER, scale, eps,
                    BLOCK_T: tl.constexpr, G_PAD: tl.constexpr, PER_PAD: tl.constexpr, K: tl.constexpr,
                    K_PAD: tl.constexpr, GROUPS: tl.constexpr, TOP_GROUPS: tl.constexpr, SCORE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr, AUX: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, PER_PAD)
    col = g[None, :, None] * PER + j[None, None, :]  # [1, G_PAD, PER_PAD] expert ids
    col_ok = (g[None, :, None] < GROUPS) & (j[None, None, :] < PER)
    ok = row_ok[:, None, None] & col_ok
    x = tl.load(logits_ptr + rows[:, None, None] * E + col, mask=ok, other=0.0)

    if SCORE == 0:  # softmax as PyTorch: exp(x - max) times the reciprocal of their sum
        m = reduce_max(reduce_max(tl.where(col_ok, x, float("-inf")), 2), 1)
        e = tl.where(col_ok, tl.exp(x - m[:, None, None]), 0.0)
        r = 1.0 / reduce_sum(reduce_sum(e, 2), 1)
        p = e * r[:, None, None]
    else:
        p = tl.where(col_ok, _elementwise_score(x, SCORE), 0.0)

    slot = tl.arange(0, K_PAD)[None, :]
    slot_ok = row_ok[:, None] & (slot < K)
    if HASH:
        chosen = tl.load(hash_ptr + rows[:, None] * K + slot, mask=slot_ok, other=0)
        in_range = slot_ok & (chosen >= 0) & (chosen < E)
        xs = tl.load(logits_ptr + rows[:, None] * E + chosen, mask=in_range, other=0.0)
        if SCORE == 0:
            ws = tl.exp(xs - m[:, None]) * r[:, None]
        else:
            ws = _elementwise_score(xs, SCORE)
        ws = tl.where(in_range, ws, 0.0)
        counted = in_range
    else:
        choice = p
        if HAS_BIAS:
            choice = p + tl.load(bias_ptr + col, mask=col_ok, other=0.0)
        choice = tl.where(col_ok, choice, float("-inf"))
        if GROUPS > 1:
            choice = _restrict_to_groups(choice, g, j, G_PAD, PER_PAD, GROUPS, TOP_GROUPS)
        chosen, ws = _top_k(choice, p, col, col_ok, BLOCK_T, K, K_PAD)
        counted = slot_ok

    if NORM:
        ws = ws / tl.where(row_ok, reduce_sum(ws, 1) + eps, 1.0)[:, None]  # rows past T: no 0 / 0
    ws = ws * scale
    tl.store(w_ptr + rows[:, None] * K + slot, ws, mask=slot_ok)
    tl.store(idx_ptr + rows[:, None] * K + slot, chosen, mask=slot_ok)
    tl.atomic_add(counts_ptr + chosen, tl.full(chosen.shape, 1, tl.int64), mask=counted)

    if AUX:  # this block's sum of the distribution, one atomic add per expert
        if SCORE == 0:
            q = p
        else:
            q = p / reduce_sum(reduce_sum(p, 2), 1)[:, None, None]
        q = tl.where(ok, q, 0.0)
        tl.atomic_add(psum_ptr + col, reduce_sum(q, 0)[None, :, :], mask=col_ok)


@_jit
def _restrict_to_groups(choice, g, j, G_PAD: tl.constexpr, PER_PAD: tl.constexpr, GROUPS: tl.constexpr,
                        TOP_GROUPS: tl.constexpr):
    """Experts outside the TOP_GROUPS groups of best two-expert sum at -inf."""
    best = reduce_max(choice, 2)  # [BLOCK_T, G_PAD]
    first = reduce_min(tl.where(choice == best[:, :, None], j[None, None, :], PER_PAD), 2)
    second = reduce_max(tl.where(j[None, None, :] == first[:, :, None], float("-inf"), choice), 2)
    group_ok = g[None, :] < GROUPS
    group_score = tl.where(group_ok, best + second, float("-inf"))
    selected = group_score != group_score  # all False, [BLOCK_T, G_PAD]
    for _ in tl.static_range(TOP_GROUPS):
        candidate = tl.where(selected, float("-inf"), group_score)
        top = reduce_max(candidate, 1)
        hit = (candidate == top[:, None]) & group_ok & ~selected
        pick = reduce_min(tl.where(hit, g[None, :], G_PAD), 1)
        selected = selected | (g[None, :] == pick[:, None])
    return tl.where(selected[:, :, None], choice, float("-inf"))


@_jit
def _top_k(choice, p, col, col_ok, BLOCK_T: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr):
    """(expert ids, scores) [BLOCK_T, K_PAD] of the K largest choices, by k rounds of max; among
    equal values the lowest id first. Slots past K hold 0."""
    slot = tl.arange(0, K_PAD)[None, :]
    # tl.full, not tl.zeros: tl.zeros is a jit function made when triton is imported, which the
    # interpreter cannot call when triton was imported before the interpreter mode was set
    chosen = tl.full((BLOCK_T, K_PAD), 0, dtype=tl.int64)
    ws = tl.full((BLOCK_T, K_PAD), 0, dtype=tl.float32)
    taken = choice != choice  # all False (the choice holds no NaN), of the block's shape
    big = 1 << 30
    for s in tl.range(K):
        candidate = tl.where(taken, float("-inf"), choice)
        top = reduce_max(reduce_max(candidate, 2), 1)
        hit = (candidate == top[:, None, None]) & col_ok & ~taken
        e = reduce_min(reduce_min(tl.where(hit, col, big), 2), 1)
        pick = col == e[:, None, None]
        taken = taken | pick
        w = reduce_sum(reduce_sum(tl.where(pick, p, 0.0), 2), 1)
        chosen = tl.where(slot == s, e[:, None].to(tl.int64), chosen)
        ws = tl.where(slot == s, w[:, None], ws)
    return chosen, ws


@_jit
def _backward_kernel(logits_ptr, idx_ptr, gw_ptr, gs_ptr, out_ptr, T, E, scale, eps, BLOCK_T: tl.constexpr,
                     E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SCORE: tl.constexpr,
                     HAS_GW: tl.constexpr, HAS_GS: tl.constexpr, NORM: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    col = tl.arange(0, E_PAD)[None, :]
    col_ok = col < E
    ok = row_ok[:, None] & col_ok
    x = tl.load(logits_ptr + rows[:, None] * E + col, mask=ok, other=0.0)
    if SCORE == 0:
        m = reduce_max(tl.where(col_ok, x, float("-inf")), 1)
        e = tl.where(col_ok, tl.exp(x - m[:, None]), 0.0)
        r = 1.0 / reduce_sum(e, 1)
        p = e * r[:, None]
    else:
        p = tl.where(col_ok, _elementwise_score(x, SCORE), 0.0)

    slot = tl.arange(0, K_PAD)[None, :]
    slot_ok = row_ok[:, None] & (slot < K)
    chosen = tl.load(idx_ptr + rows[:, None] * K + slot, mask=slot_ok, other=0)
    in_range = slot_ok & (chosen >= 0) & (chosen < E)
    g = tl.full((BLOCK_T, E_PAD), 0, dtype=tl.float32)
    if HAS_GW:
        xs = tl.load(logits_ptr + rows[:, None] * E + chosen, mask=in_range, other=0.0)
        if SCORE == 0:
            ws = tl.exp(xs - m[:, None]) * r[:, None]
        else:
            ws = _elementwise_score(xs, SCORE)
        ws = tl.where(in_range, ws, 0.0)
        dw = tl.load(gw_ptr + rows[:, None] * K + slot, mask=slot_ok, other=0.0) * scale
        if NORM:  # division's backward as PyTorch computes it
            denom = tl.where(row_ok, reduce_sum(ws, 1) + eps, 1.0)[:, None]  # rows past T: no 0 / 0
            through = reduce_sum(-dw * ((ws / denom) / denom), 1)
            dw = dw / denom + through[:, None]
        dw = tl.where(in_range, dw, 0.0)
        for s in tl.range(K):  # scatter-add: a hash table may repeat an expert
            e_s = reduce_sum(tl.where(slot == s, chosen, 0), 1)
            dw_s = reduce_sum(tl.where(slot == s, dw, 0.0), 1)
            g += tl.where(col == e_s[:, None], dw_s[:, None], 0.0)
    if HAS_GS:
        gs = tl.load(gs_ptr + col, mask=col_ok, other=0.0)
        if SCORE == 0:
            g += gs
        else:
            total = reduce_sum(p, 1)[:, None]
            through = reduce_sum(tl.where(col_ok, -gs * ((p / total) / total), 0.0), 1)
            g += tl.where(col_ok, gs / total + through[:, None], 0.0)

    if SCORE == 0:
        dot = reduce_sum(g * p, 1)
        dx = (g - dot[:, None]) * p
    elif SCORE == 1:
        dx = g * (1.0 - p) * p
    else:
        h = g / (2.0 * tl.where(col_ok, p, 1.0))  # padding: no 0 / 0
        z = tl.exp(x)
        dx = tl.where(x > 20.0, h, h * z / (z + 1.0))
    tl.store(out_ptr + rows[:, None] * E + col, dx, mask=ok)


# ----------------------------------------------------------------------------------- launches


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _block_t(row_elements: int, tokens: int) -> int:
    return max(1, min(_MAX_BLOCK_T, _TILE // row_elements, _pow2(tokens)))


def forward(logits, correction_bias, hash_indices, score, top_k, num_groups, top_groups, norm_topk_prob,
            routed_scaling_factor, norm_eps, aux_probs):
    """The op of mega_gate on the Triton kernels: (weights, indices, counts, prob_sum)."""
    _KERNELS.build()
    logits = logits.contiguous()
    tokens, num_experts = logits.shape
    device = logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    indices = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    prob_sum = torch.zeros(num_experts if aux_probs else 0, dtype=torch.float32, device=device)
    if tokens == 0:
        return weights, indices, counts, prob_sum
    hashed = hash_indices is not None
    groups = 1 if hashed else num_groups
    per_group = num_experts // groups
    g_pad, per_pad = _pow2(groups), _pow2(per_group)
    block_t = _block_t(g_pad * per_pad, tokens)
    bias = correction_bias.contiguous() if correction_bias is not None and not hashed else logits
    table = hash_indices.contiguous() if hashed else indices  # unread when not hashed
    with on_device(device):
        _forward_kernel[(triton.cdiv(tokens, block_t),)](
            logits, bias, table, weights, indices, counts, prob_sum if aux_probs else weights, tokens, num_experts,
            per_group, float(routed_scaling_factor), float(norm_eps), BLOCK_T=block_t, G_PAD=g_pad,
            PER_PAD=per_pad, K=top_k, K_PAD=_pow2(top_k), GROUPS=groups, TOP_GROUPS=top_groups,
            SCORE=_SCORE_CODES[score], HAS_BIAS=correction_bias is not None and not hashed, HASH=hashed,
            NORM=bool(norm_topk_prob), AUX=bool(aux_probs), num_warps=_NUM_WARPS)
    return weights, indices, counts, prob_sum


def backward(logits, indices, grad_weights, grad_prob_sum, score, top_k, norm_topk_prob, routed_scaling_factor,
             norm_eps):
    """grad_logits from the gradients w.r.t. the weights and prob_sum (either may be None)."""
    _KERNELS.build()
    logits, indices = logits.contiguous(), indices.contiguous()
    tokens, num_experts = logits.shape
    grad_logits = torch.empty_like(logits)
    if tokens == 0:
        return grad_logits
    e_pad = _pow2(num_experts)
    block_t = _block_t(e_pad, tokens)
    gw = grad_weights.contiguous() if grad_weights is not None else logits
    gs = grad_prob_sum.contiguous() if grad_prob_sum is not None else logits
    with on_device(logits.device):
        _backward_kernel[(triton.cdiv(tokens, block_t),)](
            logits, indices, gw, gs, grad_logits, tokens, num_experts, float(routed_scaling_factor),
            float(norm_eps), BLOCK_T=block_t, E_PAD=e_pad, K=top_k, K_PAD=_pow2(top_k), SCORE=_SCORE_CODES[score],
            HAS_GW=grad_weights is not None, HAS_GS=grad_prob_sum is not None, NORM=bool(norm_topk_prob),
            num_warps=_NUM_WARPS)
    return grad_logits

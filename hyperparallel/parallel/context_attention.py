"""Exact causal attention over a sequence split among the ranks of a context-parallel group.

Layout (load-balanced for causal attention): the sequence of S tokens is cut into 2 * cp chunks
of S / (2 * cp); rank r holds chunks r and 2 * cp - 1 - r, in that order. Every rank then has
as many (query, key) pairs under the causal mask as every other. Inputs are this rank's part,
[B, heads, S / cp, head_dim] (SDPA's layout); key / value may have fewer heads than the query
(grouped-query attention) and the value another head dim than query and key (MLA). The mask is
by global position: a query attends to the keys at or before it in the whole sequence.

- `ulysses_attention`: an all-to-all turns "all heads, my tokens" into "my heads, all tokens";
  each rank runs causal SDPA on the whole sequence for heads / cp heads; another all-to-all
  turns it back. Three all-to-alls in, one out, each of a rank's local activations.
- `ring_attention`: the queries stay; the keys / values travel around the ring (cp - 1 hops) and
  each rank merges its queries' attention to every block it holds by the log-sum-exp (online
  softmax). Backward recomputes each block's probabilities from the saved log-sum-exp (flash
  attention's way: no block's score matrix is kept), and the key / value gradients travel
  around the ring with their blocks back to their owners. On CPU each block is one call of
  torch's fused flash attention kernel, which returns the block's log-sum-exp; its backward,
  given the merged output and log-sum-exp, gives the block's exact share of the gradients (the
  softmax's rowsum(dO * O) term and the probabilities exp(s - lse) are the whole row's). On
  other devices (no fused kernel verified there yet) the blocks are hand-written score tiles.

[Note: which blocks a query chunk sees]
The block of rank s holds chunks (s, 2cp-1-s), ascending. Query chunk a attends to key chunk b
fully if b < a, causally if b == a, not at all if b > a; so the keys it sees in a block are a
prefix of the block (none, its first chunk, or both), and only the prefix's last chunk can be
the diagonal one. At step 0 (its own block) a rank computes three chunk pairs (two diagonal
halves and one full); at every other step exactly two full ones: all its queries against the
block's first chunk (s < r), or its second query chunk against the whole block (s > r).
So every step is one product for the fused kernel: at step 0 the causal mask over the rank's
own tokens by their local index (query i sees keys 0..i) is the global one (its first chunk
precedes its second), and every other step is one unmasked rectangle.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyperparallel import traffic
from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.parallel.recompute import nothing_kept

# The hand-written blocks (devices other than CPU, or `_FUSED_CPU` off): fp32 elements of one
# tile's score matrix (two such matrices are alive at once in backward). The query rows of a
# block are taken this many scores at a time, which bounds the transient memory (16 MiB a
# matrix) at any sequence length (8k tokens, cp=2, 16 heads: 64 query rows a tile).
_TILE_SCORES = 1 << 22
# CPU blocks by torch's fused flash attention kernel (off: the hand-written tiles, for tests)
_FUSED_CPU = True
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# Whether the CPU kernel takes fewer key/value heads than query heads (GQA) itself: verified on
# torch 2.13 (forward and backward equal to SDPA's enable_gqa); the kernel's 2024 source indexes
# the key by the query's head, so before 2.13 the key/value heads are repeated to the query's
# first (measured on 2.13: 3-8% slower a block).
_NATIVE_GQA = torch.__version__ >= (2, 13)
# P2P tags: keys / values and their gradients are in flight to the same peer at once
_KV_TAG, _GRAD_TAG = 11, 12


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp) of the sequence that `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def check_sequence(seq_len: int, cp: int) -> None:
    if cp < 1 or seq_len % (2 * cp):
        raise ConfigError(f"context parallelism cuts each sequence into 2 * cp chunks: the sequence length {seq_len} "
                          f"does not divide by 2 * cp = {2 * cp} (cp={cp}); make it a multiple of {2 * cp}")


def check_heads(heads: int, cp: int) -> None:
    if heads % cp:
        raise ConfigError(f"ulysses context parallelism splits the attention heads among the cp ranks: {heads} "
                          f"query heads do not divide by cp={cp}; use a cp that divides {heads}, or cp_mode ring")


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: int) -> None:
    batch, heads, local, dim = query.shape
    if key.shape[:3] != value.shape[:3] or key.shape[0] != batch or key.shape[2] != local or key.shape[3] != dim:
        raise ShapeError(f"context-parallel attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                          f"{tuple(value.shape)} must be [batch, heads, local tokens, head_dim] with matching sizes")
    if heads % key.shape[1]:
        raise ShapeError(f"context-parallel attention: {heads} query heads are not a multiple of {key.shape[1]} "
                          "key/value heads")
    check_sequence(local * cp, cp)


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """Each key/value head repeated for the query heads that share it (transformers' repeat_kv)."""
    if times == 1:
        return x
    batch, heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, heads, times, seq, dim).reshape(batch, heads * times, seq, dim)


# ---------------------------------------------------------------------------------------------
# ulysses


class _AllToAll(torch.autograd.Function):
    """Block i of dim 0 goes to rank i of the group. The blocks are equal, so the adjoint (the
    gradients back to where their inputs came from) is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()  # all_to_all_single splits the flat storage; a gradient may arrive strided
    out = torch.empty_like(x)
    traffic.all_to_all("cp", x, None, group)
    dist.all_to_all_single(out, x, group=group)
    return out


@functools.lru_cache(maxsize=16)
def _gathered_order(seq_len: int, cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered, natural): the global positions of the sequence as an all-to-all gathers it (rank
    0's part, rank 1's, ...), and the order that sorts them (gathered[natural] = 0..S-1). Cached:
    every layer of every step asks for the same two (a host-to-device copy saved each time)."""
    chunk = seq_len // (2 * cp)
    starts = [c * chunk for rank in range(cp) for c in local_chunks(cp, rank)]
    gathered = (torch.tensor(starts, device=device)[:, None] + torch.arange(chunk, device=device)).reshape(-1)
    return gathered, torch.argsort(gathered)


def _sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[B, H, S/cp, D] (all heads, local tokens) -> [B, H/cp, S, D] (local heads, every rank's tokens)."""
    batch, heads, local, dim = x.shape
    blocks = x.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1)
    received = _AllToAll.apply(blocks, group)  # [source rank, B, H/cp, S/cp, D]
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of `_sequence_to_heads`."""
    batch, heads, seq, dim = x.shape
    blocks = x.reshape(batch, heads, cp, seq // cp, dim).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(blocks, group)  # [source rank (its heads), B, H/cp, S/cp, D]
    return received.transpose(0, 1).reshape(batch, cp * heads, seq // cp, dim)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                      scaling: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, [B, H, S/cp, Dv], by
    all-to-all over `group` (the cp ranks; every rank calls it). Differentiable."""
    cp = dist.get_world_size(group)
    _check_inputs(query, key, value, cp)
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, cp)
    if kv_heads % cp:
        # Each rank needs the key/value heads of its heads / cp query heads; when the key/value
        # heads do not split evenly among the ranks (fewer than cp, say) they are repeated up to
        # one per query head first: GQA's smaller key/value then does not carry over to the wire.
        key, value = _repeat_heads(key, heads // kv_heads), _repeat_heads(value, heads // kv_heads)
        kv_heads = heads
    gathered, natural = _gathered_order(query.shape[2] * cp, cp, query.device)
    q, k, v = (_sequence_to_heads(x, group, cp).index_select(2, natural) for x in (query, key, value))
    groups = heads // kv_heads
    # transformers' rule for SDPA's own GQA: the fused kernels take it only with equal head dims
    native_gqa = groups > 1 and k.shape[-1] == v.shape[-1] <= 256
    if groups > 1 and not native_gqa:
        k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=native_gqa)
    return _heads_to_sequence(out.index_select(2, gathered), group, cp)


# ---------------------------------------------------------------------------------------------
# ring


class _Ring:
    """This rank's neighbours in the group: blocks go to the next rank and come from the previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        """Start sending `send` to the next rank and receiving the previous rank's into `recv`."""
        traffic.ring_pass("cp", send)
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        return dist.batch_isend_irecv(ops)

    def add_and_pass(self, grads: torch.Tensor, arriving: torch.Tensor | None, works: list):
        """The held block's key/value gradients: this rank's part plus the sum arriving from the
        ranks before it, sent on (after the last step, to the block's owner, the next rank).
        Returns what then arrives and the works to wait for."""
        for work in works:
            work.wait()
        if arriving is not None:
            grads += arriving
        if self.size == 1:
            return grads, []
        arriving = torch.empty_like(grads)
        return arriving, self.shift(grads, arriving, _GRAD_TAG)

    def owner(self, step: int) -> int:
        """Whose keys / values this rank holds at `step` (its own at step 0)."""
        return (self.rank - step) % self.size


def _segments(cp: int, rank: int, owner: int, chunk: int) -> list[tuple[int, int, int, bool]]:
    """(first row, end row, keys, diagonal) of this rank's queries that see the block of `owner`:
    rows [first, end) attend to the block's first `keys` keys, the last chunk of which causally
    when `diagonal` ([Note: which blocks a query chunk sees])."""
    held = local_chunks(cp, owner)
    segments = []
    for i, a in enumerate(local_chunks(cp, rank)):
        seen = [b for b in held if b <= a]
        if not seen:
            continue
        keys, diagonal = len(seen) * chunk, seen[-1] == a
        if segments and not diagonal and not segments[-1][3] and segments[-1][2] == keys:
            segments[-1] = (segments[-1][0], (i + 1) * chunk, keys, False)  # one product for both chunks
        else:
            segments.append((i * chunk, (i + 1) * chunk, keys, diagonal))
    return segments


def _tiles(segments, chunk: int, scores_per_row: int, device):
    """(rows, keys, mask) per tile: query rows [rows) attend to keys [0, keys); mask [rows, keys]
    (True where attended) on a diagonal tile, else None. A diagonal tile stops at its last row's
    key: every later one is masked for all its rows."""
    step = max(1, _TILE_SCORES // max(1, scores_per_row))
    for first, end, keys, diagonal in segments:
        for lo in range(first, end, step):
            hi = min(lo + step, end)
            if not diagonal:
                yield slice(lo, hi), keys, None
                continue
            diagonal_start = keys - chunk  # the block's key index of the diagonal chunk's first key
            seen = diagonal_start + hi - first
            rows = torch.arange(lo - first, hi - first, device=device)
            mask = torch.arange(seen, device=device)[None, :] <= (diagonal_start + rows)[:, None]
            yield slice(lo, hi), seen, mask


def _to_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, kv_heads, S * groups, D] float32: the query heads that share a key/value
    head become rows of one matrix (token-major: rows [i * groups, (i + 1) * groups) are token i's),
    so one product per key/value head serves them all and a range of tokens is a range of rows."""
    batch, heads, seq, dim = x.shape
    groups = heads // kv_heads
    rows = x.reshape(batch, kv_heads, groups, seq, dim).transpose(2, 3).to(torch.float32)
    return rows.reshape(batch, kv_heads, seq * groups, dim)


def _from_rows(x: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    batch, kv_heads, rows, dim = x.shape
    groups = heads // kv_heads
    return x.reshape(batch, kv_heads, rows // groups, groups, dim).transpose(2, 3).reshape(
        batch, heads, rows // groups, dim).to(dtype)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, groups: int) -> torch.Tensor:
    if mask is not None:
        batch, kv_heads, rows, keys = scores.shape
        scores.view(batch, kv_heads, rows // groups, groups, keys).masked_fill_(~mask[:, None, :], float("-inf"))
    return scores


def _unpack(buffer: torch.Tensor, key_shape, value_shape) -> tuple[torch.Tensor, torch.Tensor]:
    split = key_shape.numel()
    return buffer[:split].view(key_shape), buffer[split:].view(value_shape)


def _block(cp: int, rank: int, owner: int, chunk: int) -> tuple[slice, int, bool]:
    """(rows, keys, causal) of the one fused product for the block of `owner`: query rows [rows)
    attend to the block's keys [0, keys), under the causal mask by local index when `causal`
    ([Note: which blocks a query chunk sees])."""
    if owner == rank:
        return slice(0, 2 * chunk), 2 * chunk, True
    (first, end, keys, diagonal), = _segments(cp, rank, owner, chunk)  # one full rectangle
    assert not diagonal
    return slice(first, end), keys, False


def _padded(x: torch.Tensor, dim: int) -> torch.Tensor:
    """float32, the head dim zero-padded to `dim`: the fused kernel takes one head dim for query,
    key and value. Exact: zero query/key columns add nothing to a score (the scale is given), zero
    value columns give zero output columns, which add nothing to rowsum(dO * O) or dO V^T."""
    x = x.to(torch.float32)
    return F.pad(x, (0, dim - x.shape[-1])) if x.shape[-1] < dim else x


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's normalized output and log-sum-exp into the running ones (views), in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_((lse - merged).exp_().unsqueeze(-1)).add_(block_out.mul_((block_lse - merged).exp_().unsqueeze(-1)))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    # float32 inside means float32 under autocast too: forward and backward turn it off
    @staticmethod
    def forward(ctx, query, key, value, scaling: float, group: dist.ProcessGroup):
        # (it writes into its own products in place, the fused kernel's outputs among them, which
        # selective recompute would otherwise keep: it must keep none of them)
        with torch.autocast(query.device.type, enabled=False), nothing_kept():
            ctx.fused = _FUSED_CPU and query.device.type == "cpu"
            if ctx.fused:
                return _RingAttention._forward_fused(ctx, query, key, value, scaling, group)
            return _RingAttention._forward_tiles(ctx, query, key, value, scaling, group)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.fused:
                return _RingAttention._backward_fused(ctx, grad_out)
            return _RingAttention._backward_tiles(ctx, grad_out)

    @staticmethod
    def _forward_fused(ctx, query, key, value, scaling: float, group: dist.ProcessGroup):
        ring = _Ring(group)
        chunk, dim = query.shape[2] // 2, max(query.shape[-1], value.shape[-1])
        repeats = 1 if _NATIVE_GQA else query.shape[1] // key.shape[1]
        q = _padded(query, dim)
        out = lse = None  # normalized float32 output and log-sum-exp [B, H, S/cp], merged so far
        buffers = [torch.cat([key.reshape(-1), value.reshape(-1)]), None]
        buffers[1] = torch.empty_like(buffers[0])
        for step in range(ring.size):
            held = buffers[step % 2]
            # the next hop is in flight while this block is computed
            works = ring.shift(held, buffers[(step + 1) % 2], _KV_TAG) if step < ring.size - 1 else []
            k, v = (_repeat_heads(_padded(x, dim), repeats) for x in _unpack(held, key.shape, value.shape))
            rows, keys, causal = _block(ring.size, ring.rank, ring.owner(step), chunk)
            block_out, block_lse = _flash_cpu(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], 0.0, causal,
                                              scale=scaling)
            if out is None:  # step 0: every row, each seeing at least itself
                out, lse = block_out, block_lse
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            for work in works:
                work.wait()
        if dim > value.shape[-1]:  # a copy without the padding: the padded one is freed
            out = out[..., :value.shape[-1]].contiguous()
        result = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.scaling, ctx.group = scaling, group
        return result

    @staticmethod
    def _backward_fused(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        scaling, ring = ctx.scaling, _Ring(ctx.group)
        chunk, dim = query.shape[2] // 2, max(query.shape[-1], value.shape[-1])
        repeats = 1 if _NATIVE_GQA else query.shape[1] // key.shape[1]
        # the output as saved (in the input's dtype) makes rowsum(dO * O), as flash attention's does
        q, d_out, out = _padded(query, dim), _padded(grad_out, dim), _padded(out, dim)
        d_q = None
        kv_elements = key.numel() + value.numel()
        buffers = [torch.cat([key.reshape(-1), value.reshape(-1)]), None]
        buffers[1] = torch.empty_like(buffers[0])
        arriving, grad_works = None, []
        for step in range(ring.size):
            held = buffers[step % 2]
            kv_works = ring.shift(held, buffers[(step + 1) % 2], _KV_TAG) if step < ring.size - 1 else []
            k, v = (_repeat_heads(_padded(x, dim), repeats) for x in _unpack(held, key.shape, value.shape))
            rows, keys, causal = _block(ring.size, ring.rank, ring.owner(step), chunk)
            # the block's share, from the merged output and log-sum-exp (the whole rows')
            block_dq, block_dk, block_dv = _flash_cpu_backward(
                d_out[:, :, rows], q[:, :, rows], k[:, :, :keys], v[:, :, :keys], out[:, :, rows], lse[:, :, rows],
                0.0, causal, scale=scaling)
            if d_q is None:  # step 0: every row
                d_q = block_dq
            else:
                d_q[:, :, rows] += block_dq
            # this rank's part of the held block's key/value gradients; the parts of the ranks
            # before it arrive meanwhile, and the sum goes on with the block
            grads = torch.zeros(kv_elements, dtype=torch.float32, device=query.device)
            d_k, d_v = _unpack(grads, key.shape, value.shape)
            if repeats > 1:  # each key/value head's share: the sum over the query heads it served
                block_dk, block_dv = (x.unflatten(1, (key.shape[1], repeats)).sum(dim=2) for x in (block_dk, block_dv))
            d_k[:, :, :keys] = block_dk[..., :key.shape[-1]]
            d_v[:, :, :keys] = block_dv[..., :value.shape[-1]]
            arriving, grad_works = ring.add_and_pass(grads, arriving, grad_works)
            for work in kv_works:
                work.wait()
        for work in grad_works:
            work.wait()
        d_k, d_v = _unpack(arriving, key.shape, value.shape)
        return (d_q[..., :query.shape[-1]].to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None, None)

    @staticmethod
    def _forward_tiles(ctx, query, key, value, scaling: float, group: dist.ProcessGroup):
        ring = _Ring(group)
        batch, heads, local, _ = query.shape
        kv_heads, groups, chunk = key.shape[1], heads // key.shape[1], local // 2
        q = _to_rows(query, kv_heads)
        out = q.new_zeros(batch, kv_heads, local * groups, value.shape[-1])  # unnormalized, by `peak`
        peak = q.new_full((batch, kv_heads, local * groups), float("-inf"))
        total = q.new_zeros(batch, kv_heads, local * groups)
        # keys and values travel as one buffer (one message a hop), in their own dtype
        buffers = [torch.cat([key.reshape(-1), value.reshape(-1)]), None]
        buffers[1] = torch.empty_like(buffers[0])
        for step in range(ring.size):
            held = buffers[step % 2]
            # the next hop is in flight while this block is computed
            works = ring.shift(held, buffers[(step + 1) % 2], _KV_TAG) if step < ring.size - 1 else []
            k, v = (x.to(torch.float32) for x in _unpack(held, key.shape, value.shape))
            segments = _segments(ring.size, ring.rank, ring.owner(step), chunk)
            for rows, keys, mask in _tiles(segments, chunk, batch * heads * 2 * chunk, query.device):
                r = slice(rows.start * groups, rows.stop * groups)
                scores = _masked(torch.matmul(q[:, :, r], k[:, :, :keys].transpose(-1, -2)).mul_(scaling), mask, groups)
                new_peak = torch.maximum(peak[:, :, r], scores.amax(dim=-1))
                probs = scores.sub_(new_peak.unsqueeze(-1)).exp_()
                rescale = (peak[:, :, r] - new_peak).exp_()
                total[:, :, r].mul_(rescale).add_(probs.sum(dim=-1))
                out[:, :, r].mul_(rescale.unsqueeze(-1)).add_(torch.matmul(probs, v[:, :, :keys]))
                peak[:, :, r] = new_peak
            for work in works:
                work.wait()
        # every query attends at least to itself (step 0's diagonal): `total` is positive
        out.div_(total.unsqueeze(-1))
        lse = peak.add_(total.log_())
        result = _from_rows(out, heads, query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.scaling, ctx.group = scaling, group
        return result

    @staticmethod
    def _backward_tiles(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        scaling, ring = ctx.scaling, _Ring(ctx.group)
        batch, heads, local, _ = query.shape
        kv_heads, groups, chunk = key.shape[1], heads // key.shape[1], local // 2
        q, d_out = _to_rows(query, kv_heads), _to_rows(grad_out, kv_heads)
        # rowsum(dO * O): the softmax's backward term, one per query row
        delta = (d_out * _to_rows(out, kv_heads)).sum(dim=-1)
        d_q = torch.zeros_like(q)
        kv_elements = key.numel() + value.numel()
        buffers = [torch.cat([key.reshape(-1), value.reshape(-1)]), None]
        buffers[1] = torch.empty_like(buffers[0])
        arriving, grad_works = None, []
        for step in range(ring.size):
            held = buffers[step % 2]
            kv_works = ring.shift(held, buffers[(step + 1) % 2], _KV_TAG) if step < ring.size - 1 else []
            k, v = (x.to(torch.float32) for x in _unpack(held, key.shape, value.shape))
            # this rank's part of the held block's key/value gradients; the parts of the ranks
            # before it arrive meanwhile, and the sum goes on with the block
            grads = torch.zeros(kv_elements, dtype=torch.float32, device=query.device)
            d_k, d_v = _unpack(grads, key.shape, value.shape)
            segments = _segments(ring.size, ring.rank, ring.owner(step), chunk)
            for rows, keys, mask in _tiles(segments, chunk, batch * heads * 2 * chunk, query.device):
                r = slice(rows.start * groups, rows.stop * groups)
                q_r, d_out_r = q[:, :, r], d_out[:, :, r]
                scores = _masked(torch.matmul(q_r, k[:, :, :keys].transpose(-1, -2)).mul_(scaling), mask, groups)
                probs = scores.sub_(lse[:, :, r].unsqueeze(-1)).exp_()
                d_v[:, :, :keys].add_(torch.matmul(probs.transpose(-1, -2), d_out_r))
                d_scores = torch.matmul(d_out_r, v[:, :, :keys].transpose(-1, -2))
                d_scores.sub_(delta[:, :, r].unsqueeze(-1)).mul_(probs)
                d_q[:, :, r].add_(torch.matmul(d_scores, k[:, :, :keys]), alpha=scaling)
                d_k[:, :, :keys].add_(torch.matmul(d_scores.transpose(-1, -2), q_r), alpha=scaling)
            arriving, grad_works = ring.add_and_pass(grads, arriving, grad_works)
            for work in kv_works:
                work.wait()
        for work in grad_works:
            work.wait()
        d_k, d_v = _unpack(arriving, key.shape, value.shape)
        return (_from_rows(d_q, heads, query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None, None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: dist.ProcessGroup,
                   scaling: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, [B, H, S/cp, Dv], with the
    keys / values passed around `group` (the cp ranks; every rank calls it). Computed in float32,
    returned in the query's dtype. Differentiable."""
    cp = dist.get_world_size(group)
    _check_inputs(query, key, value, cp)
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return _RingAttention.apply(query, key.contiguous(), value.contiguous(), scaling, group)

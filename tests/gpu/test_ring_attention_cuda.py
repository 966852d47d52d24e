"""Ring attention's CUDA path (the hand-written tiles; the CPU takes torch's fused flash kernel)
on one GPU, forward and backward, against torch's own causal attention on the same device.

One GPU holds one rank (NCCL refuses two ranks on one device), so the ring here has one rank in a
gloo group: its one block is the causal diagonal, computed by the same tiles, merges and
recomputing backward as every block of a longer ring (tests/dist/test_context_parallel.py runs
rings of 2 and 4 ranks through these tiles on the CPU). Run by scripts/gpu_check.sh.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyperparallel.parallel import context_attention
from tests.dist.spawn import free_port
from tests.gpu.helpers import CUDA, assert_near, leaf_like, requires_cuda

pytestmark = requires_cuda


@pytest.fixture(scope="module")
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# the same tiles on the CPU against the CPU's SDPA: 4.6e-7 (fp32), 1.5e-3 (bf16: dq, dk) in norm
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tile_scores", [None, 2 * 8 * 64])  # the default tiles, and one query row a tile
def test_ring_attention_on_cuda_matches_sdpa(one_rank, monkeypatch, dtype, rel, tile_scores):
    if tile_scores is not None:
        monkeypatch.setattr(context_attention, "_TILE_SCORES", tile_scores)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 256, 64, generator=g).to(dtype)
    k = torch.randn(2, 2, 256, 64, generator=g).to(dtype)  # grouped query heads: 4 queries a key head
    v = torch.randn(2, 2, 256, 64, generator=g).to(dtype)
    grad = torch.randn(2, 8, 256, 64, generator=g).to(dtype)
    results = {}
    for name in ("ring", "sdpa"):
        qi, ki, vi = (leaf_like(t, CUDA) for t in (q, k, v))
        if name == "ring":
            out = context_attention.ring_attention(qi, ki, vi, one_rank)
        else:
            out = F.scaled_dot_product_attention(qi.float(), ki.float(), vi.float(), is_causal=True,
                                                 enable_gqa=True).to(dtype)
        out.backward(grad.to(CUDA))
        results[name] = (out, qi.grad, ki.grad, vi.grad)
    for what, got, want in zip(("out", "dq", "dk", "dv"), results["ring"], results["sdpa"], strict=True):
        assert got.device.type == "cuda"
        assert_near(got, want, rel, what)

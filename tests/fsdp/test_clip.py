"""fsdp.clip_grad_norm_ in one process (a world of one rank) against torch.nn.utils.clip_grad_norm_:
the same norm and the same scaled gradients, in float32 and bfloat16, and replicated gradients
counted once. Sharded ranks against one process: tests/dist/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.fsdp import clip_grad_norm_
from tests.dist.ranks import leave


@pytest.fixture(autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    leave()


def model_with_grads(dtype: torch.dtype, scale: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5, bias=False)).to(dtype)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * scale).to(dtype)
    model[1].bias.grad = None  # a parameter without a gradient
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_norm", [0.5, 1e6, float("inf")])
def test_the_norm_and_the_scaled_grads_are_torchs(dtype, max_norm):
    ours, theirs = model_with_grads(dtype, 0.3), model_with_grads(dtype, 0.3)
    got = clip_grad_norm_(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.grad is not None], max_norm)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        if b.grad is None:
            assert a.grad is None
        else:
            assert a.grad.dtype == dtype
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=0)


def test_a_gradient_held_by_k_ranks_counts_once():
    model = model_with_grads(torch.float32, 1.0)
    squares = {name: p.grad.double().square().sum() for name, p in model.named_parameters() if p.grad is not None}
    want = sum(v / (3 if name == "0.weight" else 1) for name, v in squares.items()).sqrt()
    got = clip_grad_norm_(model, float("inf"), replicas={"0.weight": 3})
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_a_rank_without_gradients_gives_zero():
    model = nn.Linear(3, 2)
    assert clip_grad_norm_(model, 1.0).item() == 0.0

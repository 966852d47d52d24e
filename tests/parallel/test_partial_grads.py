"""TP's partial-gradient sum (parallel/partial_grads.py) in one process: the ranks are threads,
their all-reduce a sum over the threads' buffers. Whole-group partial gradients sum over every
rank, a replicated key/value weight's over the ranks sharing its slot; one all-reduce per dtype;
the parameters found once and again only when a module holds another Parameter. The trainer's
layouts against one process: tests/dist/test_parallel_layouts.py."""

from __future__ import annotations

import threading

import torch
from torch import nn

from hyperparallel.parallel import partial_grads
from hyperparallel.parallel.partial_grads import PartialGradSum

TP, KV = 4, 2  # 4 ranks, 2 key/value heads: ranks 0, 1 share slot 0, ranks 2, 3 slot 1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(3)  # summed over the group (weight and bias)
        self.k_proj = nn.Linear(3, 2)  # a replicated key/value weight (and bias)
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.float64))  # another dtype: its own all-reduce
        self.o_proj = nn.Linear(2, 3, bias=False)  # TP-split: exact on its rank, not summed


def partial(rank: int) -> dict:
    slot = (rank * KV // TP, KV)
    return {"norm.weight": None, "norm.bias": None, "scale": None, "k_proj.weight": slot, "k_proj.bias": slot}


def with_grads(rank: int) -> Block:
    block = Block()
    for i, p in enumerate(block.parameters()):
        p.grad = torch.full(p.shape, float(10 * rank + i), dtype=p.dtype)
    return block


class ThreadRanks:
    """all_reduce (sum) over TP threads, each passing its own buffer; counts the calls."""

    def __init__(self):
        self.barrier, self.buffers, self.calls = threading.Barrier(TP), {}, 0

    def all_reduce(self, tensor, group=None):
        rank = group
        self.buffers[rank] = tensor.clone()
        if rank == 0:
            self.calls += 1
        self.barrier.wait()
        tensor.copy_(sum(self.buffers[r] for r in range(TP)))
        self.barrier.wait()


def run(blocks: list[Block], sums: list[PartialGradSum | None], monkeypatch) -> ThreadRanks:
    ranks = ThreadRanks()
    monkeypatch.setattr(partial_grads.dist, "all_reduce", ranks.all_reduce)

    def one(rank):
        if sums[rank] is None or not sums[rank]():
            sums[rank] = PartialGradSum.of(blocks[rank], partial(rank), group=rank)  # (the group: the rank)
            sums[rank]()

    threads = [threading.Thread(target=one, args=(r,)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ranks


def test_each_partial_gradient_is_summed_over_the_ranks_that_share_it(monkeypatch):
    blocks = [with_grads(r) for r in range(TP)]
    ranks = run(blocks, [None] * TP, monkeypatch)
    assert ranks.calls == 2  # float32 and float64
    for rank, block in enumerate(blocks):
        sharing = [r for r in range(TP) if r * KV // TP == rank * KV // TP]
        for i, (name, p) in enumerate(block.named_parameters()):
            value = float(10 * rank + i)
            if name in ("norm.weight", "norm.bias", "scale"):
                value = float(sum(10 * r + i for r in range(TP)))
            elif name.startswith("k_proj"):
                value = float(sum(10 * r + i for r in sharing))
            assert torch.equal(p.grad, torch.full(p.shape, value, dtype=p.dtype)), (rank, name)


def test_the_parameters_are_found_once_and_again_when_a_module_holds_another(monkeypatch):
    blocks = [with_grads(r) for r in range(TP)]
    sums: list[PartialGradSum | None] = [None] * TP
    run(blocks, sums, monkeypatch)
    made = list(sums)
    run(blocks, sums, monkeypatch)
    assert all(a is b for a, b in zip(sums, made, strict=True))
    for block in blocks:  # what fully_shard does: another Parameter object at the same place
        block.norm.weight = nn.Parameter(block.norm.weight.detach().clone())
        block.norm.weight.grad = torch.ones(3)
    run(blocks, sums, monkeypatch)
    assert all(a is not b for a, b in zip(sums, made, strict=True))
    assert all(torch.equal(b.norm.weight.grad, torch.full((3,), float(TP))) for b in blocks)


def test_a_parameter_without_a_gradient_adds_zeros_and_keeps_none(monkeypatch):
    blocks = [with_grads(r) for r in range(TP)]
    blocks[0].norm.bias.grad = None
    run(blocks, [None] * TP, monkeypatch)
    assert blocks[0].norm.bias.grad is None
    i = [name for name, _ in Block().named_parameters()].index("norm.bias")
    assert torch.equal(blocks[1].norm.bias.grad, torch.full((3,), float(sum(10 * r + i for r in range(1, TP)))))

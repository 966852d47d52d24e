"""fully_shard on 2 and 3 gloo ranks against one process training the same model on the same batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hyperparallel.fsdp.fully_shard import clip_grad_norm_, fully_shard, shard_info

STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # deliberately uneven shapes: 13 and 5 rows never split evenly
    return nn.Sequential(nn.Sequential(nn.Linear(7, 13), nn.Tanh()), nn.Sequential(nn.Linear(13, 5), nn.Tanh()),
                         nn.Linear(5, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)


def reference() -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def worker(rank, world, geometry, align, reshard, out_dir):
    # a file rendezvous: no TCP port that another test could be holding
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_model()
    for block in list(model)[:2]:
        fully_shard(block, geometry=geometry, align=align, reshard_after_forward=reshard)
    fully_shard(model, geometry=geometry, align=align, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    per_rank = 12 // world
    for step in range(STEPS):
        x, y = batch(step)
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
    shards = [(shard_info(p), p.detach().clone()) for p in model.parameters()]
    torch.save(shards, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("geometry, align", [("chunk", 1), ("balanced", 1), ("balanced", 32)])
@pytest.mark.parametrize("reshard", [True, False])
def test_sharded_training_matches_one_process(tmp_path, world, geometry, align, reshard):
    mp.spawn(worker, args=(world, geometry, align, reshard, str(tmp_path)), nprocs=world)
    want = reference()
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for i, full in enumerate(want):
        rows = full.reshape(full.shape[0], -1) if full.dim() else full.reshape(1, 1)
        for r in range(world):
            info, shard = per_rank[r][i]
            assert info.global_shape == full.shape
            torch.testing.assert_close(shard.reshape(info.length, rows.shape[1]), rows[info.offset:info.offset + info.length],
                                       rtol=1e-5, atol=1e-6)
        assert sum(per_rank[r][i][0].length for r in range(world)) == rows.shape[0]


def test_fully_shard_needs_a_process_group_and_refuses_a_second_sharding():
    from hyperparallel.errors import ConfigError

    with pytest.raises(ConfigError, match="needs torch.distributed initialized"):
        fully_shard(nn.Linear(2, 2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = fully_shard(nn.Linear(2, 2))
        with pytest.raises(ConfigError, match="already sharded"):
            fully_shard(layer)
    finally:
        dist.destroy_process_group()


def accumulate_worker(rank, world, out_dir):
    from hyperparallel.fsdp.fully_shard import set_requires_gradient_sync

    # a file rendezvous: no TCP port that another test could be holding
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    model = make_model()
    for block in list(model)[:2]:
        fully_shard(block)
    fully_shard(model)
    x, y = batch(0)
    per_rank = 12 // world
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    half = per_rank // 2
    set_requires_gradient_sync(model, False)  # first micro-batch: no communication
    (torch.nn.functional.mse_loss(model(xs[:half]), ys[:half]) / 2).backward()
    set_requires_gradient_sync(model, True)
    (torch.nn.functional.mse_loss(model(xs[half:]), ys[half:]) / 2).backward()
    torch.save([(shard_info(p), p.grad.clone()) for p in model.parameters()], os.path.join(out_dir, f"g{rank}.pt"))
    dist.destroy_process_group()


def test_gradient_accumulation_without_sync_matches_the_full_batch(tmp_path):
    mp.spawn(accumulate_worker, args=(2, str(tmp_path)), nprocs=2)
    model = make_model()
    x, y = batch(0)
    halves = [(x[i:i + 3], y[i:i + 3]) for i in range(0, 12, 3)]  # 2 ranks x 2 micro-batches of 3
    loss = sum(torch.nn.functional.mse_loss(model(a), b) for a, b in halves) / 4
    loss.backward()
    for i, p in enumerate(model.parameters()):
        rows = p.grad.reshape(p.shape[0], -1)
        for r in range(2):
            info, grad = torch.load(tmp_path / f"g{r}.pt", weights_only=False)[i]
            torch.testing.assert_close(grad.reshape(info.length, rows.shape[1]),
                                       rows[info.offset:info.offset + info.length], rtol=1e-5, atol=1e-6)


def test_an_optimizer_built_before_sharding_is_refused():
    from hyperparallel.errors import ConfigError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_model()
        early = torch.optim.AdamW(model.parameters())
        fully_shard(model)
        model(torch.randn(2, 7)).sum().backward()
        with pytest.raises(ConfigError, match="built before fully_shard"):
            early.step()
        torch.optim.AdamW(model.parameters()).step()  # built after: fine
    finally:
        dist.destroy_process_group()


def mismatch_worker(rank, world, out_dir):
    from hyperparallel.errors import ConfigError

    # a file rendezvous: no TCP port that another test could be holding
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    model = make_model()
    pair = dist.new_group([0, 1])
    try:
        fully_shard(model[0], process_group=pair)  # rank 2 is not in it
        fully_shard(model)  # the world (3 ranks) around a block sharded over 2
        message = "no error"
    except ConfigError as error:
        message = str(error)
    open(os.path.join(out_dir, f"m{rank}.txt"), "w").write(message)
    dist.destroy_process_group()


def test_a_block_sharded_over_other_ranks_than_its_root_is_refused(tmp_path):
    mp.spawn(mismatch_worker, args=(3, str(tmp_path)), nprocs=3)
    for r in range(2):
        assert "sharded over ranks [0, 1] but its parent over [0, 1, 2]" in (tmp_path / f"m{r}.txt").read_text()
    assert "rank 2 is not a member of the process_group" in (tmp_path / "m2.txt").read_text()


def mixed_precision_worker(rank, world, out_dir):
    from hyperparallel.fsdp.fully_shard import MixedPrecision

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    model = make_model()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in list(model)[:2]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x, y = batch(0)
    per_rank = 12 // world
    out = model(x[rank * per_rank:(rank + 1) * per_rank].bfloat16())
    torch.nn.functional.mse_loss(out.float(), y[rank * per_rank:(rank + 1) * per_rank]).backward()
    grads = [(shard_info(p), p.dtype, p.grad.dtype, p.grad.clone()) for p in model.parameters()]
    torch.save((out.dtype, grads), os.path.join(out_dir, f"mp{rank}.pt"))
    dist.destroy_process_group()


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards_and_grads(tmp_path):
    mp.spawn(mixed_precision_worker, args=(2, str(tmp_path)), nprocs=2)
    model = make_model().bfloat16()  # the reference: the same bf16 compute, one process, full batch
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    for r in range(2):
        out_dtype, grads = torch.load(tmp_path / f"mp{r}.pt", weights_only=False)
        assert out_dtype == torch.bfloat16
        for (info, param_dtype, grad_dtype, grad), p in zip(grads, model.parameters(), strict=True):
            assert param_dtype == grad_dtype == torch.float32
            rows = p.grad.float().reshape(p.shape[0], -1)[info.offset:info.offset + info.length]
            torch.testing.assert_close(grad.reshape(rows.shape), rows, rtol=2e-2, atol=2e-3)

"""fully_shard on 2, 3 and 4 gloo ranks against one process training the same model on the same batches.

Every multi-rank scenario runs in the session's shared spawn of its world size (tests/dist/spawn.py)."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.fsdp import (
    MixedPrecision,
    clip_grad_norm_,
    fully_shard,
    set_requires_gradient_sync,
    shard_info,
)
from hyperparallel.parallel.recompute import apply_recompute
from tests.dist.ranks import leave

STEPS = 4
MICRO = 2  # micro-batches per step: the first runs with gradient sync off
ROWS = 24  # samples per micro-batch over all ranks (divides by 2, 3 and 4)
# every run of the acceptance test: geometry, align, optimizer, reshard_after_forward (+ recompute)
RUNS = [(geometry, align, optimizer, reshard)
        for geometry in ("chunk", "balanced") for align in (1, 32)
        for optimizer in ("adamw", "muon") for reshard in (True, False)]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(7, 13), nn.Tanh()), nn.Sequential(nn.Linear(13, 5), nn.Tanh()),
                         nn.Linear(5, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Uneven(nn.Module):
    """Shapes that never split evenly: 13, 5, 37 and 3 rows; 37 rows with align 32 are one
    32-row group and a 5-row one, so most ranks hold an empty shard."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(7, 13)
        self.layers = nn.ModuleList([Block(13, 5), Block(13, 37)])
        self.head = nn.Linear(13, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_optimizer(model: nn.Module, kind: str, sharded: bool):
    """AdamW, or Muon for the blocks' matrices and AdamW for the rest (torch's own for the reference)."""
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=0.05)]
    matrices = [p for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2]
    rest = [p for name, p in model.named_parameters() if not (name.startswith("layers.") and p.ndim == 2)]
    if sharded:
        from hyperparallel.optim import Muon

        return [Muon([{"params": matrices}, {"params": rest, "use_muon": False}], lr=0.05, adamw_betas=(0.9, 0.999))]
    return [torch.optim.Muon(matrices, lr=0.05), torch.optim.AdamW(rest, lr=0.05, weight_decay=0.1)]


def micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * step + micro)
    return torch.randn(ROWS, 7, generator=g), torch.randn(ROWS, 3, generator=g)


def train(model, optimizers, rank=0, world=1, clip=clip_grad_norm_, dtype=torch.float32, whole_batch=False,
          device=None):
    """STEPS steps of MICRO micro-batches; each rank takes its slice of every micro-batch, or with
    `whole_batch` all of it (then every rank's gradient is bit-equal to one process's)."""
    for step in range(STEPS):
        for micro in range(MICRO):
            if world > 1:
                set_requires_gradient_sync(model, micro == MICRO - 1)
            x, y = (t.to(device) for t in micro_batch(step, micro))
            rows = slice(None) if whole_batch else slice(rank * ROWS // world, (rank + 1) * ROWS // world)
            (torch.nn.functional.mse_loss(model(x[rows].to(dtype)).float(), y[rows]) / MICRO).backward()
        clip(model, 0.5)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def clip_one_process(model, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule with the norm summed in float64, as the sharded clip
    does: torch's fp32 norm differs in the last bit, which Muon's bf16 Newton-Schulz would amplify."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


@contextmanager
def one_thread():
    """Compute as the ranks do: a matmul's summation order depends on the number of threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference(optimizer: str) -> list[torch.Tensor]:
    model = Uneven()
    with one_thread():
        train(model, make_optimizer(model, optimizer, sharded=False), clip=clip_one_process)
    return [p.detach() for p in model.parameters()]


def reference_bf16() -> list[torch.Tensor]:
    """fp32 master weights, forward and backward on a bf16 copy, fp32 SGD: what FSDP mixed precision does."""
    master = Uneven()
    opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        compute = copy.deepcopy(master).bfloat16()
        for micro in range(MICRO):
            x, y = micro_batch(step, micro)
            (torch.nn.functional.mse_loss(compute(x.bfloat16()).float(), y) / MICRO).backward()
        for p, c in zip(master.parameters(), compute.parameters(), strict=True):
            p.grad = c.grad.float()
        clip_one_process(master, 0.5)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in master.parameters()]


def shard_all(model: nn.Module, **options) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, **options)
    return fully_shard(model, **options)


def run_acceptance(rank: int, world: int) -> list:
    results = []
    for geometry, align, optimizer, reshard in RUNS:
        model = Uneven()
        apply_recompute(model, "full" if reshard else "off")
        # Muon's Newton-Schulz runs in bf16: a 1e-7 difference in a gradient (ranks sum in another
        # order than one process) grows to ~1e-3 in 4 steps, for torch.optim.Muon itself. So Muon
        # runs give every rank the whole batch and average in float64, where (x + ... + x) / W is
        # exactly x: their gradients are bit-equal to one process's, and so are the results.
        # AdamW runs test the data-parallel averaging of different gradients.
        muon = optimizer == "muon"
        policy = MixedPrecision(reduce_dtype=torch.float64) if muon else None
        shard_all(model, geometry=geometry, align=align, reshard_after_forward=reshard, mp_policy=policy)
        train(model, make_optimizer(model, optimizer, sharded=True), rank, world, whole_batch=muon)
        results.append([(shard_info(p), p.detach().clone()) for p in model.parameters()])
    return results


class Tied(nn.Module):
    """An output head that shares the embedding's weight, as tie_word_embeddings models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.layers = nn.ModuleList([Block(6, 9)])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        x = self.embed((x.abs() * 3).long().clamp(max=10)[:, 0])
        for layer in self.layers:
            x = layer(x)
        return self.head(x)[:, :3]


def run_tied(rank: int, world: int) -> list:
    model = shard_all(Tied())
    assert model.head.weight is model.embed.weight
    train(model, make_optimizer(model, "adamw", sharded=True), rank, world)
    return [(shard_info(p), p.detach().clone()) for p in model.parameters()]


def run_mixed_precision(rank: int, world: int) -> list:
    model = shard_all(Uneven(), geometry="balanced", mp_policy=MixedPrecision(torch.bfloat16, torch.float32))
    train(model, [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)], rank, world, dtype=torch.bfloat16)
    return [(shard_info(p), p.detach().clone()) for p in model.parameters()]


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(7, 50)
        self.layers = nn.ModuleList([Block(50, 90) for _ in range(3)])
        self.head = nn.Linear(50, 3)

    forward = Uneven.forward


def state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state a process holds (0-d step counters aside)."""
    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    return {"params": size(model.parameters()), "grads": size(p.grad for p in model.parameters()),
            "optimizer": size(states)}


def run_memory(rank: int, world: int) -> dict:
    from hyperparallel.fsdp.group import _GROUP

    model = shard_all(Wide())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = micro_batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    held = state_bytes(model, opt)
    held["full_params_alive"] = sum(m.full.untyped_storage().nbytes() for sub in model.modules()
                                    if hasattr(sub, _GROUP) for m in getattr(sub, _GROUP).params)
    return held


def run_schedule(rank: int, world: int) -> list[tuple[str, str]]:
    """What happens in which order in a second step: all-gathers launched, blocks computing, reduces."""
    from hyperparallel.fsdp.group import _GROUP, FSDPGroup

    model = shard_all(Uneven())
    names = {id(getattr(model, _GROUP)): "root"}
    names.update({id(getattr(layer, _GROUP)): f"layer{i}" for i, layer in enumerate(model.layers)})
    log: list[tuple[str, str]] = []
    launch, reduce = FSDPGroup.start_unshard, FSDPGroup._start_reduce

    def logged_launch(group, *args, **kwargs):
        if not group.is_unsharded and group._gather is None:
            log.append(("all-gather", names[id(group)]))
        launch(group, *args, **kwargs)

    def logged_reduce(group):
        log.append(("reduce-scatter", names[id(group)]))
        reduce(group)

    FSDPGroup.start_unshard, FSDPGroup._start_reduce = logged_launch, logged_reduce
    for i, layer in enumerate(model.layers):
        layer.up.register_forward_hook(lambda *args, i=i: log.append(("forward", f"layer{i}")))
        # the full weight: the Parameter that forward uses and that autograd gives a gradient
        weight = next(m.full for m in getattr(layer, _GROUP).params if (layer.up, "weight") in m.places)
        weight.register_hook(lambda grad, i=i: log.append(("backward", f"layer{i}")))
    for step in range(2):
        log.clear()
        x, y = micro_batch(step, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
    FSDPGroup.start_unshard, FSDPGroup._start_reduce = launch, reduce
    return log


def run_hsdp(rank: int, world: int) -> dict:
    """HSDP on 4 ranks: FSDP over [0, 1] and [2, 3], replicated over [0, 2] and [1, 3], trained as
    run_acceptance trains (balanced geometry; AdamW, and Muon, whose Newton-Schulz exchanges run
    within each shard group); and the order in which a second step launches its reduce-scatters
    and all-reduces."""
    from hyperparallel.fsdp.group import _GROUP, FSDPGroup

    shard_groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    replica_groups = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    groups = {"process_group": shard_groups[rank // 2], "replicate_group": replica_groups[rank % 2]}
    results = {}
    for optimizer in ("adamw", "muon"):
        model = Uneven()
        muon = optimizer == "muon"  # (the whole batch on every rank, as in run_acceptance)
        policy = MixedPrecision(reduce_dtype=torch.float64) if muon else None
        shard_all(model, geometry="balanced", mp_policy=policy, **groups)
        train(model, make_optimizer(model, optimizer, sharded=True), rank, world, whole_batch=muon)
        results[optimizer] = [(shard_info(p), p.detach().clone()) for p in model.parameters()]
    model = shard_all(Uneven(), **groups)
    names = {id(getattr(model, _GROUP)): "root"}
    names.update({id(getattr(layer, _GROUP)): f"layer{i}" for i, layer in enumerate(model.layers)})
    log: list[tuple[str, str]] = []
    reduce, all_reduce = FSDPGroup._start_reduce, FSDPGroup.settle_reduce_scatter

    def logged_reduce(group):
        log.append(("reduce-scatter", names[id(group)]))
        reduce(group)

    def logged_all_reduce(group):
        if group._reduce is not None:
            log.append(("all-reduce", names[id(group)]))
        all_reduce(group)

    FSDPGroup._start_reduce, FSDPGroup.settle_reduce_scatter = logged_reduce, logged_all_reduce
    try:
        for step in range(2):
            log.clear()
            x, y = micro_batch(step, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
    finally:
        FSDPGroup._start_reduce, FSDPGroup.settle_reduce_scatter = reduce, all_reduce
    results["schedule"] = log
    return results


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    """Every scenario of this file at one world size, on one rank of the session's shared spawn
    (tests/dist/spawn.py); the tests below check one property each."""
    results = {"acceptance": run_acceptance(rank, world), "mixed_precision": run_mixed_precision(rank, world),
               "tied": run_tied(rank, world),
               "memory": run_memory(rank, world), "schedule": run_schedule(rank, world)}
    if world == 2:
        results["accumulate"] = run_accumulate(rank, world)
        results["bf16_grads"] = run_bf16_grads(rank, world)
    if world == 3:
        results["mismatch"] = run_mismatch(rank, world)
    if world == 4:
        results["hsdp"] = run_hsdp(rank, world)
    return results


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"{w}ranks")
def sharded(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, request.getfixturevalue(f"spawn_{world}")["fsdp"]


def assert_shards_equal(per_rank: list[list], want: list[torch.Tensor], label: str, **tolerance) -> None:
    for i, full in enumerate(want):
        rows = full.reshape(full.shape[0], -1) if full.dim() else full.reshape(1, 1)
        for r, shards in enumerate(per_rank):
            info, shard = shards[i]
            assert info.global_shape == full.shape, label
            torch.testing.assert_close(shard.reshape(info.length, rows.shape[1]),
                                       rows[info.offset:info.offset + info.length],
                                       msg=lambda m, r=r, i=i: f"{label}, rank {r}, parameter {i}: {m}", **tolerance)
        assert sum(shards[i][0].length for shards in per_rank) == rows.shape[0], label


def test_sharded_training_matches_one_process(sharded):
    """Both geometries, align 1 and 32, AdamW and Muon, reshard after forward with full recompute
    and without; two micro-batches (the first without sync) and clipping in every step."""
    world, per_rank = sharded
    want = {kind: reference(kind) for kind in ("adamw", "muon")}
    for run, (geometry, align, optimizer, reshard) in enumerate(RUNS):
        label = f"{world} ranks, {geometry}, align {align}, {optimizer}, reshard/recompute {reshard}"
        # fp32: max abs diff 1e-5 (gradients are summed over ranks in another order than one process's)
        shards = [results["acceptance"][run] for results in per_rank]
        assert_shards_equal(shards, want[optimizer], label, rtol=0, atol=1e-5)


def test_bf16_compute_with_fp32_reduce_matches_one_process(sharded):
    """bf16 parameters for compute, fp32 shards, gradients reduced in fp32, 4 SGD steps with
    momentum. Tolerance 5e-4 (measured: at most 1.2e-4 on 2, 3 and 4 ranks): bf16 rounds each
    rank's activations and gradients (2^-9 relative) where one process rounds the whole batch's.
    SGD keeps weight differences proportional to gradient differences; AdamW divides tiny
    gradients by their own size, so a rounding difference there moves a weight by up to lr."""
    world, per_rank = sharded
    shards = [results["mixed_precision"] for results in per_rank]
    with one_thread():
        want = reference_bf16()
    assert_shards_equal(shards, want, f"{world} ranks, bf16/fp32", rtol=0, atol=5e-4)


def test_a_tied_weight_is_one_shard_used_by_both_modules(sharded):
    world, per_rank = sharded
    model = Tied()
    with one_thread():
        train(model, make_optimizer(model, "adamw", sharded=False), clip=clip_one_process)
    want = [p.detach() for p in model.parameters()]
    assert_shards_equal([results["tied"] for results in per_rank], want, f"{world} ranks, tied", rtol=0, atol=1e-5)


def test_per_rank_memory_shrinks_as_one_over_world_size(sharded):
    world, per_rank = sharded
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = micro_batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    one_process = state_bytes(model, opt)
    for kind, total in one_process.items():
        held = [results["memory"][kind] for results in per_rank]
        assert sum(held) == total, f"{kind}: every byte is held by exactly one rank"
        assert max(held) <= total / world * 1.1, f"{kind}: {held} on {world} ranks, {total} on one"
    assert all(results["memory"]["full_params_alive"] == 0 for results in per_rank)


def test_all_gathers_are_prefetched_and_reduces_overlap_backward(sharded):
    _, per_rank = sharded
    log = per_rank[0]["schedule"]
    split = log.index(("forward", "layer1")) + 1
    forward, backward = log[:split], log[split:]
    # forward: layer1's parameters are on their way while layer0 computes
    assert forward.index(("all-gather", "layer1")) < forward.index(("forward", "layer0"))
    # backward: layer0's parameters are on their way while layer1 computes its gradients, and
    # layer1's reduce-scatter is launched before layer0's backward runs
    assert backward.index(("all-gather", "layer0")) < backward.index(("reduce-scatter", "layer1"))
    assert backward.index(("reduce-scatter", "layer1")) < backward.index(("backward", "layer0"))


def test_hsdp_matches_one_process_and_each_replica_holds_the_same_shards(spawn_4):
    """dp_replicate=2 x dp_shard=2: gradients reduce-scattered within [0, 1] and [2, 3], summed
    across [0, 2] and [1, 3], divided by all 4; clipped with each replica's shards counted once.
    Each replica's shards are the one-process model's rows (AdamW and Muon, as the acceptance test)."""
    per_rank = [results["hsdp"] for results in spawn_4["fsdp"]]
    for optimizer in ("adamw", "muon"):
        want = reference(optimizer)
        for replica in (per_rank[:2], per_rank[2:]):
            assert_shards_equal([r[optimizer] for r in replica], want, f"HSDP 2 x 2, {optimizer}", rtol=0, atol=1e-5)


def test_hsdp_launches_each_all_reduce_when_the_next_group_reduces(spawn_4):
    """[Note: HSDP gradients]: a group's all-reduce across the replicas starts when the next group
    launches its reduce-scatter (overlapping that group's backward), the last one's at the end of
    backward; in backward's order on every rank."""
    logs = [results["hsdp"]["schedule"] for results in spawn_4["fsdp"]]
    assert logs[0] == [("reduce-scatter", "layer1"), ("reduce-scatter", "layer0"), ("all-reduce", "layer1"),
                       ("reduce-scatter", "root"), ("all-reduce", "layer0"), ("all-reduce", "root")]
    assert all(log == logs[0] for log in logs)


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
        leave()


def run_accumulate(rank: int, world: int) -> list:
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
    return [(shard_info(p), p.grad.clone()) for p in model.parameters()]


def test_gradient_accumulation_without_sync_matches_the_full_batch(spawn_2):
    per_rank = [results["accumulate"] for results in spawn_2["fsdp"]]
    model = make_model()
    x, y = batch(0)
    halves = [(x[i:i + 3], y[i:i + 3]) for i in range(0, 12, 3)]  # 2 ranks x 2 micro-batches of 3
    loss = sum(torch.nn.functional.mse_loss(model(a), b) for a, b in halves) / 4
    loss.backward()
    for i, p in enumerate(model.parameters()):
        rows = p.grad.reshape(p.shape[0], -1)
        for r in range(2):
            info, grad = per_rank[r][i]
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
        leave()


def run_mismatch(rank: int, world: int) -> str:
    from hyperparallel.errors import ConfigError

    model = make_model()
    first, second = dist.new_group([0, 1]), dist.new_group([0, 2])
    try:
        fully_shard(model[0], process_group=first)  # rank 2 is not in it
        # rank 1 is not in this one; on rank 0, a root over ranks its block's group goes beyond
        # (a block may shard over a part of its root's ranks, as expert parallelism's experts do)
        fully_shard(model, process_group=second)
        return "no error"
    except ConfigError as error:
        return str(error)


def test_a_block_sharded_over_ranks_its_root_lacks_is_refused(spawn_3):
    messages = [results["mismatch"] for results in spawn_3["fsdp"]]
    assert "sharded over ranks [0, 1] but its parent over [0, 2]" in messages[0]
    for r in (1, 2):
        assert f"rank {r} is not a member of the process_group" in messages[r]


def run_bf16_grads(rank: int, world: int) -> tuple:
    model = make_model()
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in list(model)[:2]:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    x, y = batch(0)
    per_rank = 12 // world
    out = model(x[rank * per_rank:(rank + 1) * per_rank].bfloat16())
    torch.nn.functional.mse_loss(out.float(), y[rank * per_rank:(rank + 1) * per_rank]).backward()
    return out.dtype, [(shard_info(p), p.dtype, p.grad.dtype, p.grad.clone()) for p in model.parameters()]


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards_and_grads(spawn_2):
    model = make_model().bfloat16()  # the reference: the same bf16 compute, one process, full batch
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    for out_dtype, grads in (results["bf16_grads"] for results in spawn_2["fsdp"]):
        assert out_dtype == torch.bfloat16
        for (info, param_dtype, grad_dtype, grad), p in zip(grads, model.parameters(), strict=True):
            assert param_dtype == grad_dtype == torch.float32
            rows = p.grad.float().reshape(p.shape[0], -1)[info.offset:info.offset + info.length]
            torch.testing.assert_close(grad.reshape(rows.shape), rows, rtol=2e-2, atol=2e-3)


def test_new_weights_reach_mx_modules_after_a_load_into_shards(tmp_path):
    """MXLinear caches its weight's FP8 copies by the weight's version; FSDP gathers into the same
    full Parameter every time, and must bump its version when the shards hold new values."""
    from hyperparallel import checkpoint
    from hyperparallel.lowp import LowPrecisionConfig, convert

    def mx_model(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32))
        convert(m, LowPrecisionConfig(enabled=True, exclude=[]))
        return m

    x = torch.randn(8, 64)
    checkpoint.save(tmp_path / "other", mx_model(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = fully_shard(mx_model(0))
        from hyperparallel.fsdp.group import _GROUP

        full = getattr(model, _GROUP).params[0].full
        model(x).sum().backward()  # fills the FP8 caches with seed 0's weights
        gathered = full._version
        model(x).sum().backward()  # the same values gathered again: the caches stay valid
        assert full._version == gathered
        model.zero_grad()
        checkpoint.load(tmp_path / "other", model)
        with torch.no_grad():
            got = model(x)
        assert full._version != gathered  # new values: the caches start over
    finally:
        leave()
    with torch.no_grad():
        want = mx_model(1)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

"""fully_shard and what a training loop calls around it: each rank keeps only its rows (dim 0) of a
module's parameters, gradients and optimizer state. Apply it to each block, then to the root;
build the optimizer afterwards, from `model.parameters()`, which then yields the shards."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hyperparallel.errors import ConfigError
from hyperparallel.fsdp.group import _GROUP, FSDPGroup
from hyperparallel.fsdp.param import MixedPrecision, ShardPlacement
from hyperparallel.fsdp.schedule import PrefetchSchedule, register_hooks

_optimizer_guard = None  # the step pre-hook's handle, registered by the first fully_shard


def _refuse_optimizers_built_before_sharding(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_hp_replaced_by_shard", False):
                raise ConfigError(
                    f"{type(optimizer).__name__} was built before fully_shard: it holds the unsharded parameters, "
                    f"which no longer train; build the optimizer after sharding, from model.parameters()"
                )


def _guard_optimizers() -> None:
    # On the first fully_shard, not at import: a process that never shards pays nothing per step.
    global _optimizer_guard
    if _optimizer_guard is None:
        _optimizer_guard = register_optimizer_step_pre_hook(_refuse_optimizers_built_before_sharding)


def _check_same_group(module: nn.Module, group) -> None:
    """Blocks shard over their root's ranks, or over some of them (expert parallelism shards each
    rank's experts over the ranks that hold the same experts)."""
    size, ranks = dist.get_world_size(group), dist.get_process_group_ranks(group or dist.group.WORLD)
    for name, sub in module.named_modules():
        child = getattr(sub, _GROUP, None)
        if child is not None and sub is not module:
            child_ranks = dist.get_process_group_ranks(child.group or dist.group.WORLD)
            if not set(child_ranks) <= set(ranks):
                raise ConfigError(
                    f"fully_shard: {name} is sharded over ranks {child_ranks} but its parent over {ranks} "
                    f"(world size {size}); shard a model's blocks over its process group or a part of it"
                )


def _direct_params(module: nn.Module) -> list[tuple[list[tuple[nn.Module, str]], nn.Parameter]]:
    """Parameters of `module` not inside an already sharded submodule, each object once, with every
    (module, attribute) place that holds it: a tied embedding and output head share one shard."""
    found: dict[int, tuple[list[tuple[nn.Module, str]], nn.Parameter]] = {}

    def visit(mod: nn.Module, top: bool):
        if not top and hasattr(mod, _GROUP):
            return
        for name, p in mod._parameters.items():
            if p is not None:
                found.setdefault(id(p), ([], p))[0].append((mod, name))
        for child in mod.children():
            visit(child, False)

    visit(module, True)
    return list(found.values())


def fully_shard(module: nn.Module, *, process_group=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecision | None = None, geometry: str = "chunk", align: int = 1,
                gradient_divide_factor: float | None = None, device: torch.device | str | None = None,
                replicate_group=None, replays_forward: bool = False) -> nn.Module:
    """Shard `module`'s parameters along dim 0 over `process_group` (default: the world).

    Apply to each block first, then to the root. Returns `module` (sharded in place). Gradients
    are summed over the group and divided by `gradient_divide_factor` (default: the group's size,
    a mean; expert parallelism divides by every data-parallel rank, since each rank's expert
    gradients already sum the tokens of its whole expert-parallel group).

    `replicate_group` (HSDP): the ranks holding the same shards in the other replicas of
    `process_group` (this rank one of them). Gradients are then reduce-scattered within the
    shard group and summed across the replicas by an all-reduce; the default divide factor is
    both groups' sizes multiplied ([Note: HSDP gradients], group.py).

    Parameters on the meta device (a model built without memory) get shards of uninitialized
    memory on `device` (required then), so no rank ever holds a whole parameter; fill them
    afterwards (`hyperparallel.train.weights`, or `load_state_dict` of each rank's rows).

    `replays_forward`: the module runs its forward again inside backward without its own hooks
    (activation recompute of its inner forward): the gather for backward then brings what that
    forward needs too (a codec's "forward" pieces, gather.py)."""
    if not dist.is_initialized():
        raise ConfigError("fully_shard needs torch.distributed initialized (torchrun, or init_process_group)")
    if hasattr(module, _GROUP):
        raise ConfigError(f"{type(module).__name__} is already sharded: apply fully_shard once per module")
    if dist.get_rank(process_group) < 0:
        raise ConfigError(f"fully_shard: rank {dist.get_rank()} is not a member of the process_group it was given")
    if replicate_group is not None and dist.get_rank(replicate_group) < 0:
        raise ConfigError(f"fully_shard: rank {dist.get_rank()} is not a member of the replicate_group it was given")
    _check_same_group(module, process_group)
    group = FSDPGroup(module, process_group, geometry, align, reshard_after_forward, mp_policy,
                      gradient_divide_factor, replicate_group, replays_forward)
    params = _direct_params(module)
    if not params:
        setattr(module, _GROUP, group)
        return module
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) > 1:
        raise ConfigError(f"fully_shard: one group's parameters must share a dtype, got {sorted(map(str, dtypes))}")
    if device is None and any(p.is_meta for _, p in params):
        raise ConfigError(f"fully_shard: {type(module).__name__} has parameters on the meta device; "
                          f"give device= for their shards' memory")
    _guard_optimizers()
    group.shard(params, None if device is None else torch.device(device))
    setattr(module, _GROUP, group)
    PrefetchSchedule(group, [getattr(sub, _GROUP) for sub in module.modules() if hasattr(sub, _GROUP)])
    register_hooks(module, group)
    return module


def shard_placement(param: nn.Parameter) -> ShardPlacement | None:
    """The placement of a parameter sharded by fully_shard; None for any other tensor."""
    return getattr(param, "_hp_shard_placement", None)


_COLUMN_SHARDS = "_hp_column_shards"  # on a model: its weights split along dim 1, by parameter name


def column_shards(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per parameter name, (global columns, first column) of each weight whose dim 1 is split over
    ranks (a row-parallel TP projection, set by `parallel`); empty for a model with none. Names, not
    Parameter objects: they survive fully_shard, which replaces each parameter by its shard."""
    return getattr(model, _COLUMN_SHARDS, {})


def set_column_shards(model: nn.Module, shards: dict[str, tuple[int, int]]) -> None:
    setattr(model, _COLUMN_SHARDS, shards)


def set_requires_gradient_sync(module: nn.Module, sync: bool) -> None:
    for sub in module.modules():
        group = getattr(sub, _GROUP, None)
        if group is not None:
            group.gradient_sync = sync


def run_as_pipeline_stage(module: nn.Module, stages: dict[int, list[nn.Module]] | None = None) -> None:
    """`module` runs as a pipeline stage, several forwards before their backwards: its root frees
    its full parameters after forward and gathers them again when backward reaches its outputs, as
    every other group does (each backward pass reshards what it is done with), and gradients that
    need no parameter values may arrive in a group already resharded (group.py's
    _PIPELINE_TRANSITIONS). `stages`: the modules of each pipeline stage the rank holds (its
    decoder layers) by the stage's number, which run in forwards and backwards of their own: a
    group prefetches only groups of its own stage (schedule.py)."""
    stage_of = {id(getattr(sub, _GROUP)): k for k, modules in (stages or {}).items()
                for m in modules for sub in m.modules() if getattr(sub, _GROUP, None) is not None}
    for sub in module.modules():  # (a stage without parameters of its own outside its layers has no
        # root group: each layer is then the root of its own schedule)
        group = getattr(sub, _GROUP, None)
        if group is not None and group.schedule is not None:
            group.schedule.pipelined = True
            group.schedule.stage_of = stage_of


def reduce_accumulated_gradients(module: nn.Module) -> None:
    """Reduce into the shards' gradients, now, what backward passes without gradient sync
    accumulated (set_requires_gradient_sync(False)), and turn sync back on: for a pipeline
    schedule, whose stages' last backward passes come at times of its choosing."""
    groups = [group for sub in module.modules() if (group := getattr(sub, _GROUP, None)) is not None]
    for group in groups:
        group.gradient_sync = True
    for group in groups:
        group.reduce_accumulated()


def clip_grad_norm_(module: nn.Module, max_norm: float, process_group=None,
                    replicas: dict[str, int] | None = None) -> torch.Tensor:
    """The global gradient norm over every rank's shards; scales the shards' grads to max_norm.

    `replicas`: per parameter name, how many ranks of the group hold the same gradient shard
    beside FSDP's own split (tensor parallelism's replicated weights), so each counts once. The
    replicas of HSDP are known from each shard's placement and count once as well (with
    `process_group` the world, as the trainer calls it: every replica's shards are in the sum).

    Per device, dtype and replica count, one foreach norm of the gradients, accumulated in
    float64, and one foreach multiply to scale them. float64 so that the total does not depend
    on how the rows are split over the ranks: float32's own is off by ~5e-6 for a million
    elements on the CPU, where a float64 sum of float32 squares is exact to ~1e-16 (a CUDA
    device reads the float32 gradients in one fused kernel that accumulates in float64; the
    CPU's converts one gradient at a time)."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            placement = shard_placement(p)
            count = (replicas.get(name, 1) if replicas else 1) * (placement.replicas if placement else 1)
            buckets.setdefault((p.grad.device, p.grad.dtype, count), []).append(p.grad)
    # on the parameters' device: the all-reduce then runs where the group's backend can (NCCL
    # has no CPU path), also on a rank whose shards are all empty and have no gradient
    # ([Note: device-correct collectives], train/distributed.py)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    local = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, count), grads in buckets.items():
        squares = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum().to(device)
        local += squares if count == 1 else squares / count
    dist.all_reduce(local, group=process_group)
    total = local.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for (grad_device, dtype, _), grads in buckets.items():
            torch._foreach_mul_(grads, coef.to(grad_device, dtype))
    return total.float()

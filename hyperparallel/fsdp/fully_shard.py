"""fully_shard: each rank keeps only its rows of a module's parameters; the full parameters exist
from just before the module's forward until its backward is done (or, with
reshard_after_forward, are freed after forward and gathered again for backward).

Per sharded module ("a group"), all its parameters travel together: the local shards are copied
into ONE flat buffer in which every rank has a slot of the same padded length, one all-gather
fills every rank's copy, and views strip the padding. Gradients go the other way: zero-padded
into one flat buffer, one reduce-scatter (sum, then a divide by the world size: gloo's AVG is
unreliable), and each rank keeps its valid rows.

Between steps `module.parameters()` yields the shard Parameters, so an optimizer built after
sharding updates only local rows. During forward and backward the module holds full
Parameters in their place (the same objects every step), whose gradients are reduce-scattered
into the shards' `.grad` when backward is done.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from hyperparallel import versions
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp.geometry import ShardInfo, padded_rows, shard_of, shard_ranges

_GROUP = "_hp_fsdp_group"


@dataclass(frozen=True)
class MixedPrecision:
    """Shards (and the optimizer's master weights) keep their own dtype; forward and backward run
    on full parameters in `param_dtype`, and gradients are reduced in `reduce_dtype` (default:
    param_dtype) before landing in the shards' dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ShardPlacement:
    """Where every row of a sharded parameter lives: the process group it is sharded over and
    each group rank's (offset, length) along dim 0, rank 0 first. What an optimizer that needs
    whole matrices (Muon) uses to move shards between ranks."""

    process_group: object  # a ProcessGroup, or None for the default (world) group
    ranges: tuple[tuple[int, int], ...]
    rank: int  # this process's rank in process_group


@dataclass
class _Managed:
    places: list[tuple[nn.Module, str]]  # where the module holds it (more than one when tied)
    info: ShardInfo
    shard: nn.Parameter
    full: nn.Parameter
    row_numel: int
    slot_rows: int
    placement: ShardPlacement
    accumulated: torch.Tensor | None = None  # full gradient kept locally while sync is off
    # the shard's (_version, generation) when its rows last went into an all-gather, and when the
    # full parameter was last filled: equal means the gather brings the same values again
    sent_version: tuple | None = None
    gathered_version: tuple | None = ()

    def put(self, param: nn.Parameter) -> None:
        for owner, name in self.places:
            owner._parameters[name] = param

    @property
    def slot_numel(self) -> int:
        return self.slot_rows * self.row_numel


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(out, flat, group=group, async_op=True)


class FSDPGroup:
    def __init__(self, module: nn.Module, group, geometry: str, align: int, reshard_after_forward: bool,
                 mp_policy: MixedPrecision | None = None, gradient_divide_factor: float | None = None):
        self.module, self.group = module, group
        self.mp = mp_policy or MixedPrecision()
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.gradient_divide_factor = gradient_divide_factor or self.world
        self.geometry, self.align = geometry, align
        self.reshard_after_forward = reshard_after_forward
        self.gradient_sync = True
        self.managed: list[_Managed] = []
        self._unsharded = False
        self._gather = None  # (work, gathered, local) of a launched all-gather
        self._reduce = None  # (work, out, flat, managed) of a launched reduce-scatter
        self._trainable = 0  # parameters whose gradients this group reduces
        self._grads_ready = 0
        self._backward_done = False
        self._in_backward = False  # gathered again for backward: a recompute's forward must not free it
        self._callback_queued = False
        self.schedule: _Schedule | None = None  # set by the root: forward order, for prefetching

    # ---------------------------------------------------------------------------- sharding

    def shard(self, params: list[tuple[list[tuple[nn.Module, str]], nn.Parameter]]) -> None:
        for places, param in params:
            shape = param.shape
            full_2d = param.detach().reshape(shape[0] if param.dim() else 1, -1)
            info = shard_of(shape, self.rank, self.world, self.geometry, self.align)
            rows = info.rows
            local = full_2d[info.offset: info.offset + info.length].clone()
            shard = nn.Parameter(local.view(info.length, *shape[1:]) if param.dim() else local.view(-1),
                                 requires_grad=param.requires_grad)
            # A parameter that is already a part of a larger one along dim 0 (an expert-parallel
            # rank's experts) records its shard's place in that larger one, for checkpoints.
            outer = getattr(param, "_hp_shard_info", None)
            shard._hp_shard_info = info if outer is None else ShardInfo(outer.global_shape, outer.offset + info.offset,
                                                                        info.length)
            placement = ShardPlacement(
                self.group, tuple(shard_ranges(info.rows, self.world, self.geometry, self.align)), self.rank)
            shard._hp_shard_placement = placement
            full = nn.Parameter(torch.empty_like(param, dtype=self.mp.param_dtype or param.dtype),
                                requires_grad=param.requires_grad)
            full.untyped_storage().resize_(0)
            managed = _Managed(places, info, shard, full, full_2d.shape[1],
                               padded_rows(rows, self.world, self.geometry, self.align), placement)
            self.managed.append(managed)
            managed.put(shard)
            param._hp_replaced_by_shard = True  # an optimizer still holding it was built too early
            if full.requires_grad:
                full.register_post_accumulate_grad_hook(self._on_grad)
                self._trainable += 1

    # -------------------------------------------------------------------------- all-gather

    def start_unshard(self) -> None:
        """Launch this group's all-gather without waiting for it (a prefetch); unshard() finishes it."""
        if self._unsharded or self._gather is not None:
            return
        slot = sum(m.slot_numel for m in self.managed)
        ref = self.managed[0].full  # gathered in the full parameters' (compute) dtype
        local = torch.empty(slot, dtype=ref.dtype, device=ref.device)
        start = 0
        for m in self.managed:
            n = m.info.length * m.row_numel
            local[start: start + n] = m.shard.detach().reshape(-1)
            m.sent_version = (m.shard._version, versions.generation(m.shard))
            local[start + n: start + m.slot_numel] = 0  # padding: never read, but never uninitialized bytes
            start += m.slot_numel
        gathered = torch.empty(self.world * slot, dtype=ref.dtype, device=ref.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = all_gather(gathered, local, group=self.group, async_op=True)
        self._gather = (work, gathered, local)

    def unshard(self) -> None:
        if self._unsharded:
            return
        self.start_unshard()
        work, gathered, _ = self._gather
        self._gather = None
        work.wait()
        slot = gathered.numel() // self.world
        slots = gathered.view(self.world, slot)
        start = 0
        for m in self.managed:
            full = m.full
            if full.untyped_storage().size() == 0:
                full.untyped_storage().resize_(full.numel() * full.element_size())
            flat = full.view(-1)
            # Gathering the same values again (for backward, or the next micro-batch) must not look
            # like an in-place change to autograd: saved tensors of an earlier forward refer to this
            # storage and are meant to see them. New values (after an optimizer step or a
            # checkpoint load) bump its generation, so caches of copies derived from it (MXFP8
            # weight copies) start over.
            same_values = m.sent_version == m.gathered_version
            keep_version = torch.autograd._unsafe_preserve_version_counter(full) if same_values else nullcontext()
            with torch.no_grad(), keep_version:
                for r, (offset, length) in enumerate(m.placement.ranges):
                    n = length * m.row_numel
                    flat[offset * m.row_numel: offset * m.row_numel + n].copy_(slots[r, start: start + n])
            if not same_values:
                versions.bump(full)
            m.gathered_version = m.sent_version
            m.put(full)
            start += m.slot_numel
        self._unsharded = True

    def drop_prefetch(self) -> None:
        """Forget an all-gather that was prefetched but not used: the shards may change before the next use."""
        if self._gather is not None:
            self._gather[0].wait()
            self._gather = None

    def free_full(self) -> None:
        for m in self.managed:
            m.full.untyped_storage().resize_(0)
        self._unsharded = False

    def reshard(self) -> None:
        self.free_full()
        for m in self.managed:
            m.put(m.shard)

    # ------------------------------------------------------------------------- reduce-scatter

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        self._grads_ready += 1
        if self._grads_ready == self._trainable:
            # every gradient of this group is final: reduce now, overlapping the rest of backward
            self._finish_backward()

    def _finish_backward(self) -> None:
        if self._backward_done:
            return
        self._backward_done = True
        self._in_backward = False
        if self.gradient_sync:
            self._start_reduce()
        else:
            self._keep_local_full_grads()
        self.reshard()

    def _after_backward(self) -> None:
        """End of the whole backward pass: groups with a parameter that got no gradient reduce now,
        and every launched reduce-scatter lands in the shards' grads."""
        self._callback_queued = False
        self._finish_backward()
        self._finish_reduce()
        self._grads_ready, self._backward_done = 0, False

    def _keep_local_full_grads(self) -> None:
        # no_sync: accumulate the full gradient locally; it is reduced with the next synced step
        for m in self.managed:
            if m.full.grad is not None:
                m.accumulated = m.full.grad if m.accumulated is None else m.accumulated + m.full.grad
                m.full.grad = None

    def _start_reduce(self) -> None:
        trainable = [m for m in self.managed if m.full.requires_grad]
        if not trainable:
            return
        slot = sum(m.slot_numel for m in trainable)
        ref = trainable[0].full
        reduce_dtype = self.mp.reduce_dtype or ref.dtype
        flat = torch.empty(self.world, slot, dtype=reduce_dtype, device=ref.device)
        start = 0
        for m in trainable:
            grad = m.full.grad
            if m.accumulated is not None:
                grad = m.accumulated if grad is None else grad + m.accumulated
                m.accumulated = None
            n_slot = m.slot_numel
            if grad is None:
                flat[:, start: start + n_slot] = 0
            else:
                g_flat = grad.reshape(-1)
                for r, (offset, length) in enumerate(m.placement.ranges):
                    n = length * m.row_numel
                    flat[r, start: start + n] = g_flat[offset * m.row_numel: offset * m.row_numel + n]
                    flat[r, start + n: start + n_slot] = 0
            m.full.grad = None
            start += n_slot
        out = torch.empty(slot, dtype=reduce_dtype, device=ref.device)
        work = _reduce_scatter(out, flat.view(-1), self.group)
        self._reduce = (work, out, flat, trainable)

    def _finish_reduce(self) -> None:
        if self._reduce is None:
            return
        work, out, _, trainable = self._reduce
        self._reduce = None
        work.wait()
        out.div_(self.gradient_divide_factor)
        start = 0
        for m in trainable:
            n = m.info.length * m.row_numel
            g = out[start: start + n].view_as(m.shard)  # a view: `out` is the grads plus short-shard padding only
            if m.shard.grad is None:
                m.shard.grad = g if g.dtype == m.shard.dtype else g.to(m.shard.dtype)
            else:
                m.shard.grad += g
            start += m.slot_numel


def _refuse_optimizers_built_before_sharding(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_hp_replaced_by_shard", False):
                raise ConfigError(
                    f"{type(optimizer).__name__} was built before fully_shard: it holds the unsharded parameters, "
                    f"which no longer train; build the optimizer after sharding, from model.parameters()"
                )


register_optimizer_step_pre_hook(_refuse_optimizers_built_before_sharding)


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
                gradient_divide_factor: float | None = None) -> nn.Module:
    """Shard `module`'s parameters along dim 0 over `process_group` (default: the world).

    Apply to each block first, then to the root. Returns `module` (sharded in place). Gradients
    are summed over the group and divided by `gradient_divide_factor` (default: the group's size,
    a mean; expert parallelism divides by every data-parallel rank, since each rank's expert
    gradients already sum the tokens of its whole expert-parallel group)."""
    if not dist.is_initialized():
        raise ConfigError("fully_shard needs torch.distributed initialized (torchrun, or init_process_group)")
    if hasattr(module, _GROUP):
        raise ConfigError(f"{type(module).__name__} is already sharded: apply fully_shard once per module")
    if dist.get_rank(process_group) < 0:
        raise ConfigError(f"fully_shard: rank {dist.get_rank()} is not a member of the process_group it was given")
    _check_same_group(module, process_group)
    group = FSDPGroup(module, process_group, geometry, align, reshard_after_forward, mp_policy,
                      gradient_divide_factor)
    params = _direct_params(module)
    if not params:
        setattr(module, _GROUP, group)
        return module
    dtypes = {p.dtype for _, p in params}
    if len(dtypes) > 1:
        raise ConfigError(f"fully_shard: one group's parameters must share a dtype, got {sorted(map(str, dtypes))}")
    group.shard(params)
    setattr(module, _GROUP, group)
    _Schedule(group, [getattr(sub, _GROUP) for sub in module.modules() if hasattr(sub, _GROUP)])
    module.register_forward_pre_hook(lambda mod, args: _before_forward(group))
    module.register_forward_hook(lambda mod, args, output: _after_forward(group, output))
    return module


class _Schedule:
    """The order in which a root's groups run forward, recorded on the first forward. In forward,
    a group starting launches the next group's all-gather; in backward, a group gathered again
    launches the one before it: communication runs while the current block computes."""

    def __init__(self, root: FSDPGroup, groups: list[FSDPGroup]):
        self.root, self.groups = root, groups
        self.order: list[FSDPGroup] = []
        self.position: dict[int, int] = {}
        self.recording = True
        for g in groups:  # an outer root takes over the schedule of an inner one
            g.schedule = self

    def begin_forward(self) -> None:
        for g in self.groups:  # a prefetch left over from the last pass may hold old shards
            g.drop_prefetch()

    def on_forward(self, group: FSDPGroup) -> None:
        if self.recording:
            if id(group) not in self.position:
                self.position[id(group)] = len(self.order)
                self.order.append(group)
            return
        i = self.position.get(id(group))
        if i is not None and i + 1 < len(self.order):
            self.order[i + 1].start_unshard()

    def end_forward(self) -> None:
        self.recording = False

    def on_backward(self, group: FSDPGroup) -> None:
        i = self.position.get(id(group))
        if not self.recording and i is not None and i > 0:
            before = self.order[i - 1]
            if before.reshard_after_forward and not before._backward_done:
                before.start_unshard()


def _before_forward(group: FSDPGroup) -> None:
    schedule = group.schedule
    if schedule is not None and schedule.root is group:
        schedule.begin_forward()
    group.unshard()
    if schedule is not None:
        schedule.on_forward(group)


def _after_forward(group: FSDPGroup, output):
    schedule = group.schedule
    if schedule is not None and schedule.root is group:
        schedule.end_forward()
    if not torch.is_grad_enabled():
        group.reshard()
    elif group._in_backward:
        pass  # a recompute inside backward: the parameters stay gathered until the group's gradients are done
    elif group.reshard_after_forward and not (schedule is not None and schedule.root is group):
        # (the root's parameters stay: its output head is the first thing backward needs)
        _regather_before_backward(group, output)
        group.free_full()
    return output


def _regather_before_backward(group: FSDPGroup, output) -> None:
    """Gather the freed full parameters again when backward reaches this module's outputs."""
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return
    fired = [False]

    def hook(grad):
        if not fired[0]:
            fired[0] = True
            group._in_backward = True
            group.unshard()
            if group.schedule is not None:
                group.schedule.on_backward(group)
        return grad

    for t in tensors:
        t.register_hook(hook)


def shard_info(param: nn.Parameter) -> ShardInfo:
    info = getattr(param, "_hp_shard_info", None)
    if info is None:
        return ShardInfo(param.shape, 0, param.shape[0] if param.dim() else 1)
    return info


def shard_placement(param: nn.Parameter) -> ShardPlacement | None:
    """The placement of a parameter sharded by fully_shard; None for any other tensor."""
    return getattr(param, "_hp_shard_placement", None)


def set_requires_gradient_sync(module: nn.Module, sync: bool) -> None:
    for sub in module.modules():
        group = getattr(sub, _GROUP, None)
        if group is not None:
            group.gradient_sync = sync


def clip_grad_norm_(module: nn.Module, max_norm: float, process_group=None) -> torch.Tensor:
    """The global gradient norm over every rank's shards; scales the shards' grads to max_norm."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    # on the parameters' device: the all-reduce then runs where the group's backend can (NCCL
    # has no CPU path), also on a rank whose shards are all empty and have no gradient
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local += g.detach().double().pow(2).sum()
    dist.all_reduce(local, group=process_group)
    total = local.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total.float()

"""When a group's full parameters exist: from just before its module's forward until its backward
is done, or, with reshard_after_forward, freed after forward and gathered again when backward
reaches the module's outputs. The forward hooks make those moves, and the root's prefetch
schedule launches each all-gather one block early, so communication runs while a block computes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hyperparallel.fsdp.group import FSDPGroup, GroupState


class PrefetchSchedule:
    """The order in which a root's groups run forward, recorded on the first forward. In forward,
    a group starting launches the next group's all-gather; in backward, a group gathered again
    launches the one before it."""

    def __init__(self, root: FSDPGroup, groups: list[FSDPGroup]):
        self.root, self.groups = root, groups
        self.order: list[FSDPGroup] = []
        self.position: dict[int, int] = {}
        self.recording = True
        self.reducing: FSDPGroup | None = None  # the last group whose reduce-scatter was launched
        # a pipeline stage's (fsdp.run_as_pipeline_stage): several forwards run before their
        # backwards, so the root frees its parameters after forward as any group does (else it
        # keeps them: its head is the first thing backward needs)
        self.pipelined = False
        # a pipeline rank's stages (fsdp.run_as_pipeline_stage): the pipeline stage of each of its
        # layers' groups. A forward runs one stage's layers, a backward one stage's: a group
        # prefetches only a group of its own stage; in forward the root none (its next group in
        # the recorded order may be of a stage not running now), in backward only the first
        # stage's first layer the root (the embedding's)
        self.stage_of: dict[int, int] = {}
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
            following = self.order[i + 1]
            stage = self.stage_of.get(id(group))
            if not self.stage_of or (stage is not None and stage == self.stage_of.get(id(following))):
                following.start_unshard()

    def end_forward(self) -> None:
        self.recording = False

    def chain_reduce(self, group: FSDPGroup) -> None:
        """`group` launched its reduce-scatter: the group before it, whose reduce-scatter has had
        that group's backward to finish, settles its own ([Note: settled in backward's order],
        group.py; with HSDP it launches its all-reduce across the replicas). In backward's order:
        the same on every rank."""
        before, self.reducing = self.reducing, group
        if before is not None and before is not group:
            before.settle_reduce_scatter()

    def on_backward(self, group: FSDPGroup) -> None:
        i = self.position.get(id(group))
        if not self.recording and i is not None and i > 0:
            before = self.order[i - 1]
            if self.stage_of and self.stage_of.get(id(before), 0) != self.stage_of.get(id(group)):
                return  # (another stage's layer, or the root (the embedding's) after a stage but the first)
            if before.reshard_after_forward and before.state is not GroupState.BACKWARD_DONE:
                before.start_unshard(before.backward_purposes())


def register_hooks(module: nn.Module, group: FSDPGroup) -> None:
    module.register_forward_pre_hook(lambda mod, args: _before_forward(group))
    module.register_forward_hook(lambda mod, args, output: _after_forward(group, output))


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
    elif group.state is GroupState.UNSHARDED_FOR_BACKWARD:
        pass  # a recompute inside backward: the parameters stay gathered until the group's gradients are done
    elif group.reshard_after_forward and not (schedule is not None and schedule.root is group
                                              and not schedule.pipelined):
        # (the root's parameters stay: its output head is the first thing backward needs)
        _regather_before_backward(group, output)
        group.free_after_forward()
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
            group.unshard(for_backward=True)
            if group.schedule is not None:
                group.schedule.on_backward(group)
        return grad

    for t in tensors:
        t.register_hook(hook)

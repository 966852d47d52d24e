"""The bytes a rank holds, part by part ([Note: how the plan is made], planner.py): the runtime
term (this process's resident memory after a run's imports), FSDP's groups and each rank's shards
and flat-buffer slots by fsdp's own geometry, the optimizer's state and what its step makes
(Muon's exchange and Newton-Schulz temporaries, clipping's copies), what the build holds whole,
and the largest sum over a recorded micro-batch (`timeline_peak`).
"""

from __future__ import annotations

import importlib
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.fsdp import padded_rows, shard_ranges
from hyperparallel.fsdp.gather import PURPOSES, Piece, codec_align
from hyperparallel.fsdp.param import gather_codec, keeps_dtype
from hyperparallel.models.layers import decoder_layers
from hyperparallel.optim import split_for_muon
from hyperparallel.optim.sharded_muon import DIRECTION_DTYPE, UPDATE_DTYPE, newton_schulz_cost, plan_owners
from hyperparallel.train.config import TrainConfig

if TYPE_CHECKING:  # (timeline.py imports the peak from here)
    from hyperparallel.train.planning.timeline import Timeline

# everything a run imports: the trainer's components that loop.py imports, which import the rest;
# not loop.py itself, which sits above the plan (a finished run's summary sets the plan beside its
# peak), so that the plan imports no loop (tests/train/test_plan.py checks that importing it after
# these loads nothing more)
RUN_MODULES = (
    "hyperparallel.checkpoint.model_card", "hyperparallel.train.build", "hyperparallel.train.checkpointing",
    "hyperparallel.train.config", "hyperparallel.train.console", "hyperparallel.train.distributed",
    "hyperparallel.train.elastic", "hyperparallel.train.evaluate", "hyperparallel.train.metrics",
    "hyperparallel.train.peak_flops", "hyperparallel.train.preemption", "hyperparallel.train.preflight",
    "hyperparallel.train.quiet", "hyperparallel.train.roll_call", "hyperparallel.train.run_dir", "hyperparallel.train.step",
    "hyperparallel.train.tracing",
)


def resident_bytes() -> int:
    """This process's resident memory now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (macOS): the peak so far, the closest figure there is
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def runtime_bytes(compile: str = "none") -> int:
    """The process's resident memory after importing what the trainer imports (with `compile`'s
    backend): on the CPU, the part of the trainer's peak (its peak resident set) that is not
    tensors. Right in a fresh process (the `plan` command) or at the start of a run, before any
    data or model exists; later it would count them too."""
    for module in RUN_MODULES:
        importlib.import_module(module)
    if compile == "inductor":
        import torch._inductor.compile_fx  # noqa: F401  (what the first compiled step loads)
    elif compile == "dvm":
        import hyperparallel.fusion  # noqa: F401
    return resident_bytes()


@dataclass
class Part:
    """A group's parameters sharded over one number of ranks, in the bytes of one rank's slot in
    each of its flat buffers as fsdp lays them out (fsdp/collectives.py; [Note: what a gather
    carries], fsdp/group.py): what its collectives move."""

    values: int = 0  # the parameters gathered as their values: one piece each, in its full copy's dtype
    codec: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PURPOSES, 0))  # a codec's pieces, per purpose
    reduce: int = 0  # the trainable parameters' gradients, in parallel.reduce_dtype (no padding but the rows')

    def gather(self, purposes: tuple[str, ...]) -> int:
        """One rank's slot of a gather of the values and the codecs' pieces for `purposes`."""
        return self.values + sum(self.codec[purpose] for purpose in purposes)


@dataclass
class Group:
    """One FSDP group (a decoder layer, or the root: everything else). With expert parallelism a
    layer's experts are a group of their own over fewer ranks, gathered and reduced with the
    layer's: planned as one group of two parts."""

    params: list[int]  # indices into model.parameters()
    copies: int = 0  # bytes of its whole parameters as gathered (bf16 for the products' under bf16 mixed precision)
    accumulated: int = 0  # bytes of its whole gradients as fsdp accumulates them without syncing (parallel.reduce_dtype)
    slot: int = 0  # bytes of one rank's gradient shards (its reduce-scatter slot, in the shards' dtype)
    gather_slot: int = 0  # bytes of one rank's slot in its largest all-gather (forward's or backward's)
    gathered: int = 0  # bytes of that all-gather's gathered buffers: each part's ranks x its slot
    reduce_input: int = 0  # bytes of its reduce-scatter input: each part's ranks x its slot
    parts: dict[int, Part] = field(default_factory=dict)  # the ranks a part shards over -> its slots
    trainable: bool = True


def nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _rows(p: torch.Tensor) -> int:
    return p.shape[0] if p.dim() else 1


def _codec_align(p: torch.Tensor, world: int, cfg: TrainConfig) -> int | None:
    """fsdp's own choice (ShardedParam.of): the rows `p`'s shards align to with its codec, or None
    where it is gathered as its values (model.tag_as_built tags the codecs the trainer attaches)."""
    return codec_align(gather_codec(p), p.shape, world, cfg.parallel.shard_geometry, cfg.parallel.align)


def shard_align(p: torch.Tensor, world: int, cfg: TrainConfig) -> int:
    """The rows `p`'s shards are aligned to: parallel.align, or with a codec (gathered as MX data)
    the multiple of it the codec's blocks need."""
    return _codec_align(p, world, cfg) or cfg.parallel.align


def _ranges(p: torch.Tensor, world: int, cfg: TrainConfig) -> list[tuple[int, int]]:
    return shard_ranges(_rows(p), world, cfg.parallel.shard_geometry, shard_align(p, world, cfg))


def shard_bytes(p: torch.Tensor, world: int, cfg: TrainConfig) -> list[int]:
    """Bytes of each rank's shard of `p`, by fsdp's geometry."""
    rows = _rows(p)
    row_bytes = nbytes(p) // rows if rows else 0
    return [length * row_bytes for _, length in _ranges(p, world, cfg)]


def _slot_rows(p: torch.Tensor, world: int, cfg: TrainConfig) -> int:
    return padded_rows(_rows(p), world, cfg.parallel.shard_geometry, shard_align(p, world, cfg))


def _gather_pieces(p: torch.Tensor, world: int, cfg: TrainConfig) -> dict[str | None, list[Piece]]:
    """What `p` sends in fsdp's all-gathers ([Note: what a gather carries], fsdp/group.py): its
    values (key None: one piece in its full copy's dtype, bf16 for a product's parameter under
    bf16 mixed precision) or, with a codec, the codec's pieces per purpose; every rank's element
    count from its rows, as ShardedParam.pieces makes them."""
    rows = [length for _, length in _ranges(p, world, cfg)]
    codec = gather_codec(p)
    if _codec_align(p, world, cfg) is not None:
        return {purpose: [Piece(dtype, tuple(numel_of_rows(r) for r in rows))
                          for dtype, numel_of_rows in codec.pieces(purpose, p.shape)] for purpose in PURPOSES}
    row_numel = p.numel() // _rows(p) if _rows(p) else 0
    bf16 = cfg.training.mixed_precision == "bf16" and not keeps_dtype(p)  # (fsdp's MixedPrecision param_dtype)
    return {None: [Piece(torch.bfloat16 if bf16 else p.dtype, tuple(r * row_numel for r in rows))]}


def fsdp_groups(model: nn.Module, params: list[nn.Parameter], world_of: dict[int, int],
                cfg: TrainConfig) -> list[Group]:
    """FSDP's groups; `world_of`: the ranks each parameter (by id) is sharded over. Their slots are
    fsdp's own: every piece of a gather on a 16-byte boundary (fsdp.gather.Piece), the reduce-scatter
    in parallel.reduce_dtype elements, the shards aligned as fsdp aligns them (`shard_align`)."""
    index = {id(p): j for j, p in enumerate(params)}
    groups, taken = [], set()
    for layer in decoder_layers(model):
        members = [index[id(p)] for p in layer.parameters() if id(p) not in taken]
        taken.update(id(params[j]) for j in members)
        groups.append(Group(members))
    groups.append(Group([j for j, p in enumerate(params) if id(p) not in taken]))  # the root
    reduce_size = DTYPES[cfg.parallel.reduce_dtype].itemsize
    for group in groups:
        for j in group.params:
            p, world = params[j], world_of[id(params[j])]
            part = group.parts.setdefault(world, Part())
            for purpose, pieces in _gather_pieces(p, world, cfg).items():
                sent = sum(piece.slot_nbytes for piece in pieces)
                if purpose is None:
                    part.values += sent
                    group.copies += sum(piece.numel * piece.itemsize for piece in pieces)
                else:  # (an MX weight's copies, forward's and backward's, both counted: an overestimate)
                    part.codec[purpose] += sent
                    group.copies += sum(piece.numel * piece.itemsize for piece in pieces)
            if p.requires_grad:
                group.accumulated += p.numel() * reduce_size
                slot_numel = _slot_rows(p, world, cfg) * (p.numel() // max(_rows(p), 1))
                part.reduce += slot_numel * reduce_size
                group.slot += slot_numel * p.element_size()
        # a layer gathers forward's pieces, then backward's; the root both at once (communication.py)
        root = group is groups[-1]
        largest = {world: part.gather(PURPOSES) if root else max(part.gather(("forward",)), part.gather(("backward",)))
                   for world, part in group.parts.items()}
        group.gather_slot = sum(largest.values())
        group.gathered = sum(world * slot for world, slot in largest.items())
        group.reduce_input = sum(world * part.reduce for world, part in group.parts.items())
        group.trainable = any(params[j].requires_grad for j in group.params)
    return groups


def optimizer_state(cfg: TrainConfig, model: nn.Module, shard: dict[int, int]) -> int:
    """Bytes of optimizer state for parameters of `shard[id(p)]` bytes each: AdamW exp_avg and
    exp_avg_sq (the parameter's dtype) and a 4-byte step; Muon a momentum buffer on its matrices."""
    step = 4  # a float32 scalar tensor per AdamW parameter (torch's fused AdamW and Muon's AdamW alike)
    if cfg.optimizer.name == "adamw":
        return sum(2 * shard[id(p)] + step for p in model.parameters() if p.requires_grad)
    muon, adamw = split_for_muon(model)
    return sum(shard[id(p)] for _, p in muon) + sum(2 * shard[id(p)] + step for _, p in adamw)


def muon_matrices(cfg: TrainConfig, model: nn.Module, world: int):
    """The Muon matrices fsdp splits by rows, with each rank's rows and each matrix's owner."""
    if cfg.optimizer.name != "muon" or world == 1:
        return []
    matrices = []
    for _, p in split_for_muon(model)[0]:
        if p.dim() == 2:
            matrices.append((p, [length for _, length in _ranges(p, world, cfg)]))
    owners = plan_owners([newton_schulz_cost(*p.shape) for p, _ in matrices], world)
    return [(p, lengths, owner) for (p, lengths), owner in zip(matrices, owners, strict=True)]


def muon_exchange(matrices, rank: int) -> tuple[int, int]:
    """(bytes `rank` sends, bytes of its exchange buffers) in sharded Muon's two all-to-alls."""
    direction, update = DIRECTION_DTYPE.itemsize, UPDATE_DTYPE.itemsize
    sent = buffers = 0
    for p, lengths, owner in matrices:
        cols = p.shape[1]
        mine = lengths[rank] * cols
        buffers += mine * update  # the rows of the update it receives
        if owner == rank:  # received whole, assembled, orthogonalized, and sent back out
            sent += (p.shape[0] - lengths[rank]) * cols * update
            buffers += p.numel() * 2 * (direction + update)
        else:
            sent += mine * direction
    return sent, buffers


def _orthogonalize_workspace(p: torch.Tensor) -> int:
    """Newton-Schulz's bf16 temporaries on one [m, n] matrix (or a stack): x, x / norm, the next x,
    and two [s, s] products (s = min(m, n))."""
    *batch, m, n = p.shape
    stack = int(torch.Size(batch).numel())
    s = min(m, n)
    return stack * (3 * m * n + 2 * s * s) * UPDATE_DTYPE.itemsize


def _clip_transient(model: nn.Module, shard: dict[int, int], sharded: bool, device: torch.device) -> int:
    """Bytes clipping makes on top of the gradients: fsdp's on the CPU converts one gradient shard at
    a time to float64 (fsdp.clip_grad_norm_, which a sharded step calls also without max_grad_norm,
    for the logged norm); torch's (replicated runs) and a CUDA device's foreach norms read the
    gradients in place (scalars only)."""
    if not (sharded and device.type == "cpu"):
        return 0
    return max((shard[id(p)] * 8 // p.dtype.itemsize for p in model.parameters() if p.requires_grad), default=0)


def optimizer_step_transient(cfg: TrainConfig, model: nn.Module, shard: dict[int, int], sharded: bool,
                             muon_buffers: int, device: torch.device) -> int:
    """Bytes the optimizer step (and clipping, before it) makes on top of parameters, gradients and state."""
    clip = _clip_transient(model, shard, sharded, device)
    if cfg.optimizer.name != "muon":
        return clip  # fused AdamW updates in place
    muon = [p for _, p in split_for_muon(model)[0]]
    # Nesterov's direction (a gradient-sized tensor) and Newton-Schulz on one matrix (or stack) at a
    # time; matrices fsdp splits by rows keep their directions until all are exchanged at once
    exchanged = [p for p in muon if sharded and p.dim() == 2]
    directions = sum(shard[id(p)] for p in exchanged)
    directions += max((shard[id(p)] for p in muon if not (sharded and p.dim() == 2)), default=0)

    def workspace(p: torch.Tensor) -> int:  # a matrix whole (by its owner when sharded); a stack: its shard's
        full = _orthogonalize_workspace(p)
        return full if p.dim() == 2 else full * shard[id(p)] // max(nbytes(p), 1)

    workspace = max(map(workspace, muon), default=0)
    return max(clip, directions + workspace + muon_buffers)



def build_transient(cfg: TrainConfig, model: nn.Module) -> int:
    """What the build holds whole beside this rank's shards (train/weights.py): the seeded init
    draws one module's own tensors at a time; reading model.path, counted as the largest whole
    tensor (an upper bound: a rank buffers at most its rows of one, for a TP column split or a
    dtype conversion)."""
    if cfg.model.path is not None:
        return max((nbytes(p) for p in model.parameters()), default=0)
    return max((sum(nbytes(t) for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
                for m in model.modules()), default=0)


def timeline_peak(timeline: Timeline, groups: list[Group] | None, world: int, accumulation: int, grads_whole: int,
                  reduce_copies: int = 1, sync_every: bool = False, replicated: bool = False,
                  pipelined: frozenset[int] | None = None):
    """(activations, buffers, the largest sum of activations, buffers and gradients) over the timeline.

    `groups` None: replicated, gradients as the timeline has them (all of `grads_whole` from the
    start when the step accumulates). Else FSDP over `world` ranks, as [Note: how the plan is
    made] says (planner.py), with `reduce_copies` copies of the last two finished groups'
    reduce-scatter inputs alive; with `sync_every`, every micro-batch's gradients reduced into the
    shards (none kept whole), which with HSDP (`replicated`) land when backward ends, beside the
    earlier micro-batches' shards. `pipelined`: a pipeline rank's micro-batch, whose gradients are
    reduced once after the schedule's last backward (train/step.py), the groups (indices) that
    already hold accumulated gradients from an earlier backward: a finished group's whole
    gradients fold into them (or become them, in a group's first backward), and nothing is
    reduce-scattered in backward.
    """
    events, grad_serial = timeline.events, timeline.grad_serial
    alloc_bytes: dict[int, int] = {}
    nongrad = 0  # live bytes that are not a parameter's gradient
    best_activations = best_buffers = best_sum = 0
    if groups is None:
        grads = grads_whole if accumulation > 1 else 0
        for event in events:
            if event[0] == "alloc":
                alloc_bytes[event[1]] = event[2]
                if event[1] in grad_serial:
                    grads += 0 if accumulation > 1 else event[2]
                else:
                    nongrad += event[2]
            elif event[0] == "free":
                n = alloc_bytes.pop(event[1], 0)
                if event[1] in grad_serial:
                    grads -= 0 if accumulation > 1 else n
                else:
                    nongrad -= n
            best_activations = max(best_activations, nongrad)
            best_sum = max(best_sum, nongrad + grads)
        return best_activations, 0, best_sum

    n_layers, root = timeline.n_layers, len(groups) - 1
    group_of = {j: g for g, group in enumerate(groups) for j in group.params}
    marks = [i for i, e in enumerate(events) if e[0] == "mark"]
    # where each group's last gradient lands (its reduce-scatter starts; the end, for one with none)
    done_at = {g: len(events) for g in range(len(groups))}
    done_at.update({group_of[events[i][2]]: i for i in marks if events[i][1] == "grad"})
    backward_at = next(i for i in marks if events[i][1] == "backward")
    # a layer is gathered again for backward when the layer after it is done (the last layer: at once)
    regather_at = {i: (done_at[i + 1] if i + 1 < n_layers else backward_at) for i in range(n_layers)}
    in_forward: set[int] = set()
    finished: set[int] = set()
    settling: list[int] = []  # the finished groups, in the order they finished
    new_grads = [0] * len(groups)  # unsharded gradients backward has made so far, per group
    keep_whole = accumulation > 1 and not sync_every  # no_sync: every micro-batch's whole gradients kept
    accumulated = [group.accumulated if keep_whole and (pipelined is None or g in pipelined) else 0
                   for g, group in enumerate(groups)]
    # reduced every micro-batch: the gradient shards of the micro-batches before, from the start
    carried = sum(group.slot for group in groups if group.trainable) if accumulation > 1 and sync_every else 0
    unfinished_grads = sum(accumulated)  # new and accumulated gradients of the groups still in backward

    def arrange(position: int) -> tuple[int, int]:
        gathered = [i for i in range(n_layers) if i in in_forward or (regather_at[i] <= position and i not in finished)]
        full = (groups[root].copies if root not in finished else 0) + sum(groups[i].copies for i in gathered)
        prefetch = 0
        for i in gathered:  # the next group's all-gather in flight: its local slot and the gathered [W x slot]
            following = i + 1 if i in in_forward else i - 1
            if 0 <= following < n_layers:
                prefetch = max(prefetch, groups[following].gather_slot + groups[following].gathered)
        # the reduce-scatter input of the group that finished last (fsdp settles a group's when the
        # next launches its own: [Note: settled in backward's order])
        # (the previous one's is freed only after this one's is made and launched)
        reduce_inputs = reduce_copies * sum(groups[g].reduce_input for g in settling[-2:])
        return full + prefetch + reduce_inputs, sum(groups[g].slot for g in settling)

    layout, shards = arrange(0)  # full parameters, prefetch and reduce-scatter inputs; the gradient shards so far
    for position, event in enumerate(events):
        if event[0] == "alloc":
            alloc_bytes[event[1]] = event[2]
            if event[1] in grad_serial:
                g = group_of[grad_serial[event[1]]]
                new_grads[g] += event[2]
                unfinished_grads += event[2] if g not in finished else 0
            else:
                nongrad += event[2]
        elif event[0] == "free":
            n = alloc_bytes.pop(event[1], 0)
            nongrad -= 0 if event[1] in grad_serial else n
        else:
            kind, index = event[1], event[2]
            if kind == "end":
                break
            if kind == "forward":
                in_forward.add(index)
            elif kind == "forward_done":
                in_forward.discard(index)
            for g in range(len(groups)):
                if g not in finished and position >= done_at[g]:
                    finished.add(g)
                    if pipelined is not None:  # (folded into its accumulated gradients, or become them)
                        unfinished_grads -= new_grads[g] if g in pipelined else 0
                    else:
                        settling.append(g)  # its unsharded gradients go, its reduce-scatter buffers come
                        unfinished_grads -= new_grads[g] + accumulated[g]
            layout, shards = arrange(position)
        buffers = layout + unfinished_grads
        best_activations = max(best_activations, nongrad)
        best_buffers = max(best_buffers, buffers)
        best_sum = max(best_sum, nongrad + buffers + (carried + shards if replicated else max(shards, carried)))
    return best_activations, best_buffers, best_sum


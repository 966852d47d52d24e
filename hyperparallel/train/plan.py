"""`hyperparallel plan`: what one rank of a training run holds in memory and sends per step, from
its config alone, without allocating the model.

[Note: how the plan is made]
The model is built as the trainer builds it (the family's class from its config on the meta
device, the experts swapped, the fused loss, recompute), its tensors then made fake (torch's
FakeTensorMode: a shape, a dtype, a device, meta storage, no bytes). One micro-batch's forward
and backward run on it while a dispatch mode records every tensor storage an operator makes and
when it is freed (autograd frees them as in a real eager run), with marks at each decoder
layer's forward and each parameter's gradient. Nothing is estimated per architecture: what
autograd saves, what backward works with, the fused loss's chunks, autocast's bf16 copies of
the weights and recompute's replays are whatever the code really does (on real tensors the same
recording gives the same bytes, tested). From that timeline:

- activations: the most bytes alive at once that are neither parameters nor their gradients;
- replicated: gradients whole (all alive from the first micro-batch on when the step
  accumulates; else as backward makes them), and with more than one rank DDP's buckets (a
  second copy of the gradients, gradient_as_bucket_view being off);
- sharded (`hyperparallel.fsdp`): parameter, gradient and optimizer shards from fsdp's own shard
  geometry (`shard_ranges`, `padded_rows`); during a micro-batch the root's full parameters, a
  layer's full parameters from its forward to its end and again in its backward, the next
  group's all-gather buffers (prefetched), the unsharded gradients of the groups still in
  backward (all of them, accumulated, when the step accumulates: no_sync keeps them whole), and
  for every finished group its reduce-scatter input ([ranks x slot]; fsdp waits for them all at
  the end of backward, and gloo works on a copy of it) and output (the gradient shard);
- the optimizer step: gradients and state, plus Muon's Newton-Schulz temporaries and exchange
  buffers (clipping, fsdp's or torch's, makes foreach norms only).

The total is the largest sum over that timeline and the optimizer step, not the sum of each
part's own maximum. On the CPU the trainer's peak is the process's peak resident set, so the
plan adds a `runtime` term there: this process's resident memory after importing what the
trainer imports (a measurement, not a model). Not accounted (listed in `Plan.unaccounted`): the
dataset held in memory, the allocator's own slack (glibc keeps freed blocks), Inductor's
smaller set of saved tensors (the plan is eager's), and MXFP8's quantized copies.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import padded_rows, shard_ranges
from hyperparallel.models import build_model, fused_loss, install_fused_loss
from hyperparallel.models.kernels import use_kernels
from hyperparallel.optim import split_for_muon
from hyperparallel.optim.sharded_muon import DIRECTION_DTYPE, UPDATE_DTYPE, newton_schulz_cost, plan_owners
from hyperparallel.parallel import apply_recompute
from hyperparallel.parallel.recompute import decoder_layers
from hyperparallel.train.build import build_balancer, inline_model_config
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.data import tokenizer_vocab_size
from hyperparallel.train.preflight import model_problems

GiB = 2**30
COMM_FORMULA = (
    "ring algorithms, bytes this rank sends: all-gather and reduce-scatter of a group (W-1) x slot, all-reduce "
    "2 (W-1)/W x bytes; FSDP gathers each layer twice per micro-batch (forward, backward) and the root once, and "
    "reduce-scatters every group once per step; DDP all-reduces the gradients once per step; Muon on sharded "
    "matrices sends each matrix's rows to its owner and the owner sends the update's rows back (bf16)"
)


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds (the rank holding the most) and sends per optimizer step."""

    family: str
    n_params: int
    world: int
    layout: str  # replicated (one rank) | replicated (DDP) | sharded (FSDP ...)
    rank: int  # the rank the figures are of
    device: str
    micro_batch: int
    seq_len: int
    accumulation: int
    recompute: str
    mixed_precision: str
    fused_loss: bool
    compile: str
    optimizer_name: str
    params: int  # this rank's parameters (its shards when sharded)
    grads: int  # gradients that live to the optimizer step (sharded: fsdp's padded gradient shards)
    optimizer: int  # optimizer state
    activations: int  # the most bytes alive at once in a micro-batch's forward and backward, beyond the above
    buffers: int  # FSDP's unsharded parameters and gradients and collective buffers, or DDP's buckets, at their peak
    tensors: int  # all tensors at the step's peak (the largest sum over its timeline), or the build's if larger
    runtime: int  # CPU: resident memory of the process besides tensors (measured); CUDA: 0
    comm_bytes_per_step: int
    # the model's build: this rank's parameters and the buffers, plus what filling them holds
    # whole at once (the init: the largest module's own tensors; model.path: the largest block read)
    build: int = 0
    comm: dict[str, int] = field(default_factory=dict)
    unaccounted: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.tensors + self.runtime

    def to_json(self) -> dict:
        data = asdict(self)
        parts = ("params", "grads", "optimizer", "activations", "buffers", "build", "tensors", "runtime")
        data["per_rank_bytes"] = {key: data.pop(key) for key in parts} | {"total": self.total}
        data["comm_formula"] = COMM_FORMULA
        data["unaccounted"] = list(self.unaccounted)
        return data


# ------------------------------------------------------------------------------ the runtime term


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
    import hyperparallel.train.loop  # noqa: F401  (everything a run imports)

    if compile == "inductor":
        import torch._inductor.compile_fx  # noqa: F401  (what the first compiled step loads)
    elif compile == "dvm":
        import hyperparallel.fusion  # noqa: F401
    return resident_bytes()


# ------------------------------------------------------------------------------- the fake model


def meta_model(cfg: TrainConfig) -> nn.Module:
    """The trainer's model on the meta device: shapes and dtypes, nothing allocated or initialized.
    Its config and vocabulary are checked as a run's are (`preflight.model_problems`)."""
    vocab = tokenizer_vocab_size(cfg.data, cfg.model.path)
    problems = model_problems(cfg, vocab)
    if problems:
        raise ConfigError("\n".join(problems))
    return build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, vocab),
                       dtype=DTYPES[cfg.model.dtype], attn_implementation=cfg.model.attention(),
                       materialize=False)


def fake_model(cfg: TrainConfig, mode: FakeTensorMode, device: torch.device) -> nn.Module:
    """The model the trainer trains, its tensors fake tensors of `mode` on `device` (meta storage:
    no bytes), with the fused kernels, the fused loss and recompute applied (MXFP8 and compilation
    are not)."""
    model = meta_model(cfg)
    use_kernels(model, mega_gate=cfg.kernels.mega_gate, mega_mhc=cfg.kernels.mega_mhc)
    with mode:
        model.to_empty(device=device)
    model.tie_weights()  # (to_empty made new Parameters)
    if cfg.training.fused_loss:
        install_fused_loss(model)  # (its element-wise work eager: compiled it keeps the same tensors)
    apply_recompute(model, cfg.parallel.recompute)
    return model


# ------------------------------------------------------------------------ the recorded timeline


class _Recorder(TorchDispatchMode):
    """Every storage an operator makes, in order, with when it is freed: ("alloc", serial, bytes),
    ("free", serial), and the marks put in between: ("mark", kind, index)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self.live: dict[int, int] = {}  # storage address -> serial
        self.serials = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in inputs:  # a view (of a parameter, say), or an op that returns its input
            return
        serial = self.serials
        self.serials += 1
        self.live[key] = serial
        self.events.append(("alloc", serial, storage.nbytes()))
        weakref.finalize(storage, self._freed, key, serial)

    def _freed(self, key: int, serial: int) -> None:
        if self.live.get(key) == serial:
            del self.live[key]
        self.events.append(("free", serial))

    def mark(self, kind: str, index: int | None = None) -> None:
        self.events.append(("mark", kind, index))

    def serial_of(self, t: torch.Tensor) -> int | None:
        return self.live.get(t.untyped_storage()._cdata)


@dataclass
class Timeline:
    """One micro-batch's storages and marks, in order (`_Recorder.events`)."""

    events: list[tuple]
    grad_serial: dict[int, int]  # serial of a storage that ended as a parameter's .grad -> the parameter's index
    n_layers: int

    def activations(self) -> int:
        """The most bytes alive at once that are not parameters' gradients."""
        return _peak(self, None, 1, 1, 0)[0]


@contextlib.contextmanager
def _masks_as_on_real_tensors():
    """[Note: fake tensors are no trace here]
    transformers takes a FakeTensor for a trace (torch.compile's): it then keeps the values of
    the position ids it cannot read as a packed-sequence mask and builds a whole
    [batch, 1, seq, seq] causal mask, with which SDPA also repeats the key/value heads. On the
    trainer's real tensors (position ids 0..seq-1 in every row) it finds one sequence per row and
    passes is_causal, no mask. The plan is of the real run, so while it runs transformers' mask
    code asks only whether Python is tracing, and finds no packed sequences, as it would."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    patches = {"is_tracing": lambda original: (lambda tensor=None: original(None)),
               "find_packed_sequence_indices": lambda original: (lambda position_ids: None)}
    saved = {name: getattr(masking_utils, name) for name in patches if hasattr(masking_utils, name)}
    if len(saved) < len(patches):  # another transformers: plan with its mask as it makes one (more bytes)
        yield
        return
    for name, original in saved.items():
        setattr(masking_utils, name, patches[name](original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(masking_utils, name, original)


def simulate(model: nn.Module, mode, cfg: TrainConfig, device: torch.device) -> Timeline:
    """One micro-batch's forward and backward on `mode`'s fake tensors, recorded (a real model
    with a null context for `mode` is recorded the same way, on real tensors)."""
    layers = list(decoder_layers(model))
    params = list(model.parameters())
    recorder = _Recorder()
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: recorder.mark("forward", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: recorder.mark("forward_done", i)))
    for j, p in enumerate(params):
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p, j=j: recorder.mark("grad", j)))
    bf16 = cfg.training.mixed_precision == "bf16"
    balancer = build_balancer(cfg, model)  # (what its routers keep for the MoE auxiliary loss)
    try:
        with mode, recorder, _masks_as_on_real_tensors():
            ids = torch.zeros(cfg.training.micro_batch, cfg.data.seq_len, dtype=torch.long, device=device)
            with fused_loss(model):
                with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    loss = model(input_ids=ids, labels=ids).loss
                aux = balancer.aux_loss() if balancer is not None else None
                if aux is not None:
                    loss = loss + aux
                recorder.mark("backward")
                loss.backward()
            if balancer is not None:
                balancer.after_backward()
            recorder.mark("end")
            grad_serial = {recorder.serial_of(p.grad): j for j, p in enumerate(params) if p.grad is not None}
            del loss, ids
    finally:
        for handle in handles:
            handle.remove()
        for p in params:
            p.grad = None
    grad_serial.pop(None, None)
    return Timeline(recorder.events, grad_serial, len(layers))


# ---------------------------------------------------------------------------------- the parts


@dataclass
class _Group:
    """One FSDP group (a decoder layer, or the root: everything else)."""

    params: list[int]  # indices into model.parameters()
    full: int = 0  # bytes of its whole parameters (and of their gradients)
    slot: int = 0  # bytes of one rank's slot in its flat buffers (the longest shard, padded)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _rows(p: torch.Tensor) -> int:
    return p.shape[0] if p.dim() else 1


def _shard_bytes(p: torch.Tensor, world: int, cfg: TrainConfig) -> list[int]:
    """Bytes of each rank's shard of `p`, by fsdp's geometry."""
    rows = _rows(p)
    row_bytes = _nbytes(p) // rows if rows else 0
    return [length * row_bytes for _, length in shard_ranges(rows, world, cfg.parallel.shard_geometry, cfg.parallel.align)]


def _slot_bytes(p: torch.Tensor, world: int, cfg: TrainConfig) -> int:
    rows = _rows(p)
    row_bytes = _nbytes(p) // rows if rows else 0
    return padded_rows(rows, world, cfg.parallel.shard_geometry, cfg.parallel.align) * row_bytes


def _groups(model: nn.Module, params: list[nn.Parameter], world: int, cfg: TrainConfig) -> list[_Group]:
    index = {id(p): j for j, p in enumerate(params)}
    groups, taken = [], set()
    for layer in decoder_layers(model):
        members = [index[id(p)] for p in layer.parameters() if id(p) not in taken]
        taken.update(id(params[j]) for j in members)
        groups.append(_Group(members))
    groups.append(_Group([j for j, p in enumerate(params) if id(p) not in taken]))  # the root
    for group in groups:
        group.full = sum(_nbytes(params[j]) for j in group.params)
        group.slot = sum(_slot_bytes(params[j], world, cfg) for j in group.params)
    return groups


def _optimizer_state(cfg: TrainConfig, model: nn.Module, shard: dict[int, int]) -> int:
    """Bytes of optimizer state for parameters of `shard[id(p)]` bytes each: AdamW exp_avg and
    exp_avg_sq (the parameter's dtype) and a 4-byte step; Muon a momentum buffer on its matrices."""
    step = 4  # a float32 scalar tensor per AdamW parameter (torch's fused AdamW and Muon's AdamW alike)
    if cfg.optimizer.name == "adamw":
        return sum(2 * shard[id(p)] + step for p in model.parameters() if p.requires_grad)
    muon, adamw = split_for_muon(model)
    return sum(shard[id(p)] for _, p in muon) + sum(2 * shard[id(p)] + step for _, p in adamw)


def _muon_matrices(cfg: TrainConfig, model: nn.Module, world: int):
    """The Muon matrices fsdp splits by rows, with each rank's rows and each matrix's owner."""
    if cfg.optimizer.name != "muon" or world == 1:
        return []
    matrices = []
    for _, p in split_for_muon(model)[0]:
        if p.dim() == 2:
            ranges = shard_ranges(p.shape[0], world, cfg.parallel.shard_geometry, cfg.parallel.align)
            matrices.append((p, [length for _, length in ranges]))
    owners = plan_owners([newton_schulz_cost(*p.shape) for p, _ in matrices], world)
    return [(p, lengths, owner) for (p, lengths), owner in zip(matrices, owners, strict=True)]


def _muon_exchange(matrices, rank: int) -> tuple[int, int]:
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


def _optimizer_step_transient(cfg: TrainConfig, model: nn.Module, shard: dict[int, int], sharded: bool,
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
        return full if p.dim() == 2 else full * shard[id(p)] // max(_nbytes(p), 1)

    workspace = max(map(workspace, muon), default=0)
    return max(clip, directions + workspace + muon_buffers)


# --------------------------------------------------------------------------------- the planner


def _peak(timeline: Timeline, groups: list[_Group] | None, world: int, accumulation: int, grads_whole: int,
          reduce_copies: int = 1):
    """(activations, buffers, the largest sum of activations, buffers and gradients) over the timeline.

    `groups` None: replicated, gradients as the timeline has them (all of `grads_whole` from the
    start when the step accumulates). Else FSDP over `world` ranks, as the module's note says, with
    `reduce_copies` copies of each reduce-scatter input alive until backward ends.
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
    new_grads = [0] * len(groups)  # unsharded gradients backward has made so far, per group
    accumulated = [group.full if accumulation > 1 else 0 for group in groups]  # no_sync's whole gradients
    unfinished_grads = sum(accumulated)  # new and accumulated gradients of the groups still in backward

    def arrange(position: int) -> tuple[int, int]:
        gathered = [i for i in range(n_layers) if i in in_forward or (regather_at[i] <= position and i not in finished)]
        full = (groups[root].full if root not in finished else 0) + sum(groups[i].full for i in gathered)
        prefetch = 0
        for i in gathered:  # the next group's all-gather in flight: its local slot and the gathered [W x slot]
            following = i + 1 if i in in_forward else i - 1
            if 0 <= following < n_layers:
                prefetch = max(prefetch, (world + 1) * groups[following].slot)
        reduce_inputs = sum(reduce_copies * world * groups[g].slot for g in finished)
        return full + prefetch + reduce_inputs, sum(groups[g].slot for g in finished)

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
                    finished.add(g)  # its unsharded gradients go, its reduce-scatter buffers come
                    unfinished_grads -= new_grads[g] + accumulated[g]
            layout, shards = arrange(position)
        buffers = layout + unfinished_grads
        best_activations = max(best_activations, nongrad)
        best_buffers = max(best_buffers, buffers)
        best_sum = max(best_sum, nongrad + buffers + shards)
    return best_activations, best_buffers, best_sum


def plan(cfg: TrainConfig, world: int, *, runtime: int | None = None, device: torch.device | str | None = None) -> Plan:
    """The memory and communication plan of one rank of `cfg` run over `world` ranks.

    `runtime`: on the CPU, the resident bytes besides tensors; None measures this process
    (`runtime_bytes`), right in a fresh process only. `device`: where the run trains (default:
    where the trainer would, a GPU when there is one); on CUDA the runtime term is 0, as
    max_memory_allocated counts tensors only.
    """
    from hyperparallel.train.distributed import device_for_this_rank

    if world < 1:
        raise ConfigError(f"the number of ranks must be at least 1, got {world}")
    if cfg.parallel.model_parallel() > 1:
        raise ConfigError(f"hyperparallel plan covers data-parallel, FSDP and expert-parallel layouts; parallel.tp "
                          f"({cfg.parallel.tp}) and parallel.cp ({cfg.parallel.cp}) are not planned yet (measure them: "
                          f"benchmarks/parallel.py)")
    if cfg.parallel.dp_shard > 1 and cfg.parallel.dp_shard != world:
        raise ConfigError(f"parallel.dp_shard = {cfg.parallel.dp_shard} shards the model over that many ranks, but the "
                          f"plan is for {world}; plan it with --nproc {cfg.parallel.dp_shard}")
    accumulation = cfg.grad_accumulation(world)
    device = torch.device(device) if device is not None else device_for_this_rank()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type != "cpu":  # (the trainer's peak there is the CUDA allocator's: tensors only)
        runtime = 0
    elif runtime is None:
        runtime = runtime_bytes(cfg.training.compile)
    sharded = cfg.parallel.dp_shard > 1

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the meta model's tensors become fake ones)
    model = fake_model(cfg, mode, device)
    params = list(model.parameters())
    whole = {id(p): _nbytes(p) for p in params}
    timeline = simulate(model, mode, cfg, device)
    grads_whole = sum(whole[id(p)] for p in params if p.requires_grad)

    comm: dict[str, int] = {}
    if sharded:
        groups = _groups(model, params, world, cfg)
        per_rank = {id(p): _shard_bytes(p, world, cfg) for p in params}
        matrices = _muon_matrices(cfg, model, world)
        candidates = []
        for r in range(world):
            shard = {key: sizes[r] for key, sizes in per_rank.items()}
            candidates.append((sum(shard.values()) + _optimizer_state(cfg, model, shard), r, shard))
        _, rank, shard = max(candidates, key=lambda c: (c[0], -c[1]))
        params_bytes = sum(shard.values())
        optimizer_bytes = _optimizer_state(cfg, model, shard)
        grads = sum(g.slot for g in groups if any(params[j].requires_grad for j in g.params))
        # [Note: gloo's reduce-scatter] ProcessGroupGloo reduce-scatters a clone of its input
        # (measured: an aten::clone of [ranks x slot] inside c10d::_reduce_scatter_base_), which
        # the work holds, and fsdp holds the works until backward ends: two copies on the CPU
        copies = 2 if device.type == "cpu" else 1
        activations, buffers, peak = _peak(timeline, groups, world, accumulation, grads_whole, copies)
        layer_slots = sum(g.slot for g in groups[:-1])
        comm["fsdp_all_gather"] = accumulation * (world - 1) * (2 * layer_slots + groups[-1].slot)
        comm["fsdp_reduce_scatter"] = (world - 1) * grads
        muon_sent, muon_buffers = _muon_exchange(matrices, rank)
        if matrices:
            comm["muon_all_to_all"] = muon_sent
        layout = f"sharded (FSDP {cfg.parallel.shard_geometry}, align {cfg.parallel.align})"
    else:
        rank, shard = 0, whole
        params_bytes, grads = sum(whole.values()), grads_whole
        optimizer_bytes = _optimizer_state(cfg, model, shard)
        activations, _, peak = _peak(timeline, None, world, accumulation, grads_whole)
        buffers = grads_whole if world > 1 else 0  # DDP's buckets
        muon_buffers = 0
        if world > 1:
            comm["ddp_all_reduce"] = 2 * (world - 1) * grads_whole // world
        layout = "replicated (DDP)" if world > 1 else "replicated"
    if not sharded:
        peak += buffers
    optimizer_step = grads + _optimizer_step_transient(cfg, model, shard, sharded, muon_buffers, device)
    optimizer_step += 0 if sharded else buffers
    tensors = params_bytes + optimizer_bytes + max(peak, optimizer_step)
    build = params_bytes + sum(_nbytes(b) for b in model.buffers()) + _build_transient(cfg, model)
    tensors = max(tensors, build)

    unaccounted = []
    if device.type == "cpu":
        unaccounted += ["the dataset in memory (about 8 bytes per corpus token)",
                        "the allocator's slack (glibc keeps freed blocks resident)"]
    if cfg.training.compile != "none":
        unaccounted.append(f"training.compile {cfg.training.compile}: activations are eager's "
                           f"(a compiled layer keeps fewer)")
    if cfg.checkpoint.async_ and device.type == "cpu":
        unaccounted.append("checkpoint.async: a copy of parameters and optimizer state while a save is in flight")
    if cfg.low_precision.enabled:
        unaccounted.append("low_precision (MXFP8): planned as the unconverted model; MXFP8 keeps fp8 copies of "
                           "inputs and weights instead (docs/lowp.md)")
    return Plan(
        family=cfg.model.family, n_params=sum(p.numel() for p in params), world=world, layout=layout, rank=rank,
        device=device.type, micro_batch=cfg.training.micro_batch, seq_len=cfg.data.seq_len,
        accumulation=accumulation, recompute=cfg.parallel.recompute, mixed_precision=cfg.training.mixed_precision,
        fused_loss=cfg.training.fused_loss, compile=cfg.training.compile, optimizer_name=cfg.optimizer.name,
        params=params_bytes, grads=grads, optimizer=optimizer_bytes, activations=activations, buffers=buffers,
        tensors=tensors, runtime=runtime, comm_bytes_per_step=sum(comm.values()), build=build, comm=comm,
        unaccounted=tuple(unaccounted),
    )


def _build_transient(cfg: TrainConfig, model: nn.Module) -> int:
    """What the build holds whole beside this rank's shards (train/weights.py): the seeded init
    draws one module's own tensors at a time; reading model.path, counted as the largest whole
    tensor (an upper bound: a rank buffers at most its rows of one, for a TP column split or a
    dtype conversion)."""
    if cfg.model.path is not None:
        return max((_nbytes(p) for p in model.parameters()), default=0)
    return max((sum(_nbytes(t) for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
                for m in model.modules()), default=0)


def plan_total_bytes(cfg: TrainConfig, world: int, *, runtime: int | None = None) -> int:
    """The plan's total for one rank: what the trainer's peak_mem_bytes is compared with. A
    trainer passes `runtime` measured at its start (`runtime_bytes(cfg.training.compile)`)."""
    return plan(cfg, world, runtime=runtime).total


def memory_summary(cfg: TrainConfig, world: int, runtime: int, records: list[dict]) -> str:
    """The end of a run's summary: its measured peak beside the plan's total. (A plan that cannot
    be made, for a reason of its own, is named instead: it never fails a finished run.)"""
    measured = max((r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r), default=0)
    try:
        planned = f"{plan_total_bytes(cfg, world, runtime=runtime) / 2**30:.2f} GiB"
    except Exception as error:  # noqa: BLE001  (the run is done; the plan is only a comparison)
        planned = f"unavailable ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    return f"peak memory {measured / 2**30:.2f} GiB per rank, planned {planned} (hyperparallel plan)"


def format_plan(p: Plan) -> str:
    """A small table of the plan."""
    buffers = "FSDP unsharded blocks and buffers" if p.layout.startswith("sharded") else "DDP gradient buckets"
    rows = [
        ("parameters", p.params),
        ("gradients", p.grads),
        ("optimizer state", p.optimizer),
        (f"activations (one micro-batch of {p.micro_batch} x {p.seq_len})", p.activations),
        (buffers, p.buffers),
        ("the model's build (its shards, plus one module whole)", p.build),
        ("tensors at the peak (the parts peak at different times)", p.tensors),
    ]
    if p.device == "cpu":
        rows.append(("runtime (measured: resident memory after imports)", p.runtime))
    rows.append(("total", p.total))
    width = max(len(name) for name, _ in rows)
    lines = [
        f"plan: {p.family}, {p.n_params / 1e6:.1f}M parameters, {p.world} rank(s) {p.layout}, on {p.device}; "
        f"grad accumulation {p.accumulation}, recompute {p.recompute}, mixed precision {p.mixed_precision}, fused "
        f"loss {'on' if p.fused_loss else 'off'}, compile {p.compile}, {p.optimizer_name}",
        f"{'per rank (rank ' + str(p.rank) + ')':<{width}}  {'bytes':>15}  {'GiB':>8}",
    ]
    for name, value in rows:
        lines.append(f"{name:<{width}}  {value:>15,}  {value / GiB:>8.3f}")
    if p.comm:
        parts = ", ".join(f"{key} {value / 2**20:,.1f} MiB" for key, value in p.comm.items())
        lines.append(f"sent per step by rank {p.rank}: {p.comm_bytes_per_step / 2**20:,.1f} MiB ({parts})")
        lines.append(f"  ({COMM_FORMULA})")
    else:
        lines.append("sent per step: nothing (one rank)")
    if p.unaccounted:
        lines.append("not accounted: " + "; ".join(p.unaccounted))
    return "\n".join(lines)

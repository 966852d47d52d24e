"""`hyperparallel plan`: what one rank of a training run holds in memory and sends per step, from
its config alone, without allocating the model, for any layout and number of ranks; with a
device model, its step time (plan_time.py).

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
  backward (all of them, accumulated, when the step accumulates: no_sync keeps them whole, unless
  parallel.sync_every_micro_batch), the reduce-scatter inputs of the two groups that finished
  last ([ranks x slot]; fsdp frees one when the next group has launched its own, and gloo works
  on a copy of it), and every finished group's output (the gradient shard);
- the optimizer step: gradients and state, plus Muon's Newton-Schulz temporaries and exchange
  buffers (clipping, fsdp's or torch's, makes foreach norms only).

The model run is one rank's part of the layout (`parallel.mesh.MeshShape`): with tp one TP rank's
part of it, split by the plan the trainer runs (`split_tensor_parallel`), with cp each sequence's
seq_len / cp tokens, with ep the first
expert-parallel rank's experts (`keep_local_experts`), every routed row computed as a rank
receiving its share under uniform routing does; FSDP shards over dp_shard x cp (a layer's
experts over the ranks holding the same experts), and HSDP's replicas hold the same shards.

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
from hyperparallel.models import build_model, fused_loss, get_family, install_fused_loss
from hyperparallel.models.families import tensor_parallel_plan
from hyperparallel.models.flops import top_k_of
from hyperparallel.models.kernels import use_kernels
from hyperparallel.models.layers import decoder_layers, layer_configs
from hyperparallel.optim import split_for_muon
from hyperparallel.optim.sharded_muon import DIRECTION_DTYPE, UPDATE_DTYPE, newton_schulz_cost, plan_owners
from hyperparallel.parallel import apply_recompute
from hyperparallel.parallel.expert_parallel import keep_local_experts, moe_shape, routed_experts
from hyperparallel.parallel.mesh import MeshShape
from hyperparallel.parallel.tensor_parallel import split_tensor_parallel, tensor_parallel_state
from hyperparallel.train.build import build_balancer, inline_model_config
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.data import tokenizer_vocab_size
from hyperparallel.train.device_model import DeviceModel
from hyperparallel.train.plan_time import Collective, OpCosts, StepTime, op_cost, predict, spans_nodes
from hyperparallel.train.preflight import layout_problems, model_problems

GiB = 2**30
COMM_FORMULA = (
    "ring algorithms, bytes this rank sends: all-gather and reduce-scatter of a group (W-1) x slot, all-reduce "
    "2 (W-1)/W x bytes, all-to-all (W-1)/W x bytes; FSDP gathers each layer twice per micro-batch (forward, backward) "
    "and the root once, and reduce-scatters every group once per step (HSDP then all-reduces each group's gradient "
    "shards across the replicas); DDP all-reduces the gradients once per step; TP all-reduces (SP: all-gathers and "
    "reduce-scatters) every attention and MLP block's activations forward, backward and in recompute's replay; CP "
    "passes keys and values around the ring once forward and twice backward (Ulysses: all-to-alls); EP sends every "
    "routed row out and back, forward and backward; Muon on sharded matrices sends each matrix's rows to its owner "
    "and the owner sends the update's rows back (bf16)"
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
    mesh: dict[str, int] = field(default_factory=dict)  # dp_replicate, dp_shard, cp, tp, ep
    comm_by_dimension: dict[str, int] = field(default_factory=dict)  # bytes sent per step, by mesh dimension
    time: StepTime | None = None  # the predicted step time (with a device model)

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


def meta_model(cfg: TrainConfig, tp: int = 1, layers: int | None = None) -> nn.Module:
    """The trainer's model on the meta device: shapes and dtypes, nothing allocated or initialized.
    Its config and vocabulary are checked as a run's are (`preflight.model_problems`). With `tp`
    > 1: one tensor-parallel rank's part, split by the plan the trainer runs
    (`parallel.tensor_parallel.split_tensor_parallel`); with `layers`: its first `layers` decoder
    layers only (`first_layers_config`)."""
    vocab = tokenizer_vocab_size(cfg.data, cfg.model.path)
    problems = model_problems(cfg, vocab)
    if problems:
        raise ConfigError("\n".join(problems))
    options = {"dtype": DTYPES[cfg.model.dtype], "attn_implementation": cfg.model.attention(), "materialize": False}
    if layers is None:
        model = build_model(cfg.model.family, path=cfg.model.path, config=inline_model_config(cfg, vocab), **options)
    else:
        whole = whole_model_config(cfg, vocab)
        first = first_layers_config(whole, layers, layer_count_key(cfg.model.family, whole))
        model = build_model(cfg.model.family, config=first, **options)
    if tp > 1:
        plan = tensor_parallel_plan(get_family(cfg.model.family), model)
        if isinstance(plan, str):
            raise ConfigError(f"parallel.tp: {cfg.model.family!r}: {plan}")
        split_tensor_parallel(model, plan, tp, 0, sequence_parallel=cfg.parallel.sequence_parallel)
    return model


def layer_count_key(family: str, config: dict) -> str:
    """The key of `config` (a model config's keys) that holds the decoder layer count:
    num_hidden_layers, or the config class's own name for it (GPT-2's n_layer)."""
    from hyperparallel.models import get_family

    if "num_hidden_layers" in config:
        return "num_hidden_layers"
    own = (getattr(get_family(family).config_class, "attribute_map", None) or {}).get("num_hidden_layers")
    return own if own in config else "num_hidden_layers"


def first_layers_config(config: dict, layers: int, key: str = "num_hidden_layers") -> dict:
    """The config of the model's first `layers` decoder layers (their per-layer lists cut to match;
    `key`: the layer count's, `layer_count_key`)."""
    whole = config.get(key)
    local = {**config, key: layers}
    for key, value in config.items():
        if isinstance(value, list) and len(value) == whole:  # (layer_types, mlp_layer_types, ...)
            local[key] = value[:layers]
    if isinstance(local.get("mlp_only_layers"), list):
        local["mlp_only_layers"] = [i for i in local["mlp_only_layers"] if i < layers]
    return local


def whole_model_config(cfg: TrainConfig, vocab: int) -> dict:
    """The model's config keys: the inline config, or model.path's."""
    if cfg.model.path is None:
        return inline_model_config(cfg, vocab)
    from hyperparallel.models.build import pretrained_config

    config = pretrained_config(cfg.model.family, cfg.model.path).to_dict()
    return {key: value for key, value in config.items() if key not in ("transformers_version", "architectures")}


def fake_model(cfg: TrainConfig, mode: FakeTensorMode, device: torch.device, tp: int = 1, ep: int = 1,
               layers: int | None = None) -> nn.Module:
    """The model the trainer trains, its tensors fake tensors of `mode` on `device` (meta storage:
    no bytes), with the fused kernels, the fused loss and recompute applied (MXFP8 and compilation
    are not). With `tp` and `ep`: one rank's part (the first expert-parallel rank's experts, the most
    when they do not divide), its MoE layers computing every routed row as a rank receiving its
    share under uniform routing does."""
    model = meta_model(cfg, tp, layers)
    use_kernels(model, mega_gate=cfg.kernels.mega_gate, mega_mhc=cfg.kernels.mega_mhc)
    with mode:
        model.to_empty(device=device)
    model.tie_weights()  # (to_empty made new Parameters)
    if ep > 1:
        with mode:
            for experts, _ in routed_experts(model):
                keep_local_experts(experts, ep, 0)
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
        self.costs = OpCosts()  # every operator's FLOPs and bytes, for the step-time prediction

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            self.costs.add(*cost)
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
    costs: OpCosts = field(default_factory=OpCosts)  # the micro-batch's operators (plan_time.py)

    def activations(self) -> int:
        """The most bytes alive at once that are not parameters' gradients."""
        return _peak(self, None, 1, 1, 0)[0]

    def with_gradients_of(self, params: list[torch.Tensor]) -> Timeline:
        """This timeline with each parameter's gradient the size of `params[j]` (the same model's
        parameters with fewer experts: `plan_search` screens expert-parallel layouts on the
        timeline of one simulation with every expert, its expert gradients cut to a rank's)."""
        size = {serial: _nbytes(params[j]) for serial, j in self.grad_serial.items()}
        events = [("alloc", e[1], size[e[1]]) if e[0] == "alloc" and e[1] in size else e for e in self.events]
        return Timeline(events, self.grad_serial, self.n_layers, self.costs)


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


def simulate(model: nn.Module, mode, cfg: TrainConfig, device: torch.device, seq_len: int | None = None) -> Timeline:
    """One micro-batch's forward and backward on `mode`'s fake tensors, recorded (a real model
    with a null context for `mode` is recorded the same way, on real tensors). `seq_len`: the
    tokens of each sequence this rank holds (context parallelism's part; default the whole)."""
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
            ids = torch.zeros(cfg.training.micro_batch, seq_len or cfg.data.seq_len, dtype=torch.long, device=device)
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
    return Timeline(recorder.events, grad_serial, len(layers), recorder.costs)


# ---------------------------------------------------------------------------------- the parts


@dataclass
class _Group:
    """One FSDP group (a decoder layer, or the root: everything else). With expert parallelism a
    layer's experts are a group of their own over fewer ranks, gathered and reduced with the
    layer's: planned as one group of two parts."""

    params: list[int]  # indices into model.parameters()
    full: int = 0  # bytes of its whole parameters (and of their gradients)
    slot: int = 0  # bytes of one rank's slots in its flat buffers (the longest shard, padded)
    gathered: int = 0  # bytes of the gathered buffers: each part's ranks x its slot
    parts: dict[int, int] = field(default_factory=dict)  # the ranks a part shards over -> its slot bytes
    trainable: bool = True


def describe_shape(shape: MeshShape) -> str:
    """The plan's name for a layout: `replicated`, `replicated (DDP)`, or its dimensions above 1."""
    if not shape.fsdp_enabled:
        return "replicated (DDP)" if shape.ddp else "replicated"
    return " x ".join(f"{name} {size}" for name, size in shape.dims().items() if size > 1)


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


def _groups(model: nn.Module, params: list[nn.Parameter], world_of: dict[int, int], cfg: TrainConfig) -> list[_Group]:
    """FSDP's groups; `world_of`: the ranks each parameter (by id) is sharded over."""
    index = {id(p): j for j, p in enumerate(params)}
    groups, taken = [], set()
    for layer in decoder_layers(model):
        members = [index[id(p)] for p in layer.parameters() if id(p) not in taken]
        taken.update(id(params[j]) for j in members)
        groups.append(_Group(members))
    groups.append(_Group([j for j, p in enumerate(params) if id(p) not in taken]))  # the root
    for group in groups:
        group.full = sum(_nbytes(params[j]) for j in group.params)
        for j in group.params:
            world = world_of[id(params[j])]
            group.parts[world] = group.parts.get(world, 0) + _slot_bytes(params[j], world, cfg)
        group.slot = sum(group.parts.values())
        group.gathered = sum(world * slot for world, slot in group.parts.items())
        group.trainable = any(params[j].requires_grad for j in group.params)
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
          reduce_copies: int = 1, sync_every: bool = False, replicated: bool = False):
    """(activations, buffers, the largest sum of activations, buffers and gradients) over the timeline.

    `groups` None: replicated, gradients as the timeline has them (all of `grads_whole` from the
    start when the step accumulates). Else FSDP over `world` ranks, as the module's note says, with
    `reduce_copies` copies of the last two finished groups' reduce-scatter inputs alive; with
    `sync_every`, every micro-batch's gradients reduced into the shards (none kept whole), which
    with HSDP (`replicated`) land when backward ends, beside the earlier micro-batches' shards.
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
    accumulated = [group.full if keep_whole else 0 for group in groups]
    # reduced every micro-batch: the gradient shards of the micro-batches before, from the start
    carried = sum(group.slot for group in groups if group.trainable) if accumulation > 1 and sync_every else 0
    unfinished_grads = sum(accumulated)  # new and accumulated gradients of the groups still in backward

    def arrange(position: int) -> tuple[int, int]:
        gathered = [i for i in range(n_layers) if i in in_forward or (regather_at[i] <= position and i not in finished)]
        full = (groups[root].full if root not in finished else 0) + sum(groups[i].full for i in gathered)
        prefetch = 0
        for i in gathered:  # the next group's all-gather in flight: its local slot and the gathered [W x slot]
            following = i + 1 if i in in_forward else i - 1
            if 0 <= following < n_layers:
                prefetch = max(prefetch, groups[following].slot + groups[following].gathered)
        # the reduce-scatter input of the group that finished last (fsdp settles a group's when the
        # next launches its own: [Note: settled in backward's order])
        # (the previous one's is freed only after this one's is made and launched)
        reduce_inputs = reduce_copies * sum(groups[g].gathered for g in settling[-2:])
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
                    finished.add(g)
                    settling.append(g)  # its unsharded gradients go, its reduce-scatter buffers come
                    unfinished_grads -= new_grads[g] + accumulated[g]
            layout, shards = arrange(position)
        buffers = layout + unfinished_grads
        best_activations = max(best_activations, nongrad)
        best_buffers = max(best_buffers, buffers)
        best_sum = max(best_sum, nongrad + buffers + (carried + shards if replicated else max(shards, carried)))
    return best_activations, best_buffers, best_sum


def plan(cfg: TrainConfig, world: int, *, runtime: int | None = None, device: torch.device | str | None = None,
         device_model: DeviceModel | None = None, layers: int | None = None, simulations: dict | None = None) -> Plan:
    """The memory and communication plan of one rank of `cfg` run over `world` ranks, and with
    `device_model` its predicted step time (plan_time.py).

    `runtime`: on the CPU, the resident bytes besides tensors; None measures this process
    (`runtime_bytes`), right in a fresh process only. `device`: where the model is simulated
    (default: where the trainer would, a GPU when there is one). The plan is of a GPU run when
    `device` is CUDA or `device_model` is a GPU's: its runtime term is then 0, as
    max_memory_allocated counts tensors only. `layers`: plan the model's first layers only (what
    `plan_search` extrapolates from); `simulations`: a cache of simulated micro-batches, shared by
    plans of one config that differ in their layout only (their expert-parallel timelines are one
    simulation's with every expert, its expert gradients cut to a rank's).
    """
    from hyperparallel.train.distributed import device_for_this_rank

    if world < 1:
        raise ConfigError(f"the number of ranks must be at least 1, got {world}")
    problems = layout_problems(cfg, world)
    if problems:
        raise ConfigError("\n".join(problems))
    layout = MeshShape.of(cfg.parallel, world)
    accumulation = cfg.grad_accumulation(world)
    device = torch.device(device) if device is not None else device_for_this_rank()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    on_gpu = device.type == "cuda" or (device_model is not None and device_model.name != "cpu")
    if on_gpu:  # (the trainer's peak there is the CUDA allocator's: tensors only)
        runtime = 0
    elif runtime is None:
        runtime = runtime_bytes(cfg.training.compile)
    sharded = layout.fsdp_enabled
    seq_len = cfg.data.seq_len // layout.cp

    if simulations is None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the meta model's tensors become fake ones)
        model = fake_model(cfg, mode, device, tp=layout.tp, ep=layout.ep, layers=layers)
        timeline = simulate(model, mode, cfg, device, seq_len)
        whole_config = _whole_config(cfg, model, layout, layers)
    else:  # (screening: one simulation with every expert per micro-batch shape, shared by every ep)
        key = (layout.tp, layers, seq_len, cfg.training.micro_batch, cfg.parallel.recompute)
        if key not in simulations:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            model = fake_model(cfg, mode, device, tp=layout.tp, layers=layers)
            simulations[key] = (simulate(model, mode, cfg, device, seq_len),
                                _whole_config(cfg, model, MeshShape(tp=layout.tp), layers))
        timeline, whole_config = simulations[key]
        shapes = ("model", layout.tp, layout.ep, layers)  # (only its parameters' shapes are read)
        if shapes not in simulations:
            simulations[shapes] = fake_model(cfg, FakeTensorMode(allow_non_fake_inputs=True), device, tp=layout.tp,
                                             ep=layout.ep, layers=layers)
        model = simulations[shapes]
        if layout.ep_enabled:
            timeline = timeline.with_gradients_of(list(model.parameters()))
    params = list(model.parameters())
    whole = {id(p): _nbytes(p) for p in params}
    grads_whole = sum(whole[id(p)] for p in params if p.requires_grad)
    experts = ({id(p) for module, _ in routed_experts(model) for p in module.parameters()} if layout.ep_enabled
               else set())

    if sharded:
        world_of = {id(p): layout.expert_shard if id(p) in experts else layout.shard_size for p in params}
        groups = _groups(model, params, world_of, cfg)
        per_rank = {id(p): _shard_bytes(p, world_of[id(p)], cfg) for p in params}
        matrices = _muon_matrices(cfg, model, layout.shard_size)
        candidates = []
        for r in range(layout.shard_size):  # (an expert's shards: rank r is expert-shard rank r // ep)
            shard = {key: sizes[r // layout.ep if key in experts else r] for key, sizes in per_rank.items()}
            candidates.append((sum(shard.values()) + _optimizer_state(cfg, model, shard), r, shard))
        _, rank, shard = max(candidates, key=lambda c: (c[0], -c[1]))
        params_bytes = sum(shard.values())
        optimizer_bytes = _optimizer_state(cfg, model, shard)
        grads = sum(g.slot for g in groups if g.trainable)
        # [Note: gloo's reduce-scatter] ProcessGroupGloo reduce-scatters a clone of its input
        # (measured: an aten::clone of [ranks x slot] inside c10d::_reduce_scatter_base_), which
        # the work holds until fsdp settles it (the next group's reduce-scatter): two copies on the CPU
        copies = 1 if on_gpu else 2
        activations, buffers, peak = _peak(timeline, groups, layout.shard_size, accumulation, grads_whole, copies,
                                           cfg.parallel.sync_every_micro_batch, layout.hsdp_enabled)
        muon_sent, muon_buffers = _muon_exchange(matrices, rank)
        geometry = f"FSDP {cfg.parallel.shard_geometry}, align {cfg.parallel.align}"
        description = f"sharded ({describe_shape(layout)}; {geometry})"
    else:
        rank, shard, groups, matrices, muon_sent = 0, whole, [], [], 0
        params_bytes, grads = sum(whole.values()), grads_whole
        optimizer_bytes = _optimizer_state(cfg, model, shard)
        activations, _, peak = _peak(timeline, None, world, accumulation, grads_whole)
        buffers = grads_whole if layout.ddp else 0  # DDP's buckets
        muon_buffers = 0
        description = describe_shape(layout)
    if not sharded:
        peak += buffers
    target = torch.device("cuda") if on_gpu else device  # (where the run trains: clipping's transient)
    optimizer_step = grads + _optimizer_step_transient(cfg, model, shard, sharded, muon_buffers, target)
    optimizer_step += 0 if sharded else buffers
    tensors = params_bytes + optimizer_bytes + max(peak, optimizer_step)
    build = params_bytes + sum(_nbytes(b) for b in model.buffers()) + _build_transient(cfg, model)
    tensors = max(tensors, build)

    ranks_per_node = device_model.ranks_per_node if device_model is not None else world
    collectives = _collectives(cfg, layout, model, whole_config["config"], groups, grads_whole, accumulation,
                               muon_sent, experts, ranks_per_node)
    comm: dict[str, int] = {}
    by_dimension: dict[str, int] = {}
    for c in collectives:
        comm[c.name] = comm.get(c.name, 0) + c.sent()
        by_dimension[c.dimension] = by_dimension.get(c.dimension, 0) + c.sent()
    comm = {name: sent for name, sent in comm.items() if sent}
    by_dimension = {name: sent for name, sent in by_dimension.items() if sent}

    step_time = None
    if device_model is not None:
        step_time = _step_time(cfg, layout, model, whole_config, timeline.costs, accumulation, collectives, shard,
                               matrices, rank, sharded, device_model)

    unaccounted = []
    if not on_gpu:
        unaccounted += ["the dataset in memory (about 8 bytes per corpus token)",
                        "the allocator's slack (glibc keeps freed blocks resident)"]
    if cfg.training.compile != "none":
        unaccounted.append(f"training.compile {cfg.training.compile}: activations are eager's "
                           f"(a compiled layer keeps fewer)")
    if cfg.checkpoint.async_ and not on_gpu:
        unaccounted.append("checkpoint.async: a copy of parameters and optimizer state while a save is in flight")
    if cfg.low_precision.enabled:
        unaccounted.append("low_precision (MXFP8): planned as the unconverted model; MXFP8 keeps fp8 copies of "
                           "inputs and weights instead (docs/lowp.md); its products timed at the device's MX rate")
    if layout.tp_enabled and cfg.parallel.sequence_parallel:
        unaccounted.append("sequence_parallel: activations planned as without it (the residual stream whole on "
                           "every tp rank: an overestimate)")
    if on_gpu and device.type == "cpu":
        unaccounted.append("attention as the CPU runs it (simulated here): where SDPA has no fused CPU kernel "
                           "(unequal query and value head dims: DeepSeek's MLA) its math path keeps the score "
                           "matrices a GPU's memory-efficient kernel does not (an overestimate)")
    if layout.ep_enabled:
        unaccounted.append("expert parallelism: routing planned uniform (each rank receives its own tokens' share); "
                           "an imbalanced layer receives more")
    if layout.cp_enabled:
        unaccounted.append(f"context parallelism ({cfg.parallel.cp_mode}): the attention's exchange buffers")
    return Plan(
        family=cfg.model.family, n_params=whole_config["n_params"], world=world, layout=description, rank=rank,
        device=device_model.name if device_model is not None else device.type, micro_batch=cfg.training.micro_batch,
        seq_len=cfg.data.seq_len, accumulation=accumulation, recompute=cfg.parallel.recompute,
        mixed_precision=cfg.training.mixed_precision, fused_loss=cfg.training.fused_loss, compile=cfg.training.compile,
        optimizer_name=cfg.optimizer.name, params=params_bytes, grads=grads, optimizer=optimizer_bytes,
        activations=activations, buffers=buffers, tensors=tensors, runtime=runtime,
        comm_bytes_per_step=sum(comm.values()), build=build, comm=comm, unaccounted=tuple(unaccounted),
        mesh=layout.dims(), comm_by_dimension=by_dimension, time=step_time,
    )


def _whole_config(cfg: TrainConfig, model: nn.Module, layout: MeshShape, layers: int | None) -> dict:
    """The whole model's parameter count, HF config and training FLOPs per token (the fake model is
    one rank's part)."""
    from hyperparallel.models.flops import training_flops_per_token

    whole = model if not layout.tp_enabled and not layout.ep_enabled and layers is None else meta_model(cfg)
    return {"n_params": sum(p.numel() for p in whole.parameters()), "config": whole.config,
            "flops_per_token": training_flops_per_token(whole, cfg.data.seq_len)}


def _activation_bytes(cfg: TrainConfig) -> int:
    """Bytes of one activation element: bf16 under mixed precision, else the model's dtype."""
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]
    return dtype.itemsize


def _tp_partial_bytes(model: nn.Module) -> int:
    """Bytes of the gradients TP sums over its group after backward (`sync_partial_grads`): the
    ones the split of the model's plan marked partial (`split_tensor_parallel`)."""
    state = tensor_parallel_state(model)
    if state is None:
        return 0
    return sum(_nbytes(q) for name, q in model.named_parameters() if name in state.partial)


def _attention_widths(config) -> tuple[int, int]:
    """(query width, key + value width) per token of one attention layer, whole (all heads): the
    widest layer's where the config lets them vary by layer."""
    widths = [_layer_attention_widths(layer) for layer in layer_configs(config)]
    return max(q for q, _ in widths), max(kv for _, kv in widths)


def _layer_attention_widths(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    if hasattr(config, "qk_nope_head_dim"):  # multi-head latent attention: keys and values per head
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        return heads * qk, heads * (qk + config.v_head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads * head_dim, 2 * kv_heads * head_dim


def _collectives(cfg: TrainConfig, layout: MeshShape, model: nn.Module, whole_config, groups: list[_Group],
                 grads_whole: int, accumulation: int, muon_sent: int, experts: set[int],
                 ranks_per_node: int) -> list[Collective]:
    """Every collective of one optimizer step of this rank (plan_time.Collective: group, bytes, calls)."""
    out: list[Collective] = []
    p = cfg.parallel
    R, S, C, T, E = layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep
    # the mesh's strides (dp_replicate, dp_shard, cp, tp; tp innermost), for which groups leave a machine
    fsdp_spans = spans_nodes(T, S * C, ranks_per_node)
    expert_shard_spans = spans_nodes(E * T, S * C // max(E, 1), ranks_per_node)
    if layout.fsdp_enabled:
        n_layers = len(groups) - 1
        for g, group in enumerate(groups):
            gathers = accumulation * (2 if g < n_layers else 1)  # a layer again in backward; the root once
            reduces = accumulation if p.sync_every_micro_batch else 1
            for world, slot in group.parts.items():
                spans = fsdp_spans if world == layout.shard_size else expert_shard_spans
                out.append(Collective("fsdp_all_gather", "dp_shard", "all_gather", world, slot, gathers, spans, "beside"))
                if group.trainable:
                    out.append(Collective("fsdp_reduce_scatter", "dp_shard", "reduce_scatter", world, slot, reduces,
                                          spans, "beside"))
                    out.append(Collective("hsdp_all_reduce", "dp_replicate", "all_reduce", R, slot, reduces,
                                          spans_nodes(S * C * T, R, ranks_per_node), "beside"))
        if muon_sent:
            out.append(Collective("muon_all_to_all", "dp_shard", "all_to_all", layout.shard_size,
                                  muon_sent * layout.shard_size // max(layout.shard_size - 1, 1), 1, fsdp_spans))
    elif layout.ddp:
        out.append(Collective("ddp_all_reduce", "dp_replicate", "all_reduce", layout.world, grads_whole, 1,
                              spans_nodes(1, layout.world, ranks_per_node), "beside"))
    config = model.config
    element = _activation_bytes(cfg)
    tokens = cfg.training.micro_batch * cfg.data.seq_len // C  # one micro-batch's tokens on this rank
    layers = list(decoder_layers(model))
    n_layers = len(layers)
    # a recomputed layer's forward collectives run again (selective recompute keeps only products'
    # and attention's outputs: the collectives, ring attention and the dispatch are replayed)
    replays = 1 if p.recompute != "off" else 0
    if T > 1:
        act = tokens * config.hidden_size * element
        tp_spans = spans_nodes(1, T, ranks_per_node)
        # TP's blocks, as the model's split placed them: each enters and leaves the TP region
        # (its routed experts are not split by TP: tensor_parallel.py)
        state = tensor_parallel_state(model)
        per_pass = len(state.blocks) if state is not None else 0
        blocks = accumulation * per_pass * (2 + replays)  # forward, backward, replay
        if p.sequence_parallel:
            out.append(Collective("tp_all_gather", "tp", "all_gather", T, act // T, blocks, tp_spans))
            out.append(Collective("tp_reduce_scatter", "tp", "reduce_scatter", T, act // T, blocks, tp_spans))
        else:
            out.append(Collective("tp_all_reduce", "tp", "all_reduce", T, act, blocks, tp_spans))
        out.append(Collective("tp_embedding_all_reduce", "tp", "all_reduce", T, act, accumulation, tp_spans))
        out.append(Collective("tp_loss_all_reduce", "tp", "all_reduce", T, tokens * 4, 3 * accumulation, tp_spans))
        out.append(Collective("tp_partial_grads", "tp", "all_reduce", T, _tp_partial_bytes(model), 1, tp_spans))
    if C > 1:
        q_width, kv_width = _attention_widths(whole_config)
        cp_spans = spans_nodes(T, C, ranks_per_node)
        if p.cp_mode == "ring":  # keys and values around the ring: once forward, twice backward (with their grads)
            passes = accumulation * n_layers * (3 + replays)
            out.append(Collective("cp_ring", "cp", "all_gather", C, tokens * kv_width * element, passes, cp_spans))
        else:  # Ulysses: queries, keys, values and the output, all-to-all forward and backward
            calls = accumulation * n_layers * (2 + replays)
            out.append(Collective("cp_all_to_all", "cp", "all_to_all", C, tokens * (2 * q_width + kv_width) * element,
                                  calls, cp_spans))
    if E > 1:
        layers_ = routed_experts(model)
        top_k = top_k_of(model, layers_[0][0]) if layers_ else 1
        rows = tokens * top_k * config.hidden_size * element
        exposure = "simulated" if cfg.moe.implementation == "megamoe" else "critical"
        calls = accumulation * len(layers_) * 2 * (2 + replays)  # dispatch and combine: forward, backward, replay
        out.append(Collective("ep_all_to_all", "ep", "all_to_all", E, rows, calls, spans_nodes(T, E, ranks_per_node),
                              exposure))
    return [c for c in out if c.ranks > 1 and c.calls]


def _step_time(cfg: TrainConfig, layout: MeshShape, model: nn.Module, whole: dict, costs: OpCosts, accumulation: int,
               collectives: list[Collective], shard: dict[int, int], matrices, rank: int, sharded: bool,
               device: DeviceModel) -> StepTime:
    trainable = [q for q in model.parameters() if q.requires_grad]
    shard_bytes = sum(shard[id(q)] for q in trainable)
    state = _optimizer_state(cfg, model, shard)
    moved = 2 * shard_bytes + 3 * shard_bytes + 2 * state  # parameters r/w; gradients read, clipped (r/w); state r/w
    ns_flops = 0.0
    if cfg.optimizer.name == "muon":  # Newton-Schulz on the matrices this rank orthogonalizes
        owners = {id(q): owner for q, _, owner in matrices}  # (fsdp's row-split 2-D matrices: one owner each)
        for _, q in split_for_muon(model)[0]:
            small, large = sorted(q.shape[-2:])
            per_matrix = cfg.optimizer.ns_steps * (4 * small * small * large + 2 * small**3)
            if q.dim() == 2:
                ns_flops += per_matrix if owners.get(id(q), rank) == rank else 0
            else:  # a stack (the experts): each rank its shard's matrices
                ns_flops += per_matrix * (q.numel() // (small * large)) * shard[id(q)] / max(_nbytes(q), 1)
    flops_per_token = whole["flops_per_token"]
    # (on the CPU nothing overlaps in the model: MegaMoE's all-to-alls count whole, as critical)
    megamoe = cfg.moe.implementation == "megamoe" and device.overlap
    moe_exposed = _megamoe_exposed_s(cfg, layout, model, device) if megamoe else 0.0
    return predict(device=device, ops=costs, accumulation=accumulation, collectives=collectives,
                   optimizer_bytes_moved=moved, optimizer_flops=ns_flops, optimizer_ops=2 * len(trainable),
                   attention_factor=float(layout.cp), mx=cfg.low_precision.enabled, moe_exposed_s=moe_exposed,
                   tokens_per_step=cfg.training.global_batch * cfg.data.seq_len, model_flops_per_token=flops_per_token,
                   world=layout.world)


def _megamoe_exposed_s(cfg: TrainConfig, layout: MeshShape, model: nn.Module, device: DeviceModel) -> float:
    """MegaMoE's exposed communication per micro-batch: every MoE layer's wave graphs (forward and
    backward) simulated with this device's costs (multicore.simulate)."""
    from hyperparallel.moe import default_waves
    from hyperparallel.moe.megamoe_graphs import plan_graphs
    from hyperparallel.multicore import EXECUTORS, CostModel
    from hyperparallel.multicore import simulate as simulate_graph

    layers = routed_experts(model)
    if not layers or not layout.ep_enabled:
        return 0.0
    shape = moe_shape(model, cfg.training.micro_batch * cfg.data.seq_len // layout.cp, _activation_bytes(cfg))
    element = shape.element_bytes
    bandwidth, latency = device.link(spans_nodes(layout.tp, layout.ep, device.ranks_per_node))
    cost = CostModel(matmul_flops=device.flops_for("bfloat16" if element == 2 else "float32"),
                     memory_bytes_per_s=device.memory_bytes_per_s, link_bytes_per_s=bandwidth,
                     link_latency_s=latency, task_overhead_s=device.op_floor_s)
    executor = EXECUTORS["cuda"]  # (called for devices that overlap: GPUs' streams)
    waves = cfg.moe.waves or default_waves(shape, layout.ep, cost, **executor)
    forward, backward = plan_graphs(shape, layout.ep, waves)
    exposed = sum(simulate_graph(graph, cost, **executor).exposed_comm_s for graph in (forward, backward))
    return exposed * len(layers)


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


def format_time(t: StepTime) -> list[str]:
    """The predicted step time's lines."""
    exposed = ", ".join(f"{dim} {seconds * 1e3:,.1f} ms" for dim, seconds in t.exposed_comm_s.items() if seconds)
    own = ", ".join(f"{dim} {seconds * 1e3:,.1f} ms" for dim, seconds in t.comm_s.items() if seconds)
    return [
        f"predicted step on {t.device}: {t.predicted_step_s:,.3f} s = compute {t.compute_s:,.3f} s + exposed "
        f"communication {sum(t.exposed_comm_s.values()):,.3f} s ({exposed or 'none'}) + optimizer "
        f"{t.optimizer_s:,.3f} s; {t.tokens_per_s:,.0f} tokens/s, MFU {100 * t.mfu:.1f}%",
        f"  communication's own time: {own or 'none'}; a prediction from the device model "
        f"({t.device_source}), not a measurement: docs/train.md, \"Planning\"",
    ]


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
        dims = ", ".join(f"{key} {value / 2**20:,.1f} MiB" for key, value in p.comm_by_dimension.items())
        lines.append(f"  by mesh dimension: {dims}")
        lines.append(f"  ({COMM_FORMULA})")
    else:
        lines.append("sent per step: nothing (one rank)")
    if p.time is not None:
        lines.extend(format_time(p.time))
    if p.unaccounted:
        lines.append("not accounted: " + "; ".join(p.unaccounted))
    return "\n".join(lines)

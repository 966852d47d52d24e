"""One micro-batch's forward and backward, recorded: every tensor storage an operator makes and
when it is freed, with marks at each decoder layer's forward and each parameter's gradient, and
every operator's FLOPs and bytes (plan_time.py). Run on the fake model (model.py) or, for the
tests, on real tensors, it gives the same bytes ([Note: how the plan is made], planner.py);
memory.py reads the bytes alive at each point off it.

For the compiled step (plan_time's fusion) each operator also carries the storages it reads and
writes and the compiled graph it would run in: a decoder layer's forward, that layer's backward
(its operators run under an autograd node the layer's forward made: recompute's replay too), or
the fused loss's chunk function, the parts `training.compile` compiles (models/compile.py,
models/loss.py); everything else runs eagerly in a compiled run too.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyperparallel.models import fused_loss
from hyperparallel.models import loss as loss_module
from hyperparallel.models.layers import decoder_layers
from hyperparallel.parallel.pipeline import PipelineStageModule, StageLayout
from hyperparallel.train.build import build_balancer
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.memory import nbytes, timeline_peak
from hyperparallel.train.planning.plan_time import OpCosts, fusible, op_cost


def _sequence_now() -> int:
    """The sequence number autograd gives the next node it makes (nodes are numbered in the order
    they are made, per thread): a node made by a throwaway view, outside every dispatch mode, so the
    recording does not see it."""
    with torch._C._DisableTorchDispatch(), torch.enable_grad():
        return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


class _Recorder(TorchDispatchMode):
    """Every storage an operator makes, in order, with when it is freed: ("alloc", serial, bytes),
    ("free", serial), and the marks put in between: ("mark", kind, index)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self.live: dict[int, int] = {}  # storage address -> serial
        self.serials = 0
        self.costs = OpCosts()  # every operator's FLOPs and bytes, for the step-time prediction
        self.outside: dict[int, int] = {}  # storage address -> id, of storages no operator made (parameters)
        # compiled graphs: the one running now in the forward (-1: none), and each one's range of
        # autograd sequence numbers [first, end), whose nodes' backward is that graph's backward
        self.graph = -1
        self.graphs: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cost = op_cost(func, args, kwargs, out)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage()._cdata for t in tensors}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        if cost is not None:
            reads = tuple((self._storage_id(t), t.numel() * t.element_size()) for t in tensors)
            writes = ()
            if fusible(func):
                if func._schema.is_mutable:  # (in place: what it writes is an argument)
                    written = [t for a, t in zip(func._schema.arguments, args, strict=False)
                               if isinstance(t, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write]
                else:
                    written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                writes = tuple((self._storage_id(t), t.numel() * t.element_size()) for t in written)
            self.costs.add(*cost, reads=reads, writes=writes, graph=self._graph_now() if writes else -1)
            if func is torch.ops.aten._to_copy.default and writes:  # (a weight's cast: plan_time.OpCosts.casts)
                self.costs.casts[len(self.costs.ops) - 1] = (reads[0][0], writes[0][0])
        elif not func.overloadpacket.__name__.startswith("device"):  # (prim.device: metadata, no dispatch when real)
            self.costs.no_kernel += 1
        return out

    def module_called(self, module, args) -> None:
        self.costs.modules += 1

    def _storage_id(self, t: torch.Tensor) -> int:
        """An id of `t`'s storage: an operator's storage by its serial, any other (a parameter, an
        input) by a negative id of its own."""
        key = t.untyped_storage()._cdata
        if key in self.live:
            return self.live[key]
        return self.outside.setdefault(key, -1 - len(self.outside))

    def _graph_now(self) -> int:
        """The compiled graph the operator running now belongs to, or -1 (eager)."""
        if self.graph >= 0:
            return self.graph
        node = torch._C._current_autograd_node()
        if node is None or not self.graphs:
            return -1
        sequence = node._sequence_nr()
        for i, (first, end) in enumerate(self.graphs):  # (backward: one graph per compiled forward)
            if first <= sequence < end:
                return len(self.graphs) + i
        return -1

    def begin_graph(self) -> None:
        """A compiled graph's forward starts (a decoder layer's, the loss chunk's)."""
        if self.graph < 0:  # (nested: the outer graph)
            self.graph = len(self.graphs)
            self.graphs.append((_sequence_now(), -1))

    def end_graph(self) -> None:
        if self.graph >= 0:
            self.graphs[self.graph] = (self.graphs[self.graph][0], _sequence_now())
            self.graph = -1

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
    padded_attention: bool = False  # whether an attention ran on zero-padded values (`_attention_as_on_gpu`)

    def activations(self) -> int:
        """The most bytes alive at once that are not parameters' gradients."""
        return timeline_peak(self, None, 1, 1, 0)[0]

    def kept_per_stage(self) -> list[int]:
        """What each stage's forward keeps for its backward, in the order the micro-batch ran
        them (a pipeline rank's: the bytes its forward added, alive at its end and at backward's
        start); one stage (the whole) without stage marks."""
        alloc_bytes: dict[int, int] = {}
        live, ends = 0, []
        for event in self.events:
            if event[0] == "alloc" and event[1] not in self.grad_serial:
                alloc_bytes[event[1]] = event[2]
                live += event[2]
            elif event[0] == "free":
                live -= alloc_bytes.pop(event[1], 0)
            elif event[0] == "mark" and event[1] == "stage_done":
                ends.append(live)
            elif event[0] == "mark" and event[1] == "backward":
                break
        if not ends:
            return [live]
        ends[-1] = live  # (what the last stage's end left for backward: its loss's too)
        return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]

    def with_gradients_of(self, params: list[torch.Tensor]) -> Timeline:
        """This timeline with each parameter's gradient the size of `params[j]` (the same model's
        parameters with fewer experts: `plan_search` screens expert-parallel layouts on the
        timeline of one simulation with every expert, its expert gradients cut to a rank's)."""
        size = {serial: nbytes(params[j]) for serial, j in self.grad_serial.items()}
        events = [("alloc", e[1], size[e[1]]) if e[0] == "alloc" and e[1] in size else e for e in self.events]
        return replace(self, events=events)

    def without_casts_of(self, grads: dict[int, int]) -> Timeline:
        """This timeline as the step runs when FSDP gathers the parameters of `grads` (index -> the
        bytes of its gradient in the gathered dtype) in the products' dtype (bf16 under bf16 mixed
        precision): autocast's copies of them, and their gradients' casts back to the parameter's
        dtype, are never made; the gradient is the gathered copy's, in its dtype (the copy itself
        is FSDP's, counted with its buffers)."""
        params = frozenset(grads)
        gone = {storage for storage, j in self.costs.cast_storages.items() if j in params}
        if not gone:
            return self
        resized = {serial: grads[j] for serial, j in self.grad_serial.items() if j in params}
        events = [("alloc", e[1], 0 if e[1] in gone else resized[e[1]]) if e[0] == "alloc" and (e[1] in gone or e[1] in resized)
                  else e for e in self.events]
        return replace(self, events=events, costs=self.costs.without_casts_of(params))


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


@contextlib.contextmanager
def _attention_as_on_gpu():
    """SDPA as a GPU runs it, for a plan of a GPU made on the CPU: where the value heads are
    narrower than the query and key heads (DeepSeek's MLA: 192 and 128), the CPU has no fused
    kernel and SDPA's math path keeps [heads, seq, seq] score matrices that a GPU's
    memory-efficient kernel never makes. While this runs, such a call runs the fused kernel on the
    values zero-padded to the query's width and keeps the value width of the output: what a GPU
    keeps, give or take the padded output (saved for backward), with the value product counted at
    the padded width (MLA's 192 / 128: a fifth more attention FLOPs). (transformers looks the
    function up on torch.nn.functional at each call, recompute's replays included.)"""
    original = F.scaled_dot_product_attention
    padded: list[bool] = []  # (yielded: whether any call was padded)

    def attention(query, key, value, *args, **kwargs):
        width = value.shape[-1]
        if width < query.shape[-1] == key.shape[-1]:
            padded.append(True)
            return original(query, key, F.pad(value, (0, query.shape[-1] - width)), *args, **kwargs)[..., :width]
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield padded
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _loss_chunks_as_graphs(recorder: _Recorder):
    """The fused loss's chunk function, which a compiled run compiles (`install_fused_loss(model,
    compile)`; the fake model's is eager), recorded as a compiled graph of its own each call."""
    original = loss_module._chunk_loss_and_grad

    def chunk(*args, **kwargs):
        recorder.begin_graph()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.end_graph()

    loss_module._chunk_loss_and_grad = chunk
    try:
        yield
    finally:
        loss_module._chunk_loss_and_grad = original


class _StagePass:
    """A micro-batch through the stages pipeline rank `pp_rank` holds, as the schedule runs it:
    each stage's module (`parallel.pipeline.PipelineStageModule`, the trainer's) forward, the
    first from the token ids, the others from activations received (a leaf of the schedule's
    buffers); then backward from the last stage's loss, or from the gradient of what a stage sends
    on. The received activations and gradients are made at construction, outside the recording."""

    def __init__(self, model: nn.Module, mode, stages: StageLayout, pp_rank: int, shape: tuple[int, int],
                 device: torch.device):
        hidden_size = model.config.get_text_config(decoder=True).hidden_size
        dtype = next(q.dtype for q in model.parameters() if q.is_floating_point())
        activations = (*shape, hidden_size)
        self.modules = [PipelineStageModule(model, stages, s, _run, activations) for s in stages.stages_of(pp_rank)]
        with mode:
            self.received = [torch.empty(activations, dtype=dtype, device=device, requires_grad=True)
                             for _ in self.modules]
            self.gradients = [torch.empty(activations, dtype=dtype, device=device) for _ in self.modules]

    def forward(self, ids: torch.Tensor, recorder: _Recorder) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What backward starts from (a loss, or each sent activation) and its gradients; a
        "stage_done" mark after each stage's forward (`Timeline.kept_per_stage`)."""
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        outputs, gradients = [], []
        for k, (module, received, gradient) in enumerate(zip(self.modules, self.received, self.gradients, strict=True)):
            inputs = (ids, ids, positions) if module.first else (received, ids, ids, positions)
            out = module(*inputs)
            outputs.append(out if module.last else out[0])
            gradients.append(None if module.last else gradient)
            recorder.mark("stage_done", k)
        return outputs, gradients


def _run(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor, *items):
    return model(input_ids=ids, labels=labels, position_ids=positions)


def simulate(model: nn.Module, mode, cfg: TrainConfig, device: torch.device, seq_len: int | None = None,
             gpu_attention: bool = False, stages: StageLayout | None = None, pp_rank: int = 0) -> Timeline:
    """One micro-batch's forward and backward on `mode`'s fake tensors, recorded (a real model
    with a null context for `mode` is recorded the same way, on real tensors). `seq_len`: the
    tokens of each sequence this rank holds (context parallelism's part; default the whole);
    `gpu_attention`: attention as a GPU runs it (`_attention_as_on_gpu`), for a GPU's plan. With
    `stages`: `model` is what pipeline rank `pp_rank` holds (`model.fake_model`), and the micro-batch
    runs through each of its stages as the schedule runs them (`_StagePass`): forward, then
    backward from the loss or from the gradient the next stage sends (the activations the
    previous stage sends, and the gradients, arrive in the schedule's buffers, made before: not
    in the recording, `memory.pipeline_buffers` counts them)."""
    layers = list(decoder_layers(model))
    params = list(model.parameters())
    recorder = _Recorder()
    handles = []
    for i, layer in enumerate(layers):
        def begin(m, a, i=i):
            recorder.mark("forward", i)
            recorder.begin_graph()

        def end(m, a, o, i=i):
            recorder.end_graph()
            recorder.mark("forward_done", i)

        handles.append(layer.register_forward_pre_hook(begin))
        handles.append(layer.register_forward_hook(end))
    for j, p in enumerate(params):
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p, j=j: recorder.mark("grad", j)))
    bf16 = cfg.training.mixed_precision == "bf16"
    try:
        balancer = build_balancer(cfg, model)  # (what its routers keep for the MoE auxiliary loss)
        # every module call (the CPU's Python time per module: plan_time); process-wide, so last
        handles.append(torch.nn.modules.module.register_module_forward_pre_hook(recorder.module_called))
        attention = _attention_as_on_gpu() if gpu_attention else contextlib.nullcontext()
        shape = (cfg.training.micro_batch, seq_len or cfg.data.seq_len)
        stage_pass = _StagePass(model, mode, stages, pp_rank, shape, device) if stages is not None else None
        with mode, recorder, _masks_as_on_real_tensors(), _loss_chunks_as_graphs(recorder), attention as padded:
            ids = torch.zeros(shape, dtype=torch.long, device=device)
            with fused_loss(model):
                with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    if stage_pass is not None:
                        loss, gradients = stage_pass.forward(ids, recorder)
                    else:
                        loss, gradients = [model(input_ids=ids, labels=ids).loss], None
                # (a pipeline stage attaches its part of the auxiliary loss to what it hands on: moe/balance.py)
                aux = balancer.aux_loss() if balancer is not None and stage_pass is None else None
                if aux is not None:
                    loss = [loss[0] + aux]
                recorder.mark("backward")
                torch.autograd.backward(loss, gradients)
            if balancer is not None:
                balancer.after_backward()
            recorder.mark("end")
            grad_serial = {recorder.serial_of(p.grad): j for j, p in enumerate(params) if p.grad is not None}
            stored = {recorder._storage_id(p): j for j, p in enumerate(params)}
            del loss, gradients, ids, stage_pass
    finally:
        for handle in handles:
            handle.remove()
        for p in params:
            p.grad = None
    grad_serial.pop(None, None)
    recorder.costs.weights_cast(stored, grad_serial)
    return Timeline(recorder.events, grad_serial, len(layers), recorder.costs, padded_attention=bool(padded))

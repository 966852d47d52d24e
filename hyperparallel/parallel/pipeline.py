"""Pipeline parallelism: a causal LM's decoder layers split into stages over the `pp` ranks, the
step's micro-batches run through them by one of torch.distributed.pipelining's schedules
(parallel.pp_schedule; no schedule runtime of our own).

Stages. The decoder layers are split into pp x pp_virtual_stages stages of consecutive layers,
by hand (parallel.pp_layers) or balanced by each layer's parameters (a decoder layer's work per
token is twice its parameters; the last stage also carries the output head's, the first the
embedding's lookup, which costs nothing; an MoE layer's count is all its experts', more than a
token's work: its share is overstated). A rank holds one stage, or several (interleaved_1f1b:
stages r, r + pp, ...).

What a rank holds. Its model is the whole model's object with, in the places of the layers other
ranks hold, `LayerOnAnotherStage` (no parameters: the layers it holds keep their names, so
checkpoints, FSDP and the optimizer see the one-process names, and a checkpoint loads into any
pp); the input embedding only where the first stage is (else `StageInput`; a head tied to it:
the last stage keeps the embedding module too, the weight under its name); the modules with
parameters outside the decoder layers (the final norm, the head, ...) only where the last stage is
(else `HeldByLastStage`). It is cut so on the meta device, before anything gets memory: each rank
builds, initializes and loads only what it holds.

[Note: a stage runs the model's own forward]
Each stage calls the Hugging Face model's forward, as one process does, with three changes around
that call: the layers of other stages (this rank's other stages' included) are places that hand
their input on; before the stage's first layer, its input is replaced by the activations the
previous stage sent (a forward pre-hook); the stage's last layer's output is what the stage sends
on (a forward hook), the forward then running on through places and stand-ins that hand it on,
unless the stage is the last, which runs the model's own tail to its loss. So the masks,
positions and rotary tables the model computes before its layers are computed on every stage as
in one process, from the input ids and positions, which travel along the pipeline with the labels,
and no architecture's forward is rewritten. A module held by the last stage that a model calls
before its layers end (a per-layer input embedding, say) stops the run with one line naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import traffic
from hyperparallel.errors import ConfigError
from hyperparallel.models.layers import LayerOnAnotherStage, layer_list
from hyperparallel.process_groups import made_once


@dataclass(frozen=True)
class StageLayout:
    """The pipeline's stages as numbers: which decoder layers each holds and which rank runs it."""

    pp: int
    per_rank: int  # stages a rank holds (pp_virtual_stages)
    schedule: str
    layers: tuple[tuple[int, int], ...]  # per stage, first to last: its layers [start, stop)

    @property
    def stages(self) -> int:
        return self.pp * self.per_rank

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds, in the order the schedule takes them (looped:
        r, r + pp, ...)."""
        return [pp_rank + v * self.pp for v in range(self.per_rank)]


def balanced_split(costs: list[float], stages: int, last_extra: float = 0.0) -> list[int]:
    """Layer counts per stage (each at least 1) minimizing the costliest stage: consecutive layers,
    `costs` per layer, `last_extra` on the last stage (its head)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the least possible costliest stage splitting layers [0, i) into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            extra = last_extra if s == stages else 0.0
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def stage_layout(model: nn.Module, pp: int, per_rank: int, schedule: str,
                 pp_layers: list[int] | None) -> StageLayout:
    """The stages of `model` (whole, on the meta device): parallel.pp_layers, or balanced by each
    decoder layer's parameters. ConfigError when the layers cannot fill the stages."""
    layers = layer_list(model)
    stages = pp * per_rank
    if len(layers) < stages:
        raise ConfigError(f"parallel.pp = {pp} x pp_virtual_stages = {per_rank} makes {stages} pipeline stages, and "
                          f"the model has {len(layers)} decoder layers; every stage needs at least one")
    if pp_layers is not None:
        if sum(pp_layers) != len(layers):
            raise ConfigError(f"parallel.pp_layers {pp_layers} adds up to {sum(pp_layers)} decoder layers, and the "
                              f"model has {len(layers)}")
        counts = list(pp_layers)
    else:
        costs = [float(sum(p.numel() for p in layer.parameters())) for layer in layers]
        head = model.get_output_embeddings()
        counts = balanced_split(costs, stages, float(head.weight.numel()) if head is not None else 0.0)
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return StageLayout(pp, per_rank, schedule, tuple(bounds))


class StageInput(nn.Module):
    """The input embedding's place on a rank without the first stage: zeros of the embedding's
    shape, which the stage's first layer never sees (the previous stage's activations replace them)."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros((*input_ids.shape, self.dim), dtype=self.dtype, device=input_ids.device)


class _StageRun:
    """What one stage's forward has done so far (shared with the stand-ins it passes)."""

    def __init__(self):
        self.output: torch.Tensor | None = None  # the stage's last layer's output, once it ran


class HeldByLastStage(nn.Module):
    """A module with parameters outside the decoder layers, on a rank without the last stage:
    after the stage's layers it hands its input on (its output is never used); called before
    them, the model needs it where it is not, and the run stops naming it."""

    def __init__(self, name: str, model_name: str):
        super().__init__()
        self.name, self.model_name = name, model_name
        self.run: _StageRun | None = None

    def forward(self, *args, **kwargs):
        if self.run is None or self.run.output is None:
            raise ConfigError(f"parallel.pp: {self.model_name} calls {self.name} before its decoder layers end, and "
                              f"only the last pipeline stage holds it; this model cannot be split into stages "
                              f"(use pp: 1)")
        return args[0] if args else next(iter(kwargs.values()))

    def extra_repr(self) -> str:
        return f"{self.name}, held by the last pipeline stage"


def _returns_tuple(layer: nn.Module) -> bool:
    """Whether the model's loop unpacks a tuple from its layers (transformers annotates forward)."""
    annotation = inspect.signature(type(layer).forward).return_annotation
    return "tuple" in str(annotation).lower()


def tied_head(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def hold_stages(model: nn.Module, layout: StageLayout, pp_rank: int) -> list[int]:
    """Cut `model` (on the meta device) to what pipeline rank `pp_rank` holds (the module's note);
    returns its stages."""
    stages = layout.stages_of(pp_rank)
    layers = layer_list(model)
    held = {i for s in stages for i in range(*layout.layers[s])}
    returns_tuple = _returns_tuple(layers[0])
    for i in range(len(layers)):
        if i not in held:
            layers[i] = LayerOnAnotherStage(i, returns_tuple)
    first, last = 0 in stages, layout.stages - 1 in stages
    embedding = model.get_input_embeddings()
    tail = _last_stage_modules(model, "", {id(layers), id(embedding)})
    # (a head tied to the embedding: the last stage keeps the embedding module too, its weight the
    # head's under the embedding's name, its lookup's output replaced before the first layer)
    if not first and not (last and tied_head(model)):
        model.set_input_embeddings(StageInput(embedding.weight.shape[1], embedding.weight.dtype))
    for parent, name, where in tail:
        if not last:
            setattr(parent, name, HeldByLastStage(where, type(model).__name__))
    model._hp_last_stage_modules = [(where, name) for _, name, where in tail]
    return stages


def tied_embedding_groups(stage_world: int, pp: int, rank: int) -> dist.ProcessGroup | None:
    """Groups of two ranks, each of the first stage with the rank in the same place of the last
    stage (the tied embedding's two holders); returns this rank's, or None. Collective: every rank
    makes every group, once per default group (process_groups.py)."""
    def make() -> dict[tuple[int, int], dist.ProcessGroup]:
        pairs = [(place, (pp - 1) * stage_world + place) for place in range(stage_world)]
        return {pair: dist.new_group(list(pair)) for pair in pairs}

    groups = made_once(("tied embedding", stage_world, pp), make)
    return next((group for pair, group in groups.items() if rank in pair), None)


def _last_stage_modules(module: nn.Module, prefix: str, keep: set[int]) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, qualified name) of each module with parameters outside the decoder
    layers and the input embedding (`keep`): what the last stage holds."""
    found = []
    for name, child in module.named_children():
        if id(child) in keep or next(child.parameters(), None) is None:
            continue
        where = f"{prefix}{name}"
        if any(id(m) in keep for m in child.modules()):
            found += _last_stage_modules(child, f"{where}.", keep)
        else:
            found.append((module, name, where))
    return found


class PipelineStageModule(nn.Module):
    """One stage as the schedule runs it: the first takes the micro-batch's tensors (ids, labels,
    positions and, with context parallelism, its counted tokens), the others the activations and
    them; all but the last return the activations and them, the last the model's loss on its
    micro-batch. `run(model, ids, labels, positions, items)` is the model's forward as the trainer
    calls it (its outputs, with `.loss` given labels)."""


    def __init__(self, model: nn.Module, layout: StageLayout, stage: int, run: Callable,
                 activations: tuple[int, ...], balancer=None):
        super().__init__()
        self.model = model  # (the rank's stages share it: its parameters are theirs)
        self.stage, self.run = stage, run
        self.balancer = balancer  # the MoE load balancing: records each stage's forward (moe/balance.py)
        self.activations = activations  # the shape the stages declared to each other
        self.first, self.last = stage == 0, stage == layout.stages - 1
        self.layers = range(*layout.layers[stage])
        # What each run changes and puts back, found once (the model's structure is settled: built,
        # sharded and compiled): this rank's other stages' layers, set aside for places; on a rank
        # holding the last stage too, for a stage before it, the tail set aside for stand-ins.
        # (kept outside nn.Module's registry: the layers are the model's, registered there)
        object.__setattr__(self, "_layer_list", layer_list(model))
        returns_tuple = _returns_tuple(self._layer_list[self.layers.start])
        self._others = {i: (layer, LayerOnAnotherStage(i, returns_tuple)) for i, layer in enumerate(self._layer_list)
                        if i not in self.layers and not isinstance(layer, LayerOnAnotherStage)}
        self._tail = []  # (parent, attribute, the module, its stand-in)
        if not self.last:
            for where, name in model._hp_last_stage_modules:
                parent = model.get_submodule(where.rpartition(".")[0])
                module = getattr(parent, name)
                if not isinstance(module, HeldByLastStage):
                    self._tail.append((parent, name, module, HeldByLastStage(where, type(model).__name__)))
        self._stand_ins = [m for m in model.modules() if isinstance(m, HeldByLastStage)]
        self._stand_ins += [stand_in for *_, stand_in in self._tail]

    def forward(self, *inputs: torch.Tensor):
        hidden, travelling = (None, inputs) if self.first else (inputs[0], inputs[1:])
        ids, labels, positions, *items = travelling
        layers, handles, state = self._layer_list, [], _StageRun()
        try:
            for i, (_, place) in self._others.items():  # (only this stage's layers run)
                layers[i] = place
            for parent, name, _, stand_in in self._tail:
                setattr(parent, name, stand_in)
            for m in self._stand_ins:
                m.run = state
            if hidden is not None:
                handles.append(layers[self.layers.start].register_forward_pre_hook(
                    lambda module, args, kwargs: _with_hidden(hidden, args, kwargs), with_kwargs=True))
            if not self.last:
                def keep(module, args, output):
                    state.output = output[0] if isinstance(output, tuple) else output

                handles.append(layers[self.layers.stop - 1].register_forward_hook(keep))
            if self.balancer is not None:
                self.balancer.begin_stage()
            outputs = self.run(self.model, ids, labels if self.last else None, positions, *items)
        finally:  # (put back whatever happened)
            for handle in handles:
                handle.remove()
            for i, (layer, _) in self._others.items():
                layers[i] = layer
            for parent, name, module, _ in self._tail:
                setattr(parent, name, module)
            for m in self._stand_ins:
                m.run = None
        handed_on = outputs.loss if self.last else state.output
        if not self.last and tuple(handed_on.shape) != self.activations:
            raise ConfigError(f"parallel.pp: {type(self.model).__name__}'s decoder layers hand each other "
                              f"{tuple(handed_on.shape)}, not [rows, sequence, hidden_size] {self.activations}; "
                              f"this model cannot be split into pipeline stages yet (use pp: 1)")
        if self.balancer is not None:  # (its loads folded, its part of the auxiliary loss attached)
            handed_on = self.balancer.end_stage(handed_on)
        if hidden is not None and hidden.requires_grad and torch.is_grad_enabled():
            _count_gradient_sent(hidden)
        if self.last:
            return handed_on
        traffic.send("pp", (handed_on, *travelling), "activations")
        return handed_on, *travelling


def _count_gradient_sent(received: torch.Tensor) -> None:
    """Count the gradient of `received` (the activations the previous stage sent) when backward
    makes it: what this stage's schedule sends back."""
    def count(gradient: torch.Tensor) -> None:
        handle.remove()
        traffic.send("pp", (gradient,), "gradients")

    handle = received.register_hook(count)


def _with_hidden(hidden: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


@dataclass
class Pipeline:
    """A rank's stages and the schedule that runs them, each optimizer step (made at the first,
    from its batch's shape: the activations' shapes are declared to the stages, which then run no
    forward of their own to find them)."""

    model: nn.Module
    layout: StageLayout
    stages: list[int]  # the global stage indices this rank holds
    group: dist.ProcessGroup  # the pp group: one rank of each stage
    n_microbatches: int  # the step's micro-batches on each data-parallel rank
    hidden_dtype: torch.dtype  # what the decoder layers hand each other
    # the model's forward's other keywords (output_router_logits where it has the option)
    forward_kwargs: dict = field(default_factory=dict)
    # a head tied to the input embedding, on the ranks of the first and last stages: the weight's
    # name and the group of this rank and its partner (`tied_embedding_groups`)
    tied: tuple[str, dist.ProcessGroup] | None = None
    context: object = None  # context parallelism's ContextParallel (each rank its part of every sequence)
    balancer: object = None  # the MoE load balancing (a moe.LoadBalancer, after its for_pipeline), if any
    schedule: object = None  # a torch.distributed.pipelining schedule, made at the first step
    _no_outputs: dict = field(default_factory=dict)  # (step's keywords: made with the schedule)

    def run(self, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor | None, positions: torch.Tensor,
            items: torch.Tensor | None = None):
        """The model's forward as a stage runs it. With context parallelism (`items`: the
        micro-batch's counted tokens over cp, a row each) the labels are this rank's part of the
        whole sequence's shifted ones, as train/step.py's `model_outputs` gives them."""
        if items is None:
            return model(input_ids=ids, labels=labels, position_ids=positions, **self.forward_kwargs)
        loss = {} if labels is None else {"labels": labels, "shift_labels": labels,
                                          "num_items_in_batch": items.reshape(-1)[0]}
        return model(input_ids=ids, position_ids=positions, **loss, **self.forward_kwargs)

    def _travelling(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's micro-batches' tensors as the stages take them (the rows of each tensor split
        evenly into the schedule's micro-batches): with context parallelism this rank's part of
        each sequence, its labels shifted on the whole, and each micro-batch's counted tokens."""
        if self.context is None:
            return ids, labels, positions
        from hyperparallel.parallel.context_parallel import context_parallel_batch

        parts = [context_parallel_batch(i, t, self.context.size, self.context.rank)
                 for i, t in zip(ids.chunk(self.n_microbatches), labels.chunk(self.n_microbatches), strict=True)]
        items = torch.cat([counted.expand(i.shape[0], 1) for i, _, _, counted in parts]).to(ids.device)
        return (*(torch.cat([part[k] for part in parts]) for k in range(3)), items)

    @property
    def holds_first(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last(self) -> bool:
        return self.layout.stages - 1 in self.stages

    def _make_schedule(self, travelling: tuple[torch.Tensor, ...]) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as pp_schedules

        ids = travelling[0]
        rows, seq = ids.shape[0] // self.n_microbatches, ids.shape[1]
        hidden_size = self.model.config.get_text_config(decoder=True).hidden_size
        metas = tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device="meta") for t in travelling)
        hidden = torch.empty((rows, seq, hidden_size), dtype=self.hidden_dtype, device="meta", requires_grad=True)
        passed = (hidden, *metas)
        stages = []
        for s in self.stages:
            module = PipelineStageModule(self.model, self.layout, s, self.run, (rows, seq, hidden_size), self.balancer)
            inputs = metas if s == 0 else passed
            loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
            outputs = (loss,) if s == self.layout.stages - 1 else passed
            stages.append(PipelineStage(module, s, self.layout.stages, ids.device, input_args=inputs,
                                        output_args=outputs, group=self.group))
        n = self.n_microbatches

        def loss_fn(loss, target):  # (the loss is the model's own, from the labels that came along)
            return loss / n

        classes = {"1f1b": pp_schedules.Schedule1F1B, "gpipe": pp_schedules.ScheduleGPipe,
                   "interleaved_1f1b": pp_schedules.ScheduleInterleaved1F1B}
        cls = classes[self.layout.schedule]
        single = self.layout.schedule in ("1f1b", "gpipe")
        self.schedule = cls(stages[0] if single else stages, n, loss_fn=loss_fn, scale_grads=False)
        # (the last stage's outputs are not merged and returned: torch >= 2.10 asks, 2.9 never does)
        takes = "return_outputs" in inspect.signature(self.schedule.step).parameters
        self._no_outputs = {"return_outputs": False} if takes else {}

    def sum_tied_gradients(self) -> None:
        """The first stage's embedding and the last stage's head are one weight, held on two ranks:
        each gets the sum of both gradients (then both step it alike). After FSDP's reduce."""
        if self.tied is not None:
            name, group = self.tied
            weight = dict(self.model.named_parameters())[name]
            if weight.grad is None:  # (none arrived here: the partner's alone)
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=group)

    def evaluate(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each micro-batch's loss (forward only, no gradients), on every rank of the pp group."""
        travelling = self._travelling(ids, labels, positions)
        if self.schedule is None:
            self._make_schedule(travelling)
        losses: list[torch.Tensor] = []
        args = travelling if self.holds_first else ()
        target = travelling[1] if self.holds_last else None
        with torch.no_grad():
            self.schedule.eval(*args, target=target, losses=losses if self.holds_last else None, **self._no_outputs)
        each = (torch.stack([loss.double() for loss in losses]) * self.n_microbatches if losses
                else torch.zeros(self.n_microbatches, dtype=torch.float64, device=ids.device))
        dist.all_reduce(each, group=self.group)  # (the last stage's; the others add 0)
        return each

    def step(self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward over every micro-batch (the rows of `ids` split evenly
        into the schedule's micro-batches); returns the mean of the micro-batches' losses, on every
        rank of the pp group (the last stage computes it). The rank's gradients are left in its
        parameters' .grad (each micro-batch's loss divided by their count)."""
        travelling = self._travelling(ids, labels, positions)
        if self.schedule is None:
            self._make_schedule(travelling)
        losses: list[torch.Tensor] = []
        args = travelling if self.holds_first else ()
        target = travelling[1] if self.holds_last else None
        self.schedule.step(*args, target=target, losses=losses if self.holds_last else None, **self._no_outputs)
        total = torch.stack([loss.detach().double() for loss in losses]).sum() if losses \
            else torch.zeros((), dtype=torch.float64, device=ids.device)
        dist.all_reduce(total, group=self.group)  # (the last stage's; the others add 0)
        return total

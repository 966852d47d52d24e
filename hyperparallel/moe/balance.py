"""Load balancing across experts, per training step, for every MoE layer of a model: those whose
router is our TopKRouter (a MoEBlock), and those that keep transformers' router in front of our
GroupedExperts (any other MoE architecture), whose experts count the loads.

Three rules (`mode`):
- ``aux_loss``: each MoE layer's Switch auxiliary loss (see `router.switch_aux_loss`), averaged
  over the layers and times `aux_loss_coef`, is added to the training loss (Qwen3-MoE's rule;
  transformers' load_balancing_loss_func gives the same value for one layer). A layer with
  transformers' router gets transformers' own auxiliary loss instead, which its model adds to the
  loss it returns (`output_router_logits`, set by hyperparallel.models).
- ``bias``: aux-loss-free balancing (DeepSeek-V3): after each optimizer step, every router's
  correction bias moves by `bias_update_rate` towards balance, b_e += rate * sign(mean load -
  load_e), from the loads of the step summed over every rank that saw different tokens. The
  bias only changes which experts are chosen, never the weights of the chosen ones. Hash-routed
  routers (DeepSeek-V4's first layers) choose nothing and have no bias: they are left alone.
- ``none``: nothing is changed; the loads are still measured.

Whatever the rule, each step reports per MoE layer its imbalance: the most tokens any expert got
over the mean per expert (1.0 is perfect balance; E when one expert takes everything).

[Note: balancing pipeline stages] Under pipeline parallelism a rank holds some of the MoE layers
and its schedule runs several forwards before their backwards (`for_pipeline`). Each stage's
forward is recorded as it runs (`begin_stage` / `end_stage`: the routers record only then, so
recompute's replays in backward record nothing) and its loads folded at once; the loads are
summed over the ranks holding the same stage, the figures gathered over the pipeline into the
whole model's layer order. The auxiliary loss is the whole model's, made of every stage's part
(its layers' losses over the model's layer count, times the coefficient): a stage's part is
differentiated where the stage runs, attached to what the stage hands on (`_AuxLossGradient`:
the value passes unchanged, backward gives the part the gradient 1 / micro-batches, the weight
every micro-batch's loss has), the logged figure the parts' sum over the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.moe.block import MoEBlock
from hyperparallel.moe.config import MoEConfig
from hyperparallel.moe.experts import GroupedExperts
from hyperparallel.moe.router import LOAD_BALANCE, TopKRouter


def routers(model: nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@dataclass(frozen=True)
class BalancedLayer:
    """One MoE layer to balance: what counts its experts' loads (our router, or, inside a MoE block
    that is transformers' own, our GroupedExperts) and the module holding the correction bias
    that "bias" balancing moves (None: the layer's router has none)."""

    counter: nn.Module  # last_counts [E] after a forward, clear_record(), recording
    bias_owner: nn.Module | None

    @property
    def bias(self) -> torch.Tensor | None:
        # (looked up each time: materializing and sharding the model give the buffer new tensors)
        return None if self.bias_owner is None else self.bias_owner.e_score_correction_bias


def balanced_layers(model: nn.Module) -> list[BalancedLayer]:
    """Every MoE layer of `model`: our routers (a MoEBlock's), and the GroupedExperts of a MoE block
    that keeps transformers' router, beside which the router holding an `e_score_correction_bias`
    buffer (if any) is found."""
    layers = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            has_bias = module.e_score_correction_bias is not None
            layers.append(BalancedLayer(module, module if has_bias else None))
        elif not isinstance(module, MoEBlock):
            for child in module.children():
                if isinstance(child, GroupedExperts):
                    owner = next((c for c in module.children()
                                  if isinstance(getattr(c, "e_score_correction_bias", None), torch.Tensor)), None)
                    layers.append(BalancedLayer(child, owner))
    return layers


def aux_loss_coefficient(config, model: nn.Module) -> float:
    """`config`'s (the trainer's `moe:` section) auxiliary-loss coefficient: its own, or where null
    the model config's router_aux_loss_coef (0 without one)."""
    if config.aux_loss_coef is not None:
        return config.aux_loss_coef
    return getattr(getattr(model, "config", None), "router_aux_loss_coef", None) or 0.0


class LoadBalancer:
    def __init__(self, model: nn.Module, mode: str, *, aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 process_group=None):
        if mode not in LOAD_BALANCE:
            raise ConfigError(f"moe.load_balance must be one of {', '.join(LOAD_BALANCE)}, got {mode!r}")
        self.layers = balanced_layers(model)
        self.routers = [layer.counter for layer in self.layers if isinstance(layer.counter, TopKRouter)]
        names = {id(m): name for name, m in model.named_modules()}
        without_bias = [names[id(layer.counter)] for layer in self.layers
                        if layer.bias_owner is None and not getattr(layer.counter, "hash_routing", False)]
        if mode == "bias" and without_bias:
            raise ConfigError(f"moe.load_balance: bias needs routers with a correction bias, and {without_bias[0]} "
                              f"has none (its family balances with aux_loss)")
        self.mode, self.aux_loss_coef, self.bias_update_rate = mode, aux_loss_coef, bias_update_rate
        self.process_group = process_group
        for layer in self.layers:
            if isinstance(layer.counter, TopKRouter):
                layer.counter.load_balance = mode
            layer.counter.recording = True
            layer.counter.clear_record()
        self._step_counts: list[torch.Tensor | None] | None = None  # per layer [E]: this rank's, this step's
        self._aux_values: list[torch.Tensor] = []  # this step's, per micro-batch (read at its end)
        self.pipeline: _Pipeline | None = None  # set by for_pipeline

    @classmethod
    def from_config(cls, model: nn.Module, config: MoEConfig, *, family_rule: str) -> LoadBalancer:
        """The balancing `config` (the trainer's `moe:` section) asks for: its rule, or the model
        family's `family_rule`; a null aux_loss_coef is the model config's router_aux_loss_coef
        (0 without one)."""
        return cls(model, config.rule(family_rule), aux_loss_coef=aux_loss_coefficient(config, model),
                   bias_update_rate=config.bias_update_rate)

    def aux_loss(self) -> torch.Tensor | None:
        """coef * the mean over layers of the last forward's auxiliary losses (None when off, or where
        no router of ours records them: transformers' model then adds its own, `output_router_logits`)."""
        if self.mode != "aux_loss":
            return None
        losses = [loss for loss in (r.aux_loss() for r in self.routers) if loss is not None]
        if not losses:
            return None
        mean = torch.stack(losses).mean()
        self._aux_values.append(mean.detach())
        return self.aux_loss_coef * mean

    def after_backward(self, model_aux: torch.Tensor | None = None) -> None:
        """Fold the last micro-batch's loads into the step's (and clear the routers' records:
        call it after every micro-batch's backward). `model_aux`: the auxiliary loss (unscaled)
        that transformers' model added itself, reported as ours is."""
        if model_aux is not None:
            self._aux_values.append(model_aux.detach().float())
        self._fold()

    def _fold(self) -> None:
        """The routers' records into the step's loads, per layer (a pipeline stage's forward
        records its own layers only), and the records cleared."""
        if self._step_counts is None:
            self._step_counts = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            c = layer.counter.last_counts
            if c is not None:
                total = self._step_counts[i]
                self._step_counts[i] = c if total is None else total + c
            layer.counter.clear_record()

    def for_pipeline(self, decoder_layers: list[int], stage_group, pp_group, micro_batches: int,
                     device: torch.device) -> None:
        """Balance the MoE layers this rank holds of a pipeline's (none, on a rank whose stages have
        none: it still takes part), with the ranks holding the same stages (`stage_group`) and the
        other stages (`pp_group`), over `micro_batches` a step ([Note: balancing pipeline stages]).
        `decoder_layers`: each of this rank's balanced layers' decoder layer; `device`: the run's (its
        collectives' tensors). Collective over pp_group."""
        order = torch.tensor(decoder_layers, dtype=torch.float64, device=device)
        held = torch.tensor([len(self.layers), len(self.routers)], dtype=torch.int64, device=device)
        dist.all_reduce(held, group=pp_group)
        most = torch.tensor([len(self.layers)], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pp_group)
        padded = torch.full((int(most),), float("inf"), dtype=torch.float64, device=device)
        padded[:len(self.layers)] = order
        gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather(gathered, padded, group=pp_group)
        everywhere = torch.cat(gathered)  # (each pp rank's layers' decoder indices, padded with inf)
        placed = torch.argsort(everywhere, stable=True)[:int(held[0])]  # (the whole model's layers, in its order)
        self.process_group = stage_group
        self.pipeline = _Pipeline(pp_group, device, micro_batches, int(held[1]), int(most), placed)
        for layer in self.layers:
            layer.counter.recording = False  # (on only while a stage's forward runs)

    def begin_stage(self) -> None:
        """A pipeline stage's forward starts: its routers record it."""
        for layer in self.layers:
            layer.counter.recording = True

    def end_stage(self, handed_on: torch.Tensor) -> torch.Tensor:
        """A pipeline stage's forward ended with `handed_on` (its activations, or the last stage's
        loss): its loads folded, its routers' recording off, and its part of the auxiliary loss
        attached to `handed_on`, for backward ([Note: balancing pipeline stages])."""
        part = None
        if self.mode == "aux_loss":
            losses = [loss for loss in (r.aux_loss() for r in self.routers) if loss is not None]
            if losses:
                part = torch.stack(losses).sum() / self.pipeline.model_routers
                self._aux_values.append(part.detach())
        self._fold()
        for layer in self.layers:
            layer.counter.recording = False
        if part is None or not self.aux_loss_coef:
            return handed_on
        return _AuxLossGradient.apply(handed_on, self.aux_loss_coef * part / self.pipeline.micro_batches)

    @torch.no_grad()
    def after_step(self) -> dict[str, torch.Tensor]:
        """The step's global loads: update the biases (mode bias); return the step's figures as
        device tensors, read nothing back (`read_figures` turns them into numbers, when logging)."""
        figures: dict[str, torch.Tensor] = {}
        pipeline = self.pipeline
        if pipeline is not None and self.mode == "aux_loss":  # (every stage's parts, each micro-batch's)
            parts = (torch.stack(self._aux_values).sum() if self._aux_values
                     else torch.zeros((), dtype=torch.float32, device=pipeline.device))
            dist.all_reduce(parts, group=pipeline.group)
            figures["aux_loss"] = parts / pipeline.micro_batches
        elif self._aux_values:
            figures["aux_loss"] = torch.stack(self._aux_values).mean()
        self._aux_values = []
        per_layer, self._step_counts = self._step_counts, None
        if not per_layer or any(c is None for c in per_layer):
            if pipeline is not None and not self.layers:  # (a rank whose stages hold none takes part)
                empty = torch.zeros(0, dtype=torch.float64, device=pipeline.device)
                figures["moe_imbalance_per_layer"] = pipeline.gathered(empty)
            return figures
        counts = torch.cat(per_layer)  # one all-reduce for every layer
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(counts, group=self.process_group)
        imbalance = []
        for layer, load in zip(self.layers, counts.double().split([c.numel() for c in per_layer]), strict=True):
            mean = load.mean()
            imbalance.append(torch.where(mean > 0, load.max() / mean, torch.ones_like(mean)))
            bias = layer.bias
            if self.mode == "bias" and bias is not None:
                bias.add_(self.bias_update_rate * torch.sign(mean - load).to(bias.dtype))
        figures["moe_imbalance_per_layer"] = torch.stack(imbalance)
        if pipeline is not None:  # (the whole model's layers, in order)
            figures["moe_imbalance_per_layer"] = pipeline.gathered(figures["moe_imbalance_per_layer"])
        return figures


@dataclass
class _Pipeline:
    """What a pipeline rank's balancer knows of the others ([Note: balancing pipeline stages])."""

    group: object  # the pp group
    device: torch.device  # where this rank's figures are (its collectives' tensors)
    micro_batches: int
    model_routers: int  # the whole model's routers (the auxiliary loss's mean is over them)
    most: int  # the most MoE layers a pipeline rank holds
    placed: torch.Tensor = field(repr=False)  # where each of the model's layers is in the gathered figures

    def gathered(self, per_layer: torch.Tensor) -> torch.Tensor:
        """Every pipeline rank's per-layer figures, in the whole model's layer order."""
        padded = torch.zeros(self.most, dtype=per_layer.dtype, device=per_layer.device)
        padded[:per_layer.numel()] = per_layer
        out = [torch.empty_like(padded) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, padded, group=self.group)
        return torch.cat(out)[self.placed.to(per_layer.device)]


class _AuxLossGradient(torch.autograd.Function):
    """`handed_on` unchanged forward; backward, its gradient passes and `part` gets 1: the part is
    differentiated with what it is attached to, and adds nothing to its value."""

    @staticmethod
    def forward(ctx, handed_on: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(part)
        return handed_on.view_as(handed_on)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (part,) = ctx.saved_tensors
        return grad, torch.ones_like(part)


def read_figures(figures: dict[str, torch.Tensor]) -> dict[str, float | list[float]]:
    """`LoadBalancer.after_step`'s figures as numbers: aux_loss, moe_imbalance (the largest layer's)
    and moe_imbalance_per_layer (one host read each)."""
    read: dict[str, float | list[float]] = {}
    if "aux_loss" in figures:
        read["aux_loss"] = float(figures["aux_loss"])
    if "moe_imbalance_per_layer" in figures:
        per_layer = figures["moe_imbalance_per_layer"].tolist()
        read["moe_imbalance"] = max(per_layer)
        read["moe_imbalance_per_layer"] = [round(v, 4) for v in per_layer]
    return read

"""Load balancing across experts, per training step, for every TopKRouter of a model.

Three rules (`mode`):
- ``aux_loss``: each MoE layer's Switch auxiliary loss (see `router.switch_aux_loss`), averaged
  over the layers and times `aux_loss_coef`, is added to the training loss (Qwen3-MoE's rule;
  transformers' load_balancing_loss_func gives the same value for one layer).
- ``bias``: aux-loss-free balancing (DeepSeek-V3): after each optimizer step, every router's
  correction bias moves by `bias_update_rate` towards balance, b_e += rate * sign(mean load -
  load_e), from the loads of the step summed over every rank that saw different tokens. The
  bias only changes which experts are chosen, never the weights of the chosen ones. Hash-routed
  routers (DeepSeek-V4's first layers) choose nothing and have no bias: they are left alone.
- ``none``: nothing is changed; the loads are still measured.

Whatever the rule, each step reports per MoE layer its imbalance: the most tokens any expert got
over the mean per expert (1.0 is perfect balance; E when one expert takes everything).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.moe.config import MoEConfig
from hyperparallel.moe.router import LOAD_BALANCE, TopKRouter


def routers(model: nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class LoadBalancer:
    def __init__(self, model: nn.Module, mode: str, *, aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 process_group=None):
        if mode not in LOAD_BALANCE:
            raise ConfigError(f"moe.load_balance must be one of {', '.join(LOAD_BALANCE)}, got {mode!r}")
        self.routers = routers(model)
        without_bias = [name for name, m in model.named_modules()
                        if isinstance(m, TopKRouter) and m.e_score_correction_bias is None and not m.hash_routing]
        if mode == "bias" and without_bias:
            raise ConfigError(f"moe.load_balance: bias needs routers with a correction bias, and {without_bias[0]} "
                              f"has none (its family balances with aux_loss)")
        self.mode, self.aux_loss_coef, self.bias_update_rate = mode, aux_loss_coef, bias_update_rate
        self.process_group = process_group
        for router in self.routers:
            router.load_balance = mode
            router.recording = True
            router.clear_record()
        self._step_counts: list[torch.Tensor] | None = None  # per layer [E]: this rank's, this step's
        self._aux_values: list[torch.Tensor] = []  # this step's, per micro-batch (read at its end)

    @classmethod
    def from_config(cls, model: nn.Module, config: MoEConfig, *, family_rule: str) -> LoadBalancer:
        """The balancing `config` (the trainer's `moe:` section) asks for: its rule, or the model
        family's `family_rule`; a null aux_loss_coef is the model config's router_aux_loss_coef
        (0 without one)."""
        coef = config.aux_loss_coef
        if coef is None:
            coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", None) or 0.0
        return cls(model, config.rule(family_rule), aux_loss_coef=coef, bias_update_rate=config.bias_update_rate)

    def aux_loss(self) -> torch.Tensor | None:
        """coef * the mean over layers of the last forward's auxiliary losses (None when off)."""
        if self.mode != "aux_loss":
            return None
        losses = [loss for loss in (r.aux_loss() for r in self.routers) if loss is not None]
        if not losses:
            return None
        mean = torch.stack(losses).mean()
        self._aux_values.append(mean.detach())
        return self.aux_loss_coef * mean

    def after_backward(self) -> None:
        """Fold the last micro-batch's loads into the step's (and clear the routers' records:
        call it after every micro-batch's backward)."""
        counts = [r.last_counts for r in self.routers]
        if self.routers and all(c is not None for c in counts):
            if self._step_counts is None:
                self._step_counts = counts
            else:
                self._step_counts = [total + c for total, c in zip(self._step_counts, counts, strict=True)]
        for r in self.routers:
            r.clear_record()

    @torch.no_grad()
    def after_step(self) -> dict[str, torch.Tensor]:
        """The step's global loads: update the biases (mode bias); return the step's figures as
        device tensors, read nothing back (`read_figures` turns them into numbers, when logging)."""
        figures: dict[str, torch.Tensor] = {}
        if self._aux_values:
            figures["aux_loss"] = torch.stack(self._aux_values).mean()
        self._aux_values = []
        per_layer, self._step_counts = self._step_counts, None
        if per_layer is None:
            return figures
        counts = torch.cat(per_layer)  # one all-reduce for every layer
        if dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(counts, group=self.process_group)
        imbalance = []
        for router, load in zip(self.routers, counts.double().split([c.numel() for c in per_layer]), strict=True):
            mean = load.mean()
            imbalance.append(torch.where(mean > 0, load.max() / mean, torch.ones_like(mean)))
            if self.mode == "bias" and router.e_score_correction_bias is not None:
                bias = router.e_score_correction_bias
                bias.add_(self.bias_update_rate * torch.sign(mean - load).to(bias.dtype))
        figures["moe_imbalance_per_layer"] = torch.stack(imbalance)
        return figures


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

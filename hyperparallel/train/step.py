"""One optimizer step: forward and backward over the step's micro-batches (gradient sync on the
last only; the MoE auxiliary loss added to each), clipping, the optimizer, the MoE load-balance
update and the schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from hyperparallel import fsdp
from hyperparallel.models import fused_loss
from hyperparallel.parallel.context_parallel import context_parallel_batch
from hyperparallel.parallel.tensor_parallel import grad_replicas, sync_partial_grads
from hyperparallel.train.build import BuiltModel
from hyperparallel.train.data import MicroBatch


def model_outputs(built: BuiltModel, batch: MicroBatch, device: torch.device, **extra):
    """The model's outputs on one micro-batch (inside fused_loss and autocast), its `.loss` the
    language-model loss (plus the auxiliary loss of a model that adds its own: MoE layers keeping
    transformers' routers under moe.load_balance aux_loss, `built.transformers_aux_loss`). Packed
    documents come with position ids that restart at each, from which transformers keeps attention
    within each document. With context parallelism this rank runs its part of each sequence, and
    its loss is scaled so that the mean over the cp ranks' gradients is the whole sequence's
    (`context_parallel_batch`; preflight refuses document masks there)."""
    if hasattr(built.model.config, "output_router_logits"):
        # (asked for exactly when the loss is the trainer's choice: a config saved with
        # output_router_logits true would otherwise add its auxiliary loss under any other rule)
        extra.setdefault("output_router_logits", built.transformers_aux_loss)
    context = built.context_parallel
    ids, labels = batch.ids, batch.labels
    if context is None:
        if batch.positions is not None:
            extra["position_ids"] = batch.positions.to(device)
        return built.trained(input_ids=ids.to(device), labels=labels.to(device), **extra)
    local_ids, shift_labels, positions, items = context_parallel_batch(ids, labels, context.size, context.rank)
    return built.trained(input_ids=local_ids.to(device), labels=shift_labels.to(device),
                         shift_labels=shift_labels.to(device), position_ids=positions.to(device),
                         num_items_in_batch=items.to(device), **extra)


def stacked(micro_batches: list[MicroBatch], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The micro-batches' ids, labels and positions, each one tensor (a pipeline schedule splits
    them again); positions counting from 0 where a batch has none of its own."""
    ids = torch.cat([b.ids for b in micro_batches])
    positions = torch.cat([b.positions if b.positions is not None else
                           torch.arange(b.ids.shape[1]).expand_as(b.ids) for b in micro_batches])
    return ids.to(device), torch.cat([b.labels for b in micro_batches]).to(device), positions.to(device)


def language_model_loss(built: BuiltModel, batch: MicroBatch, device: torch.device, **extra) -> torch.Tensor:
    """The language-model loss alone on one micro-batch (`model_outputs`, no auxiliary loss)."""
    if hasattr(built.model.config, "output_router_logits"):
        extra["output_router_logits"] = False
    return model_outputs(built, batch, device, **extra).loss


def _transformers_aux(built: BuiltModel, outputs) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """(the auxiliary loss transformers' model added to its loss, scaled as it added it; unscaled)."""
    aux = getattr(outputs, "aux_loss", None) if built.transformers_aux_loss else None
    if aux is None:
        return None, None
    return built.model.router_aux_loss_coef * aux, aux


@dataclass(frozen=True)
class StepResult:
    loss: float  # this rank's mean over its micro-batches (the language-model loss alone)
    grad_norm: torch.Tensor  # on the device: read when a record is logged (metrics.LogWindow)
    lr: float  # the learning rate the step used
    moe: dict = field(default_factory=dict)  # the load balancing's figures, device tensors (moe.balance.read_figures)


class TrainStep:
    def __init__(self, built: BuiltModel, optimizer, scheduler, *, accumulation: int,
                 device: torch.device, autocast_bf16: bool, max_grad_norm: float | None,
                 sync_every_micro_batch: bool = False):
        self.built, self.optimizer, self.scheduler = built, optimizer, scheduler
        self.accumulation, self.device = accumulation, device
        self.autocast_bf16 = autocast_bf16
        self.max_norm = max_grad_norm or math.inf
        self.sync_every_micro_batch = sync_every_micro_batch  # (parallel.sync_every_micro_batch; sharded runs)
        self.params = [p for p in built.model.parameters() if p.requires_grad]
        # (by parameter name, which sharding and checkpoint loads keep: made once)
        self.replicas = grad_replicas(built.model)
        self.pipeline = built.pipeline
        if self.pipeline is not None and self.pipeline.tied is not None:  # (one weight, on two ranks: its norm once)
            name = self.pipeline.tied[0]
            self.replicas = {**(self.replicas or {}), name: (self.replicas or {}).get(name, 1) * 2}
        if self.pipeline is not None and self.pipeline.n_microbatches != accumulation:
            raise ValueError(f"the pipeline runs {self.pipeline.n_microbatches} micro-batches a step, the step "
                             f"{accumulation}")

    def _pipeline_step(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Every micro-batch through the pipeline's schedule; each stage's gradients kept whole
        until the last backward, then reduced once (FSDP's no-sync accumulation, reduced here
        rather than with a last micro-batch: the schedule orders the backward passes)."""
        ids, labels, positions = stacked(micro_batches, self.device)
        model = self.built.model
        fsdp.set_requires_gradient_sync(model, False)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()
        with fused_loss(model), autocast:
            total = self.pipeline.step(ids, labels, positions)
        fsdp.reduce_accumulated_gradients(model)
        self.pipeline.sum_tied_gradients()
        return total

    def _sync(self, last_micro: bool):
        """Gradients are reduced over the ranks on the step's last micro-batch only (sharded, with
        sync_every_micro_batch: on every one, into the shards' gradients)."""
        model, trained = self.built.model, self.built.trained
        if self.built.sharded:
            fsdp.set_requires_gradient_sync(model, last_micro or self.sync_every_micro_batch)
            return nullcontext()
        if self.built.mesh.ddp_enabled and not last_micro:
            return trained.no_sync()
        return nullcontext()

    def __call__(self, micro_batches: Iterable[MicroBatch]) -> StepResult:
        model, balancer = self.built.model, self.built.balancer
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pipeline is not None:  # (the mean of the micro-batches' losses, times their count below)
            loss_sum = self._pipeline_step(list(micro_batches)) * self.accumulation
            micro_batches = ()
        for i, batch in enumerate(micro_batches):
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()
            with self._sync(i == self.accumulation - 1), fused_loss(model):
                with autocast:
                    outputs = model_outputs(self.built, batch, self.device)
                loss = outputs.loss  # (with transformers' own auxiliary loss where its model adds one)
                model_aux, unscaled = _transformers_aux(self.built, outputs)
                del outputs  # (its logits, the fused loss's hidden states, would otherwise live through backward)
                aux = balancer.aux_loss() if balancer is not None else None
                ((loss if aux is None else loss + aux) / self.accumulation).backward()
            if balancer is not None:
                balancer.after_backward(unscaled)
            loss_sum += (loss if model_aux is None else loss - model_aux).detach().double()
        sync_partial_grads(model)  # (tensor parallelism: replicated weights' partial gradients)
        if self.built.sharded:
            grad_norm = fsdp.clip_grad_norm_(model, self.max_norm, replicas=self.replicas)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        moe = balancer.after_step() if balancer is not None else {}  # after the step, as DeepSeek-V3 updates its bias
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the step's one host read: the loss, which the ranks agree on (train.distributed.agree)
        return StepResult(loss_sum.item() / self.accumulation, grad_norm.detach(), lr, moe)

"""The validation loss: the mean cross-entropy per predicted token over a fixed set of held-out
sequences, and its perplexity.

The set is the same on any layout: `training.eval_batches` global batches of the validation
sequences in corpus order (wrapping around when there are fewer), each split over the ranks as a
training batch is (over the data-parallel replicas; the tp x cp ranks of one read the same
batch, and count its tokens as often as they are: the mean is unchanged). Every rank sums its token losses and counts, and one float64 all-reduce
makes the mean over all of them, so 1 rank and N sharded ranks agree to float rounding. The
count reported, `val_tokens`, is the tokens the loss was taken over, each once: the sum over the
ranks divided by the tp x cp ranks that read each batch, the same on every layout.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from hyperparallel.models import fused_loss
from hyperparallel.train import data
from hyperparallel.train.build import BuiltModel
from hyperparallel.train.distributed import Runtime, sum_over_ranks
from hyperparallel.train.step import language_model_loss, stacked


class Evaluator:
    def __init__(self, built: BuiltModel, rows: data.PackedRows | data.DocumentRows, *, global_batch: int,
                 micro_batch: int, eval_batches: int, rt: Runtime, autocast_bf16: bool):
        self.built, self.device, self.autocast_bf16 = built, rt.device, autocast_bf16
        self.eval_batches = eval_batches
        # the loss is the cross-entropy alone: not with an MoE auxiliary loss a config turned on
        self.cross_entropy_only = ({"output_router_logits": False}
                                   if getattr(built.model.config, "output_router_logits", False) else {})
        mesh = built.mesh
        self.readers = mesh.shape.world // mesh.dp_size  # (the ranks that read and count one batch: tp x cp)
        self.batches = data.Batches(rows, data.InOrder(len(rows)), global_batch, micro_batch, mesh.dp_rank, mesh.dp_size)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        model = self.built.model
        total = torch.zeros((), dtype=torch.float64)
        tokens = 0
        model.eval()
        try:
            for batch in range(self.eval_batches):
                if self.built.pipeline is not None:
                    total, tokens = self._through_pipeline(batch, total, tokens)
                    continue
                for micro in self.batches.micro_batches(batch):
                    counted = int((micro.labels[:, 1:] != data.IGNORE).sum())  # (the loss predicts each next token)
                    autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast_bf16
                                else nullcontext())
                    with fused_loss(model), autocast:
                        loss = language_model_loss(self.built, micro, self.device, **self.cross_entropy_only)
                    total += loss.double().cpu() * counted
                    tokens += counted
        finally:
            model.train()
        # (with pp, every stage's rank has every loss and count: the readers count pp too)
        total_sum, token_sum = sum_over_ranks([total.item(), float(tokens)])
        mean = total_sum / max(token_sum, 1.0)
        return {"val_loss": mean, "val_perplexity": math.exp(min(mean, 700.0)), "val_tokens": int(token_sum) // self.readers}

    def _through_pipeline(self, batch: int, total: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """One global batch's micro-batches through the pipeline stages (forward only)."""
        micro = list(self.batches.micro_batches(batch))
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()
        pipeline = self.built.pipeline
        kwargs, pipeline.forward_kwargs = pipeline.forward_kwargs, {**pipeline.forward_kwargs,
                                                                    **self.cross_entropy_only}
        try:
            with fused_loss(self.built.model), autocast:
                losses = pipeline.evaluate(*stacked(micro, self.device))
        finally:
            pipeline.forward_kwargs = kwargs
        for loss, m in zip(losses.cpu(), micro, strict=True):
            counted = int((m.labels[:, 1:] != data.IGNORE).sum())
            total += loss * counted
            tokens += counted
        return total, tokens

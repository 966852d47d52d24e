"""The vocab-parallel cross-entropy of a tensor-parallel output head.

Each TP rank holds rows [start, start + rows) of the head, so each rank's logits are its columns
of the whole. `VocabShard` is what tensor parallelism hands the fused loss head
(`models.loss.FusedLossHead.vocab_shard`, the `VocabSplit` protocol there): per chunk of tokens,
the row maxima, the sums of exponentials and the target logits are completed over the group (two
all-reduces), so the loss is the whole vocabulary's on every rank and each rank's gradient is its
columns'. Logits are never whole on any rank, except when generating (`whole_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyperparallel import traffic
from hyperparallel.models.loss import IGNORE_INDEX, softmax_numerators
from hyperparallel.parallel.tp_collectives import gather_last_dim


@dataclass(frozen=True)
class VocabShard:
    """A vocab-parallel head: this rank holds rows [start, start + rows) of the output head, and
    the ranks of `group` together hold the whole vocabulary."""

    group: dist.ProcessGroup
    start: int

    def loss_and_grad(self, logits: torch.Tensor, targets: torch.Tensor, inverse_denominator: torch.Tensor,
                      grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused loss's chunk function on this rank's columns of the logits: (sum of the
        counted rows' losses over the whole vocabulary, d loss / d this rank's logits)."""
        logits = logits.float()
        columns = logits.shape[1]
        counted = targets != IGNORE_INDEX
        local = targets - self.start
        mine = counted & (local >= 0) & (local < columns)
        safe = torch.where(mine, local, 0).unsqueeze(1)
        peak = logits.amax(dim=1, keepdim=True)
        traffic.all_reduce("tp", peak, self.group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        exp = softmax_numerators(logits, peak)
        sums_and_picked = torch.stack([exp.sum(dim=1), torch.where(mine, logits.gather(1, safe).squeeze(1), 0.0)])
        traffic.all_reduce("tp", sums_and_picked, self.group)
        dist.all_reduce(sums_and_picked, group=self.group)
        sums, picked = sums_and_picked[0].unsqueeze(1), sums_and_picked[1]
        lse = sums.log() + peak
        loss = torch.where(counted, lse.squeeze(1) - picked, 0.0).sum()
        scale = torch.where(counted.unsqueeze(1), inverse_denominator, 0.0)
        grad = exp.mul_(scale / sums).scatter_add_(1, safe, -torch.where(mine.unsqueeze(1), scale, 0.0))
        return loss, grad.to(grad_dtype)

    def whole_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's columns side by side (no autograd: logits for generation)."""
        return gather_last_dim(logits, self.group)

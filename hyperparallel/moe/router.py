"""TopKRouter: which experts each token goes to, and with what weights; and what load balancing
needs to know about that choice.

Three scorings cover the families:
- ``softmax`` (Qwen3-MoE): probabilities over all experts, the top k of them, renormalized to sum
  to one when `norm_topk_prob`;
- ``sigmoid`` (DeepSeek-V3, Kimi K2): independent sigmoid scores; a correction bias (aux-loss-free
  balancing) is added for the choice only; the experts are split into `num_groups` groups scored
  by the sum of their two best, only the `top_groups` best groups are eligible; the weights are
  the unbiased scores of the chosen experts, renormalized when `norm_topk_prob`, then times
  `routed_scaling_factor`.
- ``sqrtsoftplus`` (DeepSeek-V4): sqrt(softplus(logit)) scores, otherwise as ``sigmoid`` (correction
  bias, no groups; always renormalized). DeepSeek-V4's first layers route by hash (`hash_routing`):
  a fixed table `tid2eid` [vocab, k] gives each token id its experts, and the learned scores only
  weight them.
Each follows the corresponding transformers router op for op (the same torch calls in the same
order), so indices, weights and gradients are those of transformers' own. With `fused` (the
trainer's `kernels.mega_gate`), everything after the logits runs as one MegaGate operation
(`hyperparallel.kernels.mega_gate`): the same indices and, to fp32 rounding, the same weights and
gradients, with the loads counted in the same pass. A router whose top_k exceeds the experts its
eligible groups reach (transformers' own DeepSeek-V3 tests have one) chooses experts outside them
too, as transformers' does (see [Note: top_k beyond the reachable experts], in
kernels/router_groups.py); MegaGate cannot promise torch.topk's order among those, so such a router
is not `fusable` and runs op by op even with `fused` set: that rule is `fusable`, read by
`route_logits` and by what reports the kernels (models/kernels.py's `use_kernels`).

When a `hyperparallel.moe.LoadBalancer` watches it (`recording`), a router in training also
records, once per micro-batch, how many (token, slot) pairs chose each expert and, when
`load_balance == "aux_loss"`, the probabilities its layer's auxiliary loss is made of
(`aux_loss()`: E * sum_e f_e * P_e, f_e the fraction of top-k choices that went to e and P_e the
mean probability of e, the Switch Transformer loss, per layer).

[Note: recording under recompute] With activation recompute, backward runs the layer's forward
again. Its record is the first forward's, kept until the balancer clears it after backward: the
recomputed forward records nothing, since its probabilities would hold the recomputed layer's
graph (attention's activations among it) alive until backward ends, and the loads are the same.
The auxiliary loss is made outside the layer (by the balancer, before backward) from the first
forward's probabilities, so nothing inside a checkpointed region differs between the passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.kernels.router_groups import exceeds_reachable, group_problem

SCORES = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCE = ("aux_loss", "bias", "none")


class TopKRouter(nn.Module):
    def __init__(self, hidden_dim: int, num_experts: int, top_k: int, *, score: str = "softmax",
                 norm_topk_prob: bool = True, num_groups: int = 1, top_groups: int = 1,
                 routed_scaling_factor: float = 1.0, correction_bias: bool = False, float32_logits: bool = False,
                 hash_vocab_size: int | None = None, device=None, dtype=None):
        """`hash_vocab_size`: route by the token-id table `tid2eid` [hash_vocab_size, top_k] instead of
        top-k (DeepSeek-V4's hash layers; forward then needs the input ids)."""
        super().__init__()
        if score not in SCORES:
            raise ConfigError(f"router score {score!r} is not one of {', '.join(SCORES)}")
        if hash_vocab_size is not None and (correction_bias or num_groups > 1):
            raise ConfigError("a hash-routed router chooses no experts: it takes no correction bias and no groups")
        problem = group_problem(num_experts, num_groups, top_groups, top_k)
        if problem is not None:
            raise ConfigError(f"router: {problem}")
        self.hidden_dim, self.num_experts, self.top_k = hidden_dim, num_experts, top_k
        self.score, self.norm_topk_prob = score, norm_topk_prob
        self.num_groups, self.top_groups = num_groups, top_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.float32_logits = float32_logits
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_dim, device=device, dtype=dtype))
        if correction_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        if hash_vocab_size is not None:
            self.tid2eid = nn.Buffer(torch.zeros(hash_vocab_size, top_k, device=device, dtype=torch.long))
        else:
            self.tid2eid = None
        self.fused = False  # MegaGate (kernels.mega_gate), where `fusable`
        self.load_balance = "none"
        self.recording = False  # set by a LoadBalancer
        self.clear_record()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)  # transformers' draws, in its order
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        if self.tid2eid is not None:
            table = hash_table(self.tid2eid.shape[0], self.num_experts, self.top_k, device=self.tid2eid.device)
            self.tid2eid.copy_(table)

    @property
    def hash_routing(self) -> bool:
        return self.tid2eid is not None

    @property
    def fusable(self) -> bool:
        """Whether MegaGate computes this router's routing (with `fused` set, it does exactly when
        this holds): not when top_k exceeds the experts the eligible groups reach, see [Note: top_k
        beyond the reachable experts] (kernels/router_groups.py)."""
        return not exceeds_reachable(self.num_experts, self.num_groups, self.top_groups, self.top_k)

    # ------------------------------------------------------------------------------ routing

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states [..., H] (and, for hash routing, input_ids [...]) -> (logits [T, E],
        weights [T, k], indices [T, k])."""
        x = hidden_states.reshape(-1, self.hidden_dim)
        if self.hash_routing and (input_ids is None or input_ids.numel() != x.shape[0]):
            got = "none" if input_ids is None else f"{input_ids.numel()}"
            raise ShapeError(f"a hash-routed router needs the input ids of its {x.shape[0]} tokens; got {got}")
        if self.float32_logits:
            logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        else:
            logits = F.linear(x, self.weight)
        weights, indices = self.route_logits(logits, input_ids)
        return logits, weights, indices

    def route_logits(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after the projection: logits [T, E] -> (weights [T, k], indices [T, k])."""
        if self.fused and self.fusable:
            return self._fused(logits, input_ids)
        if self.score == "softmax":
            probs = F.softmax(logits, dtype=torch.float, dim=-1)
            weights, indices = self._softmax_top_k(probs)
            weights = weights.to(logits.dtype)
        else:
            probs = logits.sigmoid() if self.score == "sigmoid" else F.softplus(logits).sqrt()
            if self.hash_routing:
                weights, indices = self._hash_weights(probs, input_ids)
            else:
                weights, indices = self._sigmoid_top_k(probs)
        if self._records():
            _record(self, probs, indices)
        return weights, indices

    def _fused(self, logits: torch.Tensor, input_ids: torch.Tensor | None):
        from hyperparallel.kernels.mega_gate import mega_gate  # its kernels load on first use

        softmax = self.score == "softmax"
        hash_indices = self.tid2eid[input_ids.reshape(-1)] if self.hash_routing else None
        records = self._records()
        weights, indices, counts, prob_sum = mega_gate(
            logits.float(), self.e_score_correction_bias, score=self.score, top_k=self.top_k,
            num_groups=self.num_groups, top_groups=self.top_groups,
            # (a hash router always renormalizes, as transformers' does; softmax's renormalization has no eps)
            norm_topk_prob=self.norm_topk_prob or self.hash_routing,
            routed_scaling_factor=self.routed_scaling_factor, norm_eps=0.0 if softmax else 1e-20, hash_indices=hash_indices,
            aux_probs=records and self.load_balance == "aux_loss")
        if records and self.last_counts is None:  # see [Note: recording under recompute]
            self.last_counts = counts
            if prob_sum is not None:
                self.last_prob_sum, self.last_tokens = prob_sum, logits.shape[0]
        return weights.to(logits.dtype), indices

    def _records(self) -> bool:
        return self.recording and self.training and torch.is_grad_enabled()

    def _hash_weights(self, scores: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.tid2eid[input_ids.reshape(-1)]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices

    def _softmax_top_k(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = probs if self.e_score_correction_bias is None else probs + self.e_score_correction_bias
        choice = self._eligible(choice)
        if choice is probs:
            weights, indices = torch.topk(probs, self.top_k, dim=-1)
        else:
            indices = torch.topk(choice, self.top_k, dim=-1)[1]
            weights = probs.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else weights, indices

    def _sigmoid_top_k(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        choice = self._eligible(choice)
        indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices

    def _eligible(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with every expert outside the `top_groups` best groups at -inf."""
        if self.num_groups == 1:
            return choice
        per_group = self.num_experts // self.num_groups
        group_scores = choice.view(-1, self.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_groups, per_group).reshape(-1, self.num_experts)
        return choice.masked_fill(~score_mask.bool(), float("-inf"))

    # --------------------------------------------------------------------------- recording

    def clear_record(self) -> None:
        self.last_counts: torch.Tensor | None = None  # [E] int64: (token, slot) pairs per expert
        self.last_probs: torch.Tensor | None = None  # [T, E] with grad (aux_loss only)
        self.last_indices: torch.Tensor | None = None
        self.last_prob_sum: torch.Tensor | None = None  # [E] with grad (MegaGate, aux_loss only)
        self.last_tokens = 0

    def aux_loss(self) -> torch.Tensor | None:
        """This layer's auxiliary loss over the recorded forward (None: nothing recorded)."""
        if self.last_prob_sum is not None:  # MegaGate summed the distributions over the tokens
            if self.last_tokens == 0:
                return None
            share = self.last_counts.float() / self.last_tokens
            return self.num_experts * torch.sum(share * self.last_prob_sum / self.last_tokens)
        probs = self.last_probs
        if probs is None or probs.shape[0] == 0:
            return None
        if self.score != "softmax":  # the aux loss needs a distribution over experts per token
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return switch_aux_loss(probs, self.last_indices, self.num_experts)

    def extra_repr(self) -> str:
        groups = f", groups {self.top_groups} of {self.num_groups}" if self.num_groups > 1 else ""
        bias = ", correction bias" if self.e_score_correction_bias is not None else ""
        how = ", hash-routed" if self.hash_routing else ""
        fused = "" if not self.fused else ", MegaGate" if self.fusable else ", op by op (top_k beyond its groups)"
        return (f"{self.hidden_dim} -> {self.num_experts} experts, top {self.top_k}, {self.score}{groups}{bias}{how}"
                f"{fused}, load_balance={self.load_balance}")


def switch_aux_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over these tokens: f_e the share of top-k choices (summing to k, as
    transformers' load_balancing_loss_func counts them), P_e the mean of the probabilities."""
    tokens = probs.shape[0]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
    counts.scatter_add_(0, indices.reshape(-1), torch.ones(indices.numel(), dtype=torch.float32, device=probs.device))
    return num_experts * torch.sum(counts / tokens * probs.float().sum(dim=0) / tokens)


def _record(router: TopKRouter, probs: torch.Tensor, indices: torch.Tensor) -> None:
    # Once per micro-batch: see [Note: recording under recompute]. Under torch.compile this is
    # traced with the layer (the stores are side effects dynamo applies after the graph, the
    # probabilities one more output of it): no graph break.
    if router.last_counts is not None:
        return
    flat = indices.reshape(-1).detach()
    router.last_counts = torch.zeros(router.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    if router.load_balance == "aux_loss":
        router.last_probs, router.last_indices = probs, indices.detach()


def hash_table(vocab_size: int, num_experts: int, top_k: int, *, device=None) -> torch.Tensor:
    """[vocab_size, top_k] int64: for each token id, top_k distinct experts drawn uniformly (from
    the current RNG). transformers zeroes DeepSeek-V4's `tid2eid` and leaves the real table to the
    checkpoint; a model trained from scratch needs one that spreads the tokens over the experts."""
    return torch.rand(vocab_size, num_experts, device=device).topk(top_k, dim=-1).indices

"""MoEBlock: route, run the experts, add the shared experts — the MoE layer of the families.

It holds what transformers' sparse MoE blocks hold under the same names (`gate`: the router,
`experts`, and for DeepSeek `shared_experts`), so parameter names and checkpoints do not change.
With expert parallelism (`hyperparallel.moe.dispatch`), `dispatcher` sends each token's rows to
the rank that holds its expert and brings the results back; without, the experts run here.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.moe.experts import GroupedExperts
from hyperparallel.moe.router import TopKRouter


class MoEBlock(nn.Module):
    def __init__(self, modules: dict[str, nn.Module]):
        """`modules`: gate (a TopKRouter), experts (GroupedExperts) and optionally shared_experts
        (an MLP every token goes through), registered in the order given (which fixes the order
        of a seeded initialization: give the order of the block this one replaces)."""
        super().__init__()
        unknown = set(modules) - {"gate", "experts", "shared_experts"}
        if unknown or not {"gate", "experts"} <= set(modules):
            raise TypeError(f"MoEBlock takes gate, experts and optionally shared_experts; got {sorted(modules)}")
        self.shared_experts: nn.Module | None = None
        for name, module in modules.items():
            setattr(self, name, module)
        self.gate: TopKRouter
        self.experts: GroupedExperts
        self.dispatcher = None  # set by expert parallelism

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`input_ids`: the tokens' ids, which hash-routed routers (DeepSeek-V4) choose experts by."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, weights, indices = self.gate(tokens, input_ids)
        if self.dispatcher is None:
            out = self.experts(tokens, indices, weights)
        elif self.shared_experts is not None and getattr(self.dispatcher, "runs_shared_experts", False):
            # MegaMoE schedules the shared experts into its graph's idle time
            out, shared = self.dispatcher(self.experts, tokens, indices, weights, shared_experts=self.shared_experts)
            return out.view(*shape) + shared.view(*shape)
        else:
            out = self.dispatcher(self.experts, tokens, indices, weights)
        out = out.view(*shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out

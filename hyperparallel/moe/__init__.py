"""Mixture of experts: the router and load balancing, the token permutation, GroupedExperts (one
module; MXFP8 is a recipe of it), the MoE block, and expert parallelism (sequential, or MegaMoE's
overlapped task graphs)."""

from hyperparallel.moe.balance import LoadBalancer, routers
from hyperparallel.moe.block import MoEBlock
from hyperparallel.moe.experts import GroupedExperts, HighPrecision, unsupported_reason
from hyperparallel.moe.grouped_matmul import compute_dtype, grouped_mm, native_grouped_mm_supported
from hyperparallel.moe.megamoe import IMPLEMENTATIONS as MOE_IMPLEMENTATIONS
from hyperparallel.moe.megamoe import MegaMoE
from hyperparallel.moe.megamoe_graphs import MoEShape, default_waves, plan_graphs
from hyperparallel.moe.permutation import add_rows_to_tokens, gather_rows, padded_slots, sort_by_expert
from hyperparallel.moe.router import LOAD_BALANCE, TopKRouter, switch_aux_loss

__all__ = [
    "LOAD_BALANCE",
    "GroupedExperts",
    "HighPrecision",
    "LoadBalancer",
    "MOE_IMPLEMENTATIONS",
    "MegaMoE",
    "MoEShape",
    "MoEBlock",
    "TopKRouter",
    "add_rows_to_tokens",
    "compute_dtype",
    "default_waves",
    "gather_rows",
    "grouped_mm",
    "native_grouped_mm_supported",
    "padded_slots",
    "plan_graphs",
    "routers",
    "sort_by_expert",
    "switch_aux_loss",
    "unsupported_reason",
]

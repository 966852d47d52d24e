"""Mixture of experts: the router and load balancing, the token permutation, GroupedExperts (one
module; MXFP8 is a recipe of it), the MoE block, and expert parallelism (sequential, or MegaMoE's
overlapped task graphs)."""

from hyperparallel.lazy_exports import lazy_exports

# moe.implementation: how expert parallelism's all-to-alls run (dispatch.ExpertParallel, or megamoe.MegaMoE)
MOE_IMPLEMENTATIONS = ("sequential", "megamoe")
# moe.dispatch: the format rows travel to their experts in (dispatch.dispatch_format; auto picks one of the others)
MOE_DISPATCHES = ("auto", "compute", "mx")

__getattr__, __dir__, _exported = lazy_exports(__name__, {
    "balance": ("LoadBalancer", "routers"),
    "block": ("MoEBlock",),
    "config": ("MoEConfig",),
    "experts": ("GroupedExperts", "HighPrecision", "unsupported_reason"),
    "grouped_matmul": ("grouped_mm", "native_grouped_mm_supported"),
    "megamoe": ("MegaMoE",),
    "megamoe_graphs": ("MoEShape", "default_waves", "plan_graphs"),
    "permutation": ("add_rows_to_tokens", "gather_rows", "padded_slots", "sort_by_expert"),
    "router": ("LOAD_BALANCE", "TopKRouter", "switch_aux_loss"),
})
__all__ = sorted([*_exported, "MOE_DISPATCHES", "MOE_IMPLEMENTATIONS"])

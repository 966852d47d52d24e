"""The shapes group-limited top-k routing is defined for: one check, asked by MegaGate, moe's
TopKRouter and the model families' config checks. A module of its own, without torch, so a
config is checked without loading any kernel.

[Note: top_k beyond the reachable experts] The top_groups best groups reach top_groups x
(experts per group) experts. A top_k larger than that is still defined, as transformers defines
it (DeepseekV3TopkRouter, and transformers' own DeepSeek-V3 tests use such a shape): the experts
outside the chosen groups are at -inf for the choice, torch.topk still returns top_k of them,
the excluded ones in whatever order it leaves ties among -inf, and each is weighted by its real
(unbiased) score. moe's TopKRouter computes exactly that, op by op; MegaGate cannot promise
torch.topk's order among the -inf ties, so it refuses such shapes and TopKRouter never runs it
for them (`TopKRouter.fusable`)."""

from __future__ import annotations


def group_problem(num_experts: int, num_groups: int, top_groups: int, top_k: int,
                  names: tuple[str, str, str, str] = ("num_experts", "num_groups", "top_groups", "top_k")) -> str | None:
    """Why group-limited top-k is undefined for these shapes (None: it is defined), in `names`'
    terms. A group is scored by the sum of its two best experts, and the top_k experts are chosen
    among those of the top_groups best groups: so groups of at least two experts (when there are
    several), 1..num_groups groups eligible and 1..num_experts experts chosen. A top_k beyond the
    experts the eligible groups reach is defined (see [Note: top_k beyond the reachable experts];
    `exceeds_reachable` tells it). MegaGate, moe's TopKRouter and the families' config checks all
    ask this, so a shape is refused where it is given, never met in forward."""
    experts, groups, eligible, k = names
    if num_groups < 1 or num_experts % num_groups or (num_groups > 1 and num_experts // num_groups < 2):
        return f"{experts} ({num_experts}) must split into {groups} ({num_groups}) groups of at least 2 experts"
    if not 0 < top_groups <= num_groups:
        return f"{eligible} ({top_groups}) must be in 1..{groups} ({num_groups})"
    if not 0 < top_k <= num_experts:
        return f"{k} ({top_k}) must be in 1..{experts} ({num_experts})"
    return None


def reachable(num_experts: int, num_groups: int, top_groups: int) -> int:
    """How many experts the top_groups best of num_groups groups hold (shapes group_problem accepts)."""
    return top_groups * (num_experts // num_groups)


def exceeds_reachable(num_experts: int, num_groups: int, top_groups: int, top_k: int) -> bool:
    """Whether top_k is larger than the experts the eligible groups reach: the choice then takes
    experts outside them too, in torch.topk's order among -inf ties (see [Note: top_k beyond the
    reachable experts])."""
    return top_k > reachable(num_experts, num_groups, top_groups)

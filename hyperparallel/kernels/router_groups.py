"""The shapes group-limited top-k routing is defined for: one check, asked by MegaGate, moe's
TopKRouter and the model families' config checks. A module of its own, without torch, so a
config is checked without loading any kernel."""

from __future__ import annotations


def group_problem(num_experts: int, num_groups: int, top_groups: int, top_k: int,
                  names: tuple[str, str, str, str] = ("num_experts", "num_groups", "top_groups", "top_k")) -> str | None:
    """Why group-limited top-k is undefined for these shapes (None: it is defined), in `names`'
    terms. A group is scored by the sum of its two best experts, and the top_k experts are chosen
    among those of the top_groups best groups: so groups of at least two experts (when there are
    several), and at most top_groups x (experts per group) chosen. MegaGate, moe's TopKRouter and
    the families' config checks all ask this, so a shape is refused where it is given, never met
    in forward."""
    experts, groups, eligible, k = names
    if num_groups < 1 or num_experts % num_groups or (num_groups > 1 and num_experts // num_groups < 2):
        return f"{experts} ({num_experts}) must split into {groups} ({num_groups}) groups of at least 2 experts"
    if not 0 < top_groups <= num_groups:
        return f"{eligible} ({top_groups}) must be in 1..{groups} ({num_groups})"
    most = top_groups * (num_experts // num_groups)
    if not 0 < top_k <= most:
        return f"{k} ({top_k}) must be in 1..{eligible} * {experts} / {groups} ({most})"
    return None

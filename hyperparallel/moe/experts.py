"""GroupedExperts: the MoE experts as two grouped products, in high precision or MXFP8.

It takes the place of a Hugging Face experts module (Qwen3MoeExperts, DeepseekV3Experts) and
adopts its Parameter objects under the same names, gate_up_proj [E, 2I, H] (gate rows, then up
rows) and down_proj [E, H, I], so state dicts, checkpoints and optimizers see no difference.

How the products run is its `recipe`: `HighPrecision` (the default: torch's grouped matmul in
the compute dtype) or `hyperparallel.lowp.MXExpertsRecipe` (MXFP8 forward, input grad and weight
grad), which `lowp.convert` sets. The module, its routing semantics and its parameters are the
same either way.

forward(hidden_states [T,H], top_k_index [T,k], top_k_weights [T,k]) -> [T,H] computes
sum over slots of w * down(act(gate(x)) * up(x)) exactly as transformers' eager loop does: the
product with the routing weights is taken in their dtype (float32 routers promote) and cast back
to the hidden dtype before the tokens are summed. forward(rows [M,H], offsets=ends) is the
products alone, on rows already ordered by expert (what expert parallelism hands the local
experts; called as the module, so that module hooks such as FSDP's gathers run).
forward(rows, pipeline=fn) returns fn(self): MegaMoE's task graphs, run inside the module's hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.lowp.dtypes import compute_dtype
from hyperparallel.lowp.grouped import gated
from hyperparallel.moe.grouped_matmul import grouped_mm
from hyperparallel.moe.permutation import add_rows_to_tokens, gather_rows, padded_slots, sort_by_expert
from hyperparallel.moe.stages import HighPrecisionStages

# Rows per padded group for bf16/fp16 grouped matmuls on the CPU: oneDNN builds (and caches) one
# kernel per matmul shape, so expert groups of new sizes every step cost ~1 ms each there (measured:
# bf16 [M,256]x[256,512] with M varying is 5x slower than with M fixed). 32 rows bound the shapes
# to a few dozen per projection at a cost of at most 31 zero rows per expert.
CPU_LOW_PRECISION_GROUP_ALIGN = 32


@dataclass(frozen=True)
class HighPrecision:
    """The products in the compute dtype (the weights' own, or torch.autocast's)."""

    def group_alignment(self, device: torch.device, dtype: torch.dtype) -> int:
        if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            return CPU_LOW_PRECISION_GROUP_ALIGN
        return 1

    def compute_dtype(self, hidden_states: torch.Tensor) -> torch.dtype:
        return compute_dtype(hidden_states)

    def products(self, experts: GroupedExperts, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if rows.dtype != gate_up.dtype:  # under autocast the products run in its dtype, as nn.Linear's do
            gate_up, down = gate_up.to(rows.dtype), down.to(rows.dtype)
        gate_up_rows = grouped_mm(rows, gate_up.transpose(-2, -1), offsets)
        return grouped_mm(gated(gate_up_rows, experts.act_fn, experts.swiglu_limit), down.transpose(-2, -1), offsets)

    def stages(self, experts: GroupedExperts, *, needs_grad: bool = True) -> HighPrecisionStages:
        return HighPrecisionStages(experts)

    def describe(self) -> str:
        return "high precision"


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why `experts` (an HF experts module) cannot become a GroupedExperts, or None when it can."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "it needs nn.Parameters gate_up_proj and down_proj"
    if not hasattr(experts, "act_fn"):
        return "it needs an act_fn"
    flags = {"has_bias": False, "is_transposed": False, "has_gate": True, "has_post_expert_norm": False}
    odd = [flag for flag, default in flags.items() if getattr(experts, flag, default) != default]
    if odd or getattr(experts, "is_concatenated", True) is not True:
        return f"its layout ({odd or ['is_concatenated']}) differs from gate_up_proj [E, 2I, H], down_proj [E, H, I]"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} must be [E, 2I, H], [E, H, I]"
    E, two_i, H = gate_up.shape
    if tuple(down.shape) != (E, H, two_i // 2):
        return f"down_proj is {tuple(down.shape)}, but gate_up_proj {(E, two_i, H)} needs {(E, H, two_i // 2)}"
    return None


class GroupedExperts(nn.Module):
    """Drop-in for a Hugging Face experts module; parameters keep their names and objects."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module, *,
                 swiglu_limit: float | None = None, device=None, dtype=None):
        super().__init__()
        self.num_experts = num_experts  # of this module's weights (an expert-parallel rank: its own)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, **factory))
        self.act_fn = act_fn
        # DeepSeek-V4 clamps the SwiGLU inputs: gate above at the limit, up to [-limit, limit]
        self.swiglu_limit = swiglu_limit
        self.recipe = HighPrecision()

    @classmethod
    def from_hf(cls, experts: nn.Module) -> GroupedExperts:
        """Take over an HF experts module's Parameter objects (no copy, any device, meta included)."""
        reason = unsupported_reason(experts)
        if reason:
            raise ShapeError(f"{type(experts).__name__} cannot run as GroupedExperts: {reason}")
        E, two_i, H = experts.gate_up_proj.shape
        with torch.device("meta"):
            # DeepseekV4Experts calls its clamp `limit`
            grouped = cls(E, H, two_i // 2, experts.act_fn, swiglu_limit=getattr(experts, "limit", None))
        grouped.gate_up_proj = experts.gate_up_proj
        grouped.down_proj = experts.down_proj
        return grouped

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # Same calls in the same order as the HF families' _init_weights, so one seed gives the same
        # weights with and without the swap.
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, offsets: torch.Tensor | None = None,
                pipeline=None) -> torch.Tensor:
        asked = self.transformers_implementation()
        if asked is not None:
            if pipeline is not None or offsets is not None:
                raise ConfigError(f"experts implementation {asked!r} (set_experts_implementation): transformers' "
                                  f"{asked} runs all of a layer's experts on one rank, and expert parallelism splits "
                                  f"them; ours runs them as grouped products: set_experts_implementation"
                                  f"('grouped_mm')")
            # transformers' own implementation, on these same Parameters (the class this stands in for)
            return super().forward(hidden_states, top_k_index, top_k_weights)
        if pipeline is not None:  # MegaMoE's graphs, run as this module's forward so that its hooks run
            return pipeline(self)
        if offsets is not None:
            return self.run_sorted(hidden_states, offsets)
        num_tokens, top_k = top_k_index.shape
        if hidden_states.dim() != 2 or hidden_states.shape[0] != num_tokens:
            raise ShapeError(f"hidden_states must be [tokens, hidden] with {num_tokens} tokens (top_k_index is "
                             f"{tuple(top_k_index.shape)}), got {tuple(hidden_states.shape)}")
        order, offsets = sort_by_expert(top_k_index, self.num_experts)
        token_of_row = order // top_k
        dtype = self.recipe.compute_dtype(hidden_states)
        align = self.recipe.group_alignment(hidden_states.device, dtype)
        if align > 1:
            # Groups padded with zero rows to multiples of `align`: matmul libraries that build a
            # kernel per shape (oneDNN for bf16 on the CPU) then see a few shapes, not new ones
            # every step. Pad rows stay zero through SwiGLU and are never read back.
            token_of_slot, row_slot, offsets = padded_slots(token_of_row, top_k_index.reshape(-1)[order], offsets,
                                                            num_tokens, align)
            padded_input = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])
            rows = gather_rows(padded_input, token_of_slot).to(dtype)
        else:
            # a gather, not hidden_states[token_of_row]: its backward is an index_add, several times
            # faster on the CPU than the accumulating index_put that indexing's backward runs (and
            # kept from Inductor: [Note: row gathers as custom ops])
            rows = gather_rows(hidden_states, token_of_row).to(dtype)
        rows = self.recipe.products(self, rows, offsets)
        if align > 1:
            rows = gather_rows(rows, row_slot)
        rows = (rows * gather_rows(top_k_weights.reshape(-1), order).unsqueeze(-1)).to(hidden_states.dtype)
        return add_rows_to_tokens(rows, token_of_row, num_tokens)

    def transformers_implementation(self) -> str | None:
        """The experts implementation transformers' config asks for (`set_experts_implementation`,
        or `experts_implementation=` at load) when this module stands in for transformers' experts
        (models/standins.py), which it then runs on these Parameters; None where ours runs: not
        standing in, or grouped_mm, which ours is (its grouped products, high precision or MXFP8).
        Raises a ConfigError for another under an MXFP8 recipe, naming what ours does instead."""
        # (only a stand-in has transformers' class after ours, whose forward super() reaches)
        stands_in = getattr(type(self), "stands_in_for", None) is not None
        asked = getattr(getattr(self, "config", None), "_experts_implementation", None) if stands_in else None
        if asked in (None, "grouped_mm"):
            return None
        if not isinstance(self.recipe, HighPrecision):
            raise ConfigError(f"experts implementation {asked!r} (set_experts_implementation): transformers' {asked} "
                              f"computes in high precision, and these experts run {self.recipe.describe()}; "
                              f"set_experts_implementation('grouped_mm') keeps them")
        return asked

    def run_sorted(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) of rows ordered by expert (`offsets`: int32 cumulative group
        ends, one per local expert), in the rows' dtype."""
        dtype = self.recipe.compute_dtype(rows)
        align = self.recipe.group_alignment(rows.device, dtype)
        if align == 1:
            return self.recipe.products(self, rows.to(dtype), offsets).to(rows.dtype)
        num_rows = rows.shape[0]
        expert_of_row = torch.repeat_interleave(
            torch.arange(offsets.shape[0], device=rows.device),
            torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long)), output_size=num_rows)
        token_of_slot, row_slot, padded = padded_slots(torch.arange(num_rows, device=rows.device), expert_of_row,
                                                       offsets, num_rows, align)
        slots = gather_rows(torch.cat([rows, rows.new_zeros(1, rows.shape[-1])]), token_of_slot).to(dtype)
        return gather_rows(self.recipe.products(self, slots, padded), row_slot).to(rows.dtype)

    def extra_repr(self) -> str:
        limit = f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit is not None else ""
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}{limit}, {self.recipe.describe()}")

"""GroupedExperts: the MoE experts as two grouped products, in high precision or MXFP8.

It takes the place of a Hugging Face experts module (any class transformers decorates with
`@use_experts_implementation`: Qwen3MoeExperts, MixtralExperts, GptOssExperts, ...) and adopts its
Parameter objects under the same names, so state dicts, checkpoints and optimizers see no
difference. The default layout is gate_up_proj [E, 2I, H] (gate rows, then up rows) and
down_proj [E, H, I]; the decorator's flags, which it keeps under transformers' names, describe the
others: `has_gate` False (up_proj [E, I, H], the activation alone), `is_transposed` ([E, H, 2I] and
[E, I, H]), `has_bias` (gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]),
`has_post_expert_norm` (a norm on each expert's output). The activation of the first product is
the module's own `_apply_gate` where its class has one (SwiGLU by default; GPT-OSS's clamped,
interleaved one, DeepSeek-V4's clamped one), so whatever transformers' experts functions compute,
this computes.

How the products run is its `recipe`: `HighPrecision` (the default: torch's grouped matmul in
the compute dtype, every layout) or `hyperparallel.lowp.MXExpertsRecipe` (MXFP8 forward, input
grad and weight grad; the default layout), which `lowp.convert` sets. The module, its routing
semantics and its parameters are the same either way.

forward(hidden_states [T,H], top_k_index [T,k], top_k_weights [T,k]) -> [T,H] computes
sum over slots of w * down(act(gate(x)) * up(x)) exactly as transformers' eager loop does: the
product with the routing weights is taken in their dtype (float32 routers promote) and cast back
to the hidden dtype before the tokens are summed. With a `dispatcher` (expert parallelism of a
model whose MoE block is transformers' own) the tokens go to the ranks holding their experts and
back. forward(rows [M,H], offsets=ends) is the products alone, on rows already ordered by expert
(what expert parallelism hands the local experts; called as the module, so that module hooks
such as FSDP's gathers run); with `quantized=`, the same rows as MX data along the hidden
dimension, which MXFP8 experts take as their first product's operand (an MX dispatch:
hyperparallel.moe.exchange). forward(rows, pipeline=fn) returns fn(self): MegaMoE's task graphs,
run inside the module's hooks.
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
from hyperparallel.mx.tensor import MXTensor

# The name our experts run under in transformers' experts interface (`experts_implementation=`,
# `set_experts_implementation`): hyperparallel.models registers it in ALL_EXPERTS_FUNCTIONS, and
# a model whose experts are GroupedExperts runs it unless another is asked for.
EXPERTS_IMPLEMENTATION = "hyperparallel"

# Rows per padded group for bf16/fp16 grouped matmuls on the CPU: oneDNN builds (and caches) one
# kernel per matmul shape, so expert groups of new sizes every step cost ~1 ms each there (measured:
# bf16 [M,256]x[256,512] with M varying is 5x slower than with M fixed). 32 rows bound the shapes
# to a few dozen per projection at a cost of at most 31 zero rows per expert.
CPU_LOW_PRECISION_GROUP_ALIGN = 32

# transformers' @use_experts_implementation flags, their defaults (the layout GroupedExperts builds)
LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                "has_post_expert_norm": False}


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
        first, down = experts.first_proj, experts.down_proj
        if rows.dtype != first.dtype:  # under autocast the products run in its dtype, as nn.Linear's do
            first, down = first.to(rows.dtype), down.to(rows.dtype)
        # the products take [E, K, N]: the default layout stores [E, N, K] (as nn.Linear does)
        transposed = experts.is_transposed
        hidden = grouped_mm(rows, first if transposed else first.transpose(-2, -1), offsets)
        expert_of_row = _expert_of_row(offsets, rows.shape[0]) if experts.has_bias else None
        if experts.has_bias:
            hidden = hidden + gather_rows(experts.first_proj_bias.to(hidden.dtype), expert_of_row)
        out = grouped_mm(experts.activate(hidden), down if transposed else down.transpose(-2, -1), offsets)
        if experts.has_bias:
            out = out + gather_rows(experts.down_proj_bias.to(out.dtype), expert_of_row)
        if experts.has_post_expert_norm:
            out = experts.post_expert_norm(out)
        return out

    def stages(self, experts: GroupedExperts, *, needs_grad: bool = True) -> HighPrecisionStages:
        return HighPrecisionStages(experts)

    def describe(self) -> str:
        return "high precision"


def _expert_of_row(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The expert of each of `num_rows` rows sorted by expert (`offsets`: int32 cumulative ends)."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    return torch.repeat_interleave(torch.arange(offsets.shape[0], device=offsets.device), counts,
                                   output_size=num_rows)


def _padded_mx_rows(quantized: MXTensor, token_of_slot: torch.Tensor) -> MXTensor:
    """MX rows (blocked along dim 1) laid out in padded slots, a pad slot (index = rows) a zero
    row: zero elements and scale byte 0, what quantizing a zero row gives, so the padded MX rows
    are those of the padded values."""
    def slots(t: torch.Tensor) -> torch.Tensor:
        # as bytes: autocast's cat takes no float8 dtypes
        raw = t.view(torch.uint8)
        return torch.cat([raw, raw.new_zeros(1, raw.shape[1])]).index_select(0, token_of_slot).view(t.dtype)
    return MXTensor(slots(quantized.data), slots(quantized.scale), 1, quantized.scale_mode)


def layout_of(experts: nn.Module) -> dict[str, bool]:
    """transformers' @use_experts_implementation flags of an experts module (the decorator's defaults
    where it sets none)."""
    return {flag: bool(getattr(experts, flag, default)) for flag, default in LAYOUT_FLAGS.items()}


def first_proj_name(has_gate: bool) -> str:
    """The first product's weight: gate and up rows together, or up alone (transformers' names)."""
    return "gate_up_proj" if has_gate else "up_proj"


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why `experts` (an HF experts module) cannot become a GroupedExperts, or None when it can."""
    layout = layout_of(experts)
    first_name = first_proj_name(layout["has_gate"])
    first, down = getattr(experts, first_name, None), getattr(experts, "down_proj", None)
    if not isinstance(first, nn.Parameter) or not isinstance(down, nn.Parameter):
        return f"it needs nn.Parameters {first_name} and down_proj"
    gate_fn = getattr(type(experts), "_apply_gate", None)
    own_gate = layout["has_gate"] and gate_fn is not None and gate_fn.__name__ != "_default_apply_gate"
    if not own_gate and not callable(getattr(experts, "act_fn", None)):
        return "it needs an act_fn"
    if first.dim() != 3 or down.dim() != 3:
        return f"{first_name} {tuple(first.shape)} and down_proj {tuple(down.shape)} must be 3-D [experts, ...]"
    E = first.shape[0]
    H, width = (first.shape[1], first.shape[2]) if layout["is_transposed"] else (first.shape[2], first.shape[1])
    if layout["has_gate"] and width % 2:
        return f"{first_name} {tuple(first.shape)} has an odd width: gate and up rows must pair"
    inter = width // 2 if layout["has_gate"] else width
    want = (E, inter, H) if layout["is_transposed"] else (E, H, inter)
    if tuple(down.shape) != want:
        return f"down_proj is {tuple(down.shape)}, but {first_name} {tuple(first.shape)} needs {want}"
    expected = {first_name, "down_proj"}
    if layout["has_bias"]:
        expected |= {f"{first_name}_bias", "down_proj_bias"}
        for name, shape in ((f"{first_name}_bias", (E, width)), ("down_proj_bias", (E, H))):
            bias = getattr(experts, name, None)
            if not isinstance(bias, nn.Parameter) or tuple(bias.shape) != shape:
                return f"has_bias needs an nn.Parameter {name} {shape}"
    if layout["has_post_expert_norm"] and not isinstance(getattr(experts, "post_expert_norm", None), nn.Module):
        return "has_post_expert_norm needs a post_expert_norm module"
    extra = sorted(set(experts._parameters) - expected)
    extra += sorted(set(experts._modules) - {"act_fn", "post_expert_norm"})
    if extra:
        return f"it holds {', '.join(extra)}, which the experts interface's products do not read"
    return None


class GroupedExperts(nn.Module):
    """Drop-in for a Hugging Face experts module; parameters keep their names and objects."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn, *,
                 swiglu_limit: float | None = None, has_gate: bool = True, has_bias: bool = False,
                 is_transposed: bool = False, device=None, dtype=None):
        super().__init__()
        self.num_experts = num_experts  # of this module's weights (an expert-parallel rank: its own)
        self.routed_experts = num_experts  # of the layer, which routing indices count (expert parallelism keeps it)
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, is_transposed
        self.is_concatenated, self.has_post_expert_norm = True, False
        factory = {"device": device, "dtype": dtype}
        width = 2 * intermediate_dim if has_gate else intermediate_dim
        first_shape = (num_experts, hidden_dim, width) if is_transposed else (num_experts, width, hidden_dim)
        down_shape = (num_experts, intermediate_dim, hidden_dim) if is_transposed else (num_experts, hidden_dim,
                                                                                          intermediate_dim)
        self.register_parameter(first_proj_name(has_gate), nn.Parameter(torch.empty(first_shape, **factory)))
        self.down_proj = nn.Parameter(torch.empty(down_shape, **factory))
        if has_bias:
            self.register_parameter(f"{first_proj_name(has_gate)}_bias",
                                    nn.Parameter(torch.empty(num_experts, width, **factory)))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_dim, **factory))
        self.act_fn = act_fn
        # a clamped SwiGLU: gate above at the limit, up to [-limit, limit] (of a module built here;
        # one taken over from transformers runs its own `_apply_gate`)
        self.swiglu_limit = swiglu_limit
        self.gate_fn = None  # the replaced module's class's `_apply_gate` (from_hf), which `activate` calls
        self.recipe = HighPrecision()
        self.dispatcher = None  # expert parallelism inside this module (set by parallel's apply_expert_parallel)
        self.recording = False  # count each expert's rows (set by a LoadBalancer of a model whose routers are not ours)
        self.last_counts: torch.Tensor | None = None

    @classmethod
    def from_hf(cls, experts: nn.Module) -> GroupedExperts:
        """Take over an HF experts module's Parameter objects (no copy, any device, meta included)."""
        reason = unsupported_reason(experts)
        if reason:
            raise ShapeError(f"{type(experts).__name__} cannot run as GroupedExperts: {reason}")
        layout = layout_of(experts)
        first, down = getattr(experts, first_proj_name(layout["has_gate"])), experts.down_proj
        E, H, inter = (down.shape[0], down.shape[2], down.shape[1]) if layout["is_transposed"] else down.shape
        with torch.device("meta"):
            grouped = cls(E, H, inter, getattr(experts, "act_fn", None), has_gate=layout["has_gate"],
                          has_bias=layout["has_bias"],
                          is_transposed=layout["is_transposed"])
        grouped.is_concatenated = layout["is_concatenated"]
        for name in list(grouped._parameters):  # theirs, in their order (state dicts and inits keep it)
            del grouped._parameters[name]
        for name, param in experts._parameters.items():
            grouped.register_parameter(name, param)
        assert grouped.first_proj is first
        if layout["has_post_expert_norm"]:
            grouped.has_post_expert_norm = True
            grouped.post_expert_norm = experts.post_expert_norm
        grouped.gate_fn = getattr(type(experts), "_apply_gate", None)
        grouped.train(experts.training)
        if getattr(experts, "swiglu_limit", None) is not None:  # (HY-V4's and MiniMax-M3's name for theirs)
            grouped.swiglu_limit = experts.swiglu_limit
        # what its `_apply_gate` reads (limit, alpha, ...); a GroupedExperts' own attributes are its
        # layout, set above, and its recipe, which the new module does not share
        extras = {} if isinstance(experts, GroupedExperts) else vars(experts)
        for name, value in extras.items():
            if name.startswith("_") or name == "training":  # (nn.Module's own; train() sets it)
                continue
            if not hasattr(grouped, name):
                setattr(grouped, name, value)
            elif not _same(getattr(grouped, name), value):  # (ours would shadow a value its gate reads)
                raise ShapeError(f"{type(experts).__name__} cannot run as GroupedExperts: its {name} "
                                 f"({value!r}) is not GroupedExperts' ({getattr(grouped, name)!r})")
        return grouped

    @property
    def first_proj(self) -> nn.Parameter:
        """gate_up_proj (gate and up rows), or up_proj where the experts have no gate."""
        return getattr(self, first_proj_name(self.has_gate))

    @property
    def first_proj_bias(self) -> nn.Parameter:
        return getattr(self, f"{first_proj_name(self.has_gate)}_bias")

    @property
    def default_layout(self) -> bool:
        """gate_up_proj [E, 2I, H] and down_proj [E, H, I], no biases, no post-expert norm: what the
        MXFP8 recipe and MegaMoE's stages run (any activation)."""
        return self.has_gate and not (self.has_bias or self.is_transposed or self.has_post_expert_norm)

    def activate(self, first: torch.Tensor) -> torch.Tensor:
        """The activation of the first product's rows: [M, 2I] -> [M, I] (or the activation alone
        without a gate): the replaced module's `_apply_gate`, else SwiGLU (clamped at swiglu_limit)."""
        if not self.has_gate:
            return self.act_fn(first)
        if self.gate_fn is not None:
            return self.gate_fn(self, first)
        return gated(first, self.act_fn, self.swiglu_limit)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # Same calls in the same order as the HF families' _init_weights, so one seed gives the same
        # weights with and without the swap.
        nn.init.normal_(self.first_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)
        if self.has_bias:
            nn.init.zeros_(self.first_proj_bias)
            nn.init.zeros_(self.down_proj_bias)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, offsets: torch.Tensor | None = None,
                quantized: MXTensor | None = None, pipeline=None) -> torch.Tensor:
        asked = self.transformers_implementation()
        if asked is not None:
            if pipeline is not None or offsets is not None or self.dispatcher is not None:
                raise ConfigError(f"experts implementation {asked!r} (set_experts_implementation): transformers' "
                                  f"{asked} runs all of a layer's experts on one rank, and expert parallelism splits "
                                  f"them; ours runs them as grouped products: set_experts_implementation"
                                  f"({EXPERTS_IMPLEMENTATION!r})")
            # transformers' own implementation, on these same Parameters (the class this stands in for)
            return super().forward(hidden_states, top_k_index, top_k_weights)
        if pipeline is not None:  # MegaMoE's graphs, run as this module's forward so that its hooks run
            return pipeline(self)
        if offsets is not None:
            return self.run_sorted(hidden_states, offsets, quantized)
        return self.routed(hidden_states, top_k_index, top_k_weights)

    def routed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
               ) -> torch.Tensor:
        """The experts' output for routed tokens: here, or through the expert-parallel dispatcher."""
        self._record(top_k_index)
        if self.dispatcher is not None:  # (already inside this module's hooks: the dispatcher runs the products)
            return self.dispatcher(self, hidden_states, top_k_index, top_k_weights, inside=True)
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
            # every step. Pad rows are never read back.
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

    def _record(self, top_k_index: torch.Tensor) -> None:
        """Each expert's (token, slot) pairs of this micro-batch's first forward (a recompute
        records nothing: see moe.router's [Note: recording under recompute])."""
        if not (self.recording and self.training and torch.is_grad_enabled()) or self.last_counts is not None:
            return
        flat = top_k_index.reshape(-1).detach()
        self.last_counts = torch.zeros(self.routed_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))

    def clear_record(self) -> None:
        self.last_counts = None

    def transformers_implementation(self) -> str | None:
        """The experts implementation transformers' config asks for (`set_experts_implementation`,
        or `experts_implementation=` at load) when this module stands in for transformers' experts
        (models/standins.py), which transformers' experts interface then runs on these Parameters;
        None where ours runs: not standing in, or EXPERTS_IMPLEMENTATION (ours: its grouped products,
        high precision or MXFP8). Raises a ConfigError for another under an MXFP8 recipe, naming what
        ours does instead."""
        # (only a stand-in has transformers' class after ours, whose forward super() reaches)
        stands_in = getattr(type(self), "stands_in_for", None) is not None
        asked = getattr(getattr(self, "config", None), "_experts_implementation", None) if stands_in else None
        if asked in (None, EXPERTS_IMPLEMENTATION):
            return None
        if not isinstance(self.recipe, HighPrecision):
            raise ConfigError(f"experts implementation {asked!r} (set_experts_implementation): transformers' {asked} "
                              f"computes in high precision, and these experts run {self.recipe.describe()}; "
                              f"set_experts_implementation({EXPERTS_IMPLEMENTATION!r}) keeps them")
        return asked

    def run_sorted(self, rows: torch.Tensor, offsets: torch.Tensor, quantized: MXTensor | None = None
                   ) -> torch.Tensor:
        """The experts' products (no routing weights) of rows ordered by expert (`offsets`: int32
        cumulative group ends, one per local expert), in the rows' dtype; `quantized`: the rows as
        MX data along the hidden dimension (MXFP8 experts), which `rows` holds the values of."""
        dtype = self.recipe.compute_dtype(rows)
        align = self.recipe.group_alignment(rows.device, dtype)
        if align == 1:
            return self._products(rows.to(dtype), offsets, quantized).to(rows.dtype)
        num_rows = rows.shape[0]
        expert_of_row = _expert_of_row(offsets, num_rows)
        token_of_slot, row_slot, padded = padded_slots(torch.arange(num_rows, device=rows.device), expert_of_row,
                                                       offsets, num_rows, align)
        slots = gather_rows(torch.cat([rows, rows.new_zeros(1, rows.shape[-1])]), token_of_slot).to(dtype)
        if quantized is not None:
            quantized = _padded_mx_rows(quantized, token_of_slot)
        return gather_rows(self._products(slots, padded, quantized), row_slot).to(rows.dtype)

    def _products(self, rows: torch.Tensor, offsets: torch.Tensor, quantized: MXTensor | None) -> torch.Tensor:
        # only MXFP8 recipes take MX rows (moe.dispatch.dispatch_format sends no others any): the
        # rest keep the three-argument products
        if quantized is None:
            return self.recipe.products(self, rows, offsets)
        return self.recipe.products(self, rows, offsets, quantized)

    def layout_description(self) -> str:
        """The transformers layout flags that differ from the default one ("" for the default)."""
        flags = [flag for flag, default in LAYOUT_FLAGS.items() if getattr(self, flag) != default]
        return ", ".join(f"{f}={getattr(self, f)}" for f in flags)

    def extra_repr(self) -> str:
        limit = f", swiglu_limit={self.swiglu_limit}" if self.swiglu_limit is not None else ""
        layout = f", {self.layout_description()}" if self.layout_description() else ""
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}{limit}{layout}, {self.recipe.describe()}")


def _same(ours, theirs) -> bool:
    try:
        return ours is theirs or bool(ours == theirs)
    except (RuntimeError, TypeError, ValueError):  # (tensors of other shapes, say)
        return False

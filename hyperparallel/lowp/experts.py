"""MXGroupedExperts: MoE experts whose grouped matmuls run in MXFP8, forward and backward.

It takes the place of GroupedExperts or a Hugging Face experts module (Qwen3-MoE, DeepSeek-V3)
and registers the same Parameter objects under the same names: gate_up_proj [E, 2I, H] and
down_proj [E, H, I]. Each projection (weight W [E, N, K]) is one autograd Function with three MX
products, every operand blocked along the dimension its product sums over:

    forward  y    = x @ W_g^T      x row-wise (along K)           x  W along K
    dgrad    dx   = dy @ W_g       dy row-wise (along N)          x  W along N
    wgrad    dW_g = dy_g^T @ x_g   dy and x along the tokens of each expert (quantize_grouped)

Groups are the experts' runs of sorted rows; they have any size, zero included, and are never
padded. The activation, the routing-weight product and the index_add back to tokens stay in high
precision under ordinary autograd. Outputs and input grads come back in the input's dtype, weight
grads in the weight's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from hyperparallel import mx
from hyperparallel.errors import ShapeError
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.mx.tensor import MXTensor


@dataclass(frozen=True)
class _Recipe:
    scale_mode: str
    wgrad: str  # "mxfp8" | "high_precision"
    save_input: str  # "columnwise" | "original"
    save_weight_copy: bool  # keep W along N from forward (else re-quantize W in backward)
    backend: str | None


def _quantize_weight(weight: torch.Tensor, r: _Recipe, along_n: bool) -> tuple[MXTensor, MXTensor | None]:
    """W [E, N, K] blocked along K (for forward) and, if asked, along N (for dgrad)."""
    E, N, K = weight.shape
    if along_n and N % mx.BLOCK_SIZE == 0:
        # Blocks along N then never straddle two experts, so blocks along dim 0 of W seen as
        # [E*N, K] are exactly its blocks along N: one pass over W yields both copies.
        row, col = mx.quantize_dual(weight.reshape(E * N, K), scale_mode=r.scale_mode, backend=r.backend)
        along_k = MXTensor(row.data.view(E, N, K), row.scale.view(E, N, -1), 2, r.scale_mode)
        return along_k, MXTensor(col.data.view(E, N, K), col.scale.view(E, N // mx.BLOCK_SIZE, K), 1, r.scale_mode)
    along_k = mx.quantize(weight, 2, scale_mode=r.scale_mode, backend=r.backend)
    return along_k, mx.quantize(weight, 1, scale_mode=r.scale_mode, backend=r.backend) if along_n else None


def _native_wgrad_ok(dy: torch.Tensor, x: torch.Tensor) -> bool:
    # torch._grouped_mm's own limits: one of these dtypes (bf16 only on CUDA, sm80+), 16-byte strides
    if not hasattr(torch, "_grouped_mm") or dy.dtype != x.dtype or x.device.type not in ("cpu", "cuda"):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    dtypes = (torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16, torch.float16)
    return x.dtype in dtypes and all(n * x.element_size() % 16 == 0 for n in (dy.shape[1], x.shape[1]))


def _grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dy [M, N], x [M, K] -> [E, N, K]: dy_g^T @ x_g per group, in the operands' dtype."""
    if _native_wgrad_ok(dy, x):
        return torch._grouped_mm(dy.t(), x, offs=offsets)
    # Fallback: scatter the groups into [E, rows, *] slabs (memory grows with the largest group)
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(len(ends), device=x.device), counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - (ends - counts)[group]
    rows = int(counts.max())
    dy_slabs = dy.new_zeros(len(ends), rows, dy.shape[1]).index_put_((group, slot), dy)
    x_slabs = x.new_zeros(len(ends), rows, x.shape[1]).index_put_((group, slot), x)
    return torch.bmm(dy_slabs.transpose(1, 2), x_slabs)


def _project(ctx, x, weight, offsets, r: _Recipe, grad_enabled: bool, saved: list, keep_input: bool = True):
    """The forward product of one projection; what its backward needs goes onto `saved` and ctx.

    With keep_input=False the caller keeps what the input can be rebuilt from instead."""
    need_dgrad = grad_enabled and ctx.needs_input_grad[0]
    need_wgrad = grad_enabled and ctx.needs_input_grad[1]
    along_k, along_n = _quantize_weight(weight, r, along_n=need_dgrad and r.save_weight_copy)
    w_kn = replace(along_k, data=along_k.data.transpose(1, 2), scale=along_k.scale.transpose(1, 2), axis=1)
    x_rows = mx.quantize(x, 1, scale_mode=r.scale_mode, backend=r.backend)
    y = mx.mx_grouped_mm(x_rows, w_kn, offsets, x.dtype, backend=r.backend)
    ctx.dgrad_from = ctx.wgrad_from = None  # what backward finds in `saved`, in this order
    if need_dgrad:
        ctx.dgrad_from = "mx" if along_n is not None else "weight"
        saved += [along_n.data, along_n.scale] if along_n is not None else [weight]
    if need_wgrad:
        columnwise = r.wgrad == "mxfp8" and r.save_input == "columnwise" and keep_input
        ctx.wgrad_from = "mx" if columnwise else ("input" if keep_input else "rebuilt")
        if columnwise:
            x_cols = mx.quantize_grouped(x, offsets, scale_mode=r.scale_mode, backend=r.backend)
            saved += [x_cols.data, x_cols.scale]
        elif keep_input:
            saved.append(x)
    ctx.recipe, ctx.x_dtype, ctx.w_dtype = r, x.dtype, weight.dtype
    return y


def _project_backward(ctx, dy, offsets, saved: list, x=None):
    """dx, dW of one projection from what `_project` saved (`x`: the rebuilt input, if asked)."""
    r = ctx.recipe
    dy = dy.contiguous()  # .sum() hands in an expanded gradient
    dx = dw = None
    if ctx.dgrad_from is not None:
        if ctx.dgrad_from == "mx":
            w_n, saved = MXTensor(saved[0], saved[1], 1, r.scale_mode), saved[2:]
        else:
            w_n, saved = mx.quantize(saved[0], 1, scale_mode=r.scale_mode, backend=r.backend), saved[1:]
        dy_rows = mx.quantize(dy, 1, scale_mode=r.scale_mode, backend=r.backend)
        dx = mx.mx_grouped_mm(dy_rows, w_n, offsets, ctx.x_dtype, backend=r.backend)
    if ctx.wgrad_from is not None:
        x_in = x if ctx.wgrad_from == "rebuilt" else (saved[0] if ctx.wgrad_from == "input" else None)
        if r.wgrad == "mxfp8":
            if ctx.wgrad_from == "mx":
                x_cols = MXTensor(saved[0], saved[1], 0, r.scale_mode, group_offsets=offsets)
            else:
                x_cols = mx.quantize_grouped(x_in, offsets, scale_mode=r.scale_mode, backend=r.backend)
            dy_cols = mx.quantize_grouped(dy, offsets, scale_mode=r.scale_mode, backend=r.backend)
            dw = mx.mx_grouped_mm(dy_cols.t(), x_cols, offsets, ctx.w_dtype, backend=r.backend)
        else:
            dw = _grouped_wgrad(dy, x_in, offsets).to(ctx.w_dtype)
    return dx, dw


class _MXGroupedLinear(torch.autograd.Function):
    """x [M, K] (rows sorted by expert, `offsets` their cumulative ends) x W [E, N, K] -> [M, N]."""

    @staticmethod
    def forward(ctx, x, weight, offsets, r: _Recipe, grad_enabled: bool):
        # Function.forward always runs without grad; `grad_enabled` says whether a graph is built,
        # so that inference makes no copies for backward.
        saved = [offsets]
        y = _project(ctx, x, weight, offsets, r, grad_enabled, saved)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        offsets, *saved = ctx.saved_tensors  # unpacked once: checkpointing allows no more
        dx, dw = _project_backward(ctx, dy, offsets, saved)
        return dx, dw, None, None, None


def _gated(gate_up: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


class _MXGatedDown(torch.autograd.Function):
    """act_fn(gate) * up, then the down projection, keeping only gate_up for backward.

    Left to autograd, the activation would keep gate, act_fn(gate) and up (three [M, I] tensors
    in high precision) and the down projection its input's MX copy; all of it is rebuilt from
    gate_up ([M, 2I]) in backward by element-wise work, in the same order, to the same bits."""

    @staticmethod
    def forward(ctx, gate_up, weight, offsets, act_fn, r: _Recipe, grad_enabled: bool):
        act = _gated(gate_up, act_fn)
        saved = [offsets]
        y = _project(ctx, act, weight, offsets, r, grad_enabled, saved, keep_input=False)
        ctx.act_fn = act_fn
        ctx.save_for_backward(*saved, gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        offsets, *saved, gate_up = ctx.saved_tensors  # unpacked once: checkpointing allows no more
        with torch.enable_grad():
            gu = gate_up.detach().requires_grad_(ctx.needs_input_grad[0])
            act = _gated(gu, ctx.act_fn)
        d_act, dw = _project_backward(ctx, dy, offsets, saved, x=act.detach())
        d_gate_up = torch.autograd.grad(act, gu, d_act)[0] if ctx.needs_input_grad[0] else None
        return d_gate_up, dw, None, None, None, None


class _AddRowsToTokens(torch.autograd.Function):
    """Sum rows into their tokens; unlike index_add, backward keeps only the index."""

    @staticmethod
    def forward(ctx, rows, token_of_row, num_tokens: int):
        ctx.save_for_backward(token_of_row)
        return rows.new_zeros(num_tokens, rows.shape[-1]).index_add_(0, token_of_row, rows)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None


def _sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The same stable order and int32 offsets as models.grouped_experts.sort_by_expert, which
    # lowp cannot import (models sits above lowp).
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync; out-of-range ids raise
    return order, torch.cumsum(counts, 0).to(torch.int32)


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why `experts` cannot become an MXGroupedExperts, or None when it can."""
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


class MXGroupedExperts(nn.Module):
    """MoE experts in MXFP8 with GroupedExperts' parameters, forward signature and semantics.

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]: the sum over
    slots of w * down(act(gate(x)) * up(x)); the routing-weight product is taken in the weights'
    dtype (float32 routers promote) and cast to the hidden dtype before tokens are summed.
    The weights are quantized anew at every forward (one pass per weight): a cache keyed on the
    weight's version would go stale when a sharded-data-parallel all-gather rewrites the weight
    without bumping it, and would pin full copies of the largest weights for the whole step.
    """

    def __init__(
        self,
        gate_up_proj: nn.Parameter,
        down_proj: nn.Parameter,
        act_fn: nn.Module,
        config: LowPrecisionConfig,
        *,
        save_weight_copy: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        self.num_experts, two_i, self.hidden_dim = gate_up_proj.shape
        self.intermediate_dim = two_i // 2
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.config = config
        self.save_weight_copy = save_weight_copy
        self.backend = backend

    @classmethod
    def from_experts(
        cls,
        experts: nn.Module,
        config: LowPrecisionConfig,
        *,
        save_weight_copy: bool = True,
        backend: str | None = None,
    ) -> MXGroupedExperts:
        """Adopt the Parameter objects and act_fn of GroupedExperts or an HF experts module.

        `save_weight_copy=False` keeps no MX copy of the weights from forward to backward and
        re-quantizes them there instead (one more pass per weight; less memory held across the
        step, which matters when the weights are gathered per layer). `backend` forces an MX
        backend (see hyperparallel.mx.backends); None picks the device's default.
        """
        reason = unsupported_reason(experts)
        if reason:
            raise ShapeError(f"{type(experts).__name__} cannot run as MXGroupedExperts: {reason}")
        return cls(
            experts.gate_up_proj,
            experts.down_proj,
            experts.act_fn,
            config,
            save_weight_copy=save_weight_copy,
            backend=backend,
        )

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # GroupedExperts' draws in GroupedExperts' order: a seed gives the same weights either way
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        if hidden_states.dim() != 2 or hidden_states.shape[0] != num_tokens:
            raise ShapeError(
                f"hidden_states must be [tokens, hidden] with {num_tokens} tokens (top_k_index is "
                f"{tuple(top_k_index.shape)}), got {tuple(hidden_states.shape)}"
            )
        c = self.config
        recipe = _Recipe(c.scale_mode, c.wgrad, c.save_input, self.save_weight_copy, self.backend)
        grad_enabled = torch.is_grad_enabled()
        order, offsets = _sort_by_expert(top_k_index, self.gate_up_proj.shape[0])
        token_of_row = order // top_k

        rows = hidden_states[token_of_row]
        gate_up = _MXGroupedLinear.apply(rows, self.gate_up_proj, offsets, recipe, grad_enabled)
        rows = _MXGatedDown.apply(gate_up, self.down_proj, offsets, self.act_fn, recipe, grad_enabled)
        rows = (rows * top_k_weights.reshape(-1)[order].unsqueeze(-1)).to(hidden_states.dtype)
        return _AddRowsToTokens.apply(rows, token_of_row, num_tokens)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"mxfp8 {c.scale_mode}, wgrad={c.wgrad}, save_input={c.save_input}"
        )

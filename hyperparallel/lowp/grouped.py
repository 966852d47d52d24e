"""MXExpertsRecipe: the grouped products of MoE experts in MXFP8, forward and backward.

`hyperparallel.moe.GroupedExperts` runs its two projections (gate_up_proj [E, 2I, H], down_proj
[E, H, I]) through its recipe; `lowp.convert` sets this one. Each projection (weight W [E, N, K])
is one autograd Function with three MX products, every operand blocked along the dimension its
product sums over:

    forward  y    = x @ W_g^T      x row-wise (along K)           x  W along K
    dgrad    dx   = dy @ W_g       dy row-wise (along N)          x  W along N
    wgrad    dW_g = dy_g^T @ x_g   dy and x along the tokens of each expert (quantize_grouped)

Groups are the experts' runs of sorted rows, of any size, zero included (zero rows padding a
group to an aligned size change no block: blocks restart at each group). The activation stays in
high precision; the down projection keeps only gate_up for backward and rebuilds the activation
there. Every product runs in the rows' dtype (the compute dtype: autocast's when on), on MX
operands dequantized to it (docs/mx.md); outputs and input grads come back in it, weight grads in
the weight's. Nothing is read back to the host.

Received MX rows: under expert parallelism the rows may arrive already quantized along K
(`moe.dispatch: mx`, hyperparallel.moe.exchange's [Note: MX dispatch]): the first projection then
takes them as its forward operand instead of quantizing x again (`quantized=`), bit for bit what
it would have made of them, and x (their values) serves the input's way back and the weight
gradient.

Weight copies: W's two MX copies (along K for forward, along N for dgrad) are made once per
weight version (`hyperparallel.versions.key`) and reused across micro-batches, backward and
recompute, as MXLinear's are. With save_weight_copy=False nothing is kept: forward quantizes W
along K, and backward quantizes it along N again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from torch import nn

from hyperparallel import mx, versions
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.dtypes import compute_dtype
from hyperparallel.lowp.gather import MXWeightGather, check_has_values
from hyperparallel.mx.grouped_products import grouped_weight_grad_mm
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


def _quantize_rows(x: torch.Tensor, r: _Recipe) -> MXTensor:
    """x [M, K] blocked along K: the forward product's operand."""
    return mx.quantize(x, 1, scale_mode=r.scale_mode, backend=r.backend)


def _project(ctx, x, weight, copies, offsets, r: _Recipe, grad_enabled: bool, saved: list,
             keep_input: bool = True, quantized: MXTensor | None = None):
    """The forward product of one projection; what its backward needs goes onto `saved` and ctx.

    `copies`: W's (along K, along N) MX copies; along N None (backward quantizes the weight) or a
    function that gives it in backward (FSDP gathers it then: MXWeightGather). With keep_input=False the caller keeps
    what the input can be rebuilt from instead. `quantized`: x's rows along K, made already (the
    MX rows an MX dispatch delivered; x holds their values)."""
    need_dgrad = grad_enabled and ctx.needs_input_grad[0]
    need_wgrad = grad_enabled and ctx.needs_input_grad[1]
    along_k, along_n = copies
    w_kn = replace(along_k, data=along_k.data.transpose(1, 2), scale=along_k.scale.transpose(1, 2), axis=1)
    x_rows = quantized if quantized is not None else _quantize_rows(x, r)
    y = mx.mx_grouped_mm(x_rows, w_kn, offsets, x.dtype, backend=r.backend)
    ctx.dgrad_from = ctx.wgrad_from = None  # what backward finds in `saved`, in this order
    if need_dgrad:
        if callable(along_n):
            ctx.dgrad_from, ctx.along_n = "later", along_n
        else:
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
    dy = dy.contiguous()  # .sum() hands in an expanded gradient
    dx, saved = _project_dgrad(ctx, dy, offsets, saved)
    return dx, _project_wgrad(ctx, dy, offsets, saved, x)


def _project_dgrad(ctx, dy, offsets, saved: list):
    """dx of one projection (None if not needed), and what of `saved` the weight gradient uses."""
    r = ctx.recipe
    if ctx.dgrad_from is None:
        return None, saved
    if ctx.dgrad_from == "later":
        w_n = ctx.along_n()
    elif ctx.dgrad_from == "mx":
        w_n, saved = MXTensor(saved[0], saved[1], 1, r.scale_mode), saved[2:]
    else:
        w_n, saved = mx.quantize(saved[0], 1, scale_mode=r.scale_mode, backend=r.backend), saved[1:]
    dy_rows = mx.quantize(dy, 1, scale_mode=r.scale_mode, backend=r.backend)
    return mx.mx_grouped_mm(dy_rows, w_n, offsets, ctx.x_dtype, backend=r.backend), saved


def _project_wgrad(ctx, dy, offsets, saved: list, x=None):
    """dW of one projection (None if not needed) from the rest of what `_project` saved."""
    r = ctx.recipe
    if ctx.wgrad_from is None:
        return None
    x_in = x if ctx.wgrad_from == "rebuilt" else (saved[0] if ctx.wgrad_from == "input" else None)
    if r.wgrad == "mxfp8":
        if ctx.wgrad_from == "mx":
            x_cols = MXTensor(saved[0], saved[1], 0, r.scale_mode, group_offsets=offsets)
        else:
            x_cols = mx.quantize_grouped(x_in, offsets, scale_mode=r.scale_mode, backend=r.backend)
        dy_cols = mx.quantize_grouped(dy, offsets, scale_mode=r.scale_mode, backend=r.backend)
        # in the compute dtype (the rows'), as every product here; then into the weight's dtype
        return mx.mx_grouped_mm(dy_cols.t(), x_cols, offsets, ctx.x_dtype, backend=r.backend).to(ctx.w_dtype)
    return grouped_weight_grad_mm(dy.t(), x_in, offsets).to(ctx.w_dtype)  # [E, N, K]


class _MXGroupedLinear(torch.autograd.Function):
    """x [M, K] (rows sorted by expert, `offsets` their cumulative ends) x W [E, N, K] -> [M, N]
    (`quantized`: x's rows along K where they arrived quantized)."""

    @staticmethod
    def forward(ctx, x, weight, copies, offsets, r: _Recipe, grad_enabled: bool, quantized: MXTensor | None = None):
        # Function.forward always runs without grad; `grad_enabled` says whether a graph is built,
        # so that inference makes no copies for backward.
        saved = [offsets]
        y = _project(ctx, x, weight, copies, offsets, r, grad_enabled, saved, quantized=quantized)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        offsets, *saved = ctx.saved_tensors  # unpacked once: checkpointing allows no more
        dx, dw = _project_backward(ctx, dy, offsets, saved)
        return dx, dw, None, None, None, None, None


def gated(gate_up: torch.Tensor, act_fn: nn.Module, limit: float | None = None) -> torch.Tensor:
    """The experts' SwiGLU: act_fn(gate) * up of gate_up [M, 2I] (gate columns, then up). With a
    `limit` (a clamped SwiGLU), gate is clamped above at it and up to [-limit, limit] first, as
    transformers' DeepseekV4Experts does."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act_fn(gate) * up


def activation_grad(gate_up: torch.Tensor, activate, d_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate_up, act) from gate_up: the experts' activation (`activate`: [M, 2I] -> [M, I], the
    experts module's own) rebuilt and differentiated by autograd, with the element-wise operations
    autograd runs on the experts' forward."""
    with torch.enable_grad():
        gate_up = gate_up.detach().requires_grad_()
        act = activate(gate_up)
    return torch.autograd.grad(act, gate_up, d_act)[0], act.detach()


class _MXGatedDown(torch.autograd.Function):
    """The experts' activation (SwiGLU, or whatever the module's own is), then the down projection,
    keeping only gate_up for backward.

    Left to autograd, the activation would keep gate, act_fn(gate) and up (three [M, I] tensors
    in high precision) and the down projection its input's MX copy; all of it is rebuilt from
    gate_up ([M, 2I]) in backward by element-wise work, in the same order, to the same bits."""

    @staticmethod
    def forward(ctx, gate_up, weight, copies, offsets, activate, r: _Recipe, grad_enabled: bool):
        act = activate(gate_up)
        saved = [offsets]
        y = _project(ctx, act, weight, copies, offsets, r, grad_enabled, saved, keep_input=False)
        ctx.activate = activate
        ctx.save_for_backward(*saved, gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        offsets, *saved, gate_up = ctx.saved_tensors  # unpacked once: checkpointing allows no more
        with torch.enable_grad():
            gu = gate_up.detach().requires_grad_(ctx.needs_input_grad[0])
            act = ctx.activate(gu)
        d_act, dw = _project_backward(ctx, dy, offsets, saved, x=act.detach())
        d_gate_up = torch.autograd.grad(act, gu, d_act)[0] if ctx.needs_input_grad[0] else None
        return d_gate_up, dw, None, None, None, None, None


class MXExpertsRecipe:
    """The recipe `GroupedExperts` runs its products with under MXFP8 (set by lowp.convert).

    `save_weight_copy=False` keeps no MX copy of the weights (see the module docstring): one more
    pass per weight in backward, less memory held across the step. `backend` forces an MX
    backend (see hyperparallel.mx.backends); None picks the device's default.
    """

    def __init__(self, config: LowPrecisionConfig, *, save_weight_copy: bool = True, backend: str | None = None):
        self.config = config
        self.save_weight_copy = save_weight_copy
        self.backend = backend
        self._copies: dict[str, tuple[tuple, MXTensor, MXTensor | None]] = {}  # projection -> (key, along K, along N)
        # each weight's MX copies when FSDP gathers them as MX data (parallel attaches these: lowp/gather.py)
        self.gathered = {name: MXWeightGather(config.scale_mode) for name in ("gate_up_proj", "down_proj")}

    def _recipe(self) -> _Recipe:
        c = self.config
        return _Recipe(c.scale_mode, c.wgrad, c.save_input, self.save_weight_copy, self.backend)

    def group_alignment(self, device: torch.device, dtype: torch.dtype) -> int:
        # The emulated products run on dequantized operands in bf16 where that is exact, through
        # the same oneDNN kernels per shape as high-precision bf16 ones: the same padding pays.
        return 32 if device.type == "cpu" else 1

    def compute_dtype(self, hidden_states: torch.Tensor) -> torch.dtype:
        # the rows come in it (autocast's, when on), so every product dequantizes its MX operands
        # to it: bf16 products for a bf16 model or under bf16 autocast
        return compute_dtype(hidden_states)

    def weight_copies(self, name: str, weight: torch.Tensor, need_along_n: bool):
        """W's MX copies (along K, along N): FSDP's gathered ones (along N as a function that
        gives it in backward, where it is gathered: always, so that a recompute's forward saves
        what the first one saved), or quantized from the weight."""
        gathered = self.gathered[name]
        if "forward" in gathered.copies:
            return gathered.copies["forward"], lambda: gathered.copies["backward"]
        check_has_values(weight, f"MXFP8 experts' {name}")
        r = self._recipe()
        if not self.save_weight_copy:
            return _quantize_weight(weight.detach(), r, along_n=False)
        if torch.compiler.is_compiling():  # a traced graph quantizes anew; no Python-side cache
            return _quantize_weight(weight.detach(), r, along_n=need_along_n)
        versions.watch_optimizers()
        key = (versions.key(weight), r.scale_mode, r.backend)
        cached = self._copies.get(name)
        if cached is None or cached[0] != key:
            cached = (key, *_quantize_weight(weight.detach(), r, along_n=True))
            self._copies[name] = cached
        return cached[1], cached[2]

    def quantize_rows(self, rows: torch.Tensor) -> MXTensor:
        """`rows` [M, K] (in the compute dtype) blocked along K, as the first projection quantizes
        its input: what an MX dispatch sends (hyperparallel.moe.exchange)."""
        return _quantize_rows(rows, self._recipe())

    def products(self, experts: nn.Module, rows: torch.Tensor, offsets: torch.Tensor,
                 quantized: MXTensor | None = None) -> torch.Tensor:
        """The two projections of `rows` sorted by expert; `quantized`: the rows along K, where an MX
        dispatch delivered them so (`rows` then holds their values)."""
        r = self._recipe()
        grad_enabled = torch.is_grad_enabled()
        gate_up_w, down_w = experts.gate_up_proj, experts.down_proj  # (convert admits the gated layout only)
        gate_up = _MXGroupedLinear.apply(rows, gate_up_w, self.weight_copies("gate_up_proj", gate_up_w, grad_enabled),
                                         offsets, r, grad_enabled, quantized)
        return _MXGatedDown.apply(gate_up, down_w, self.weight_copies("down_proj", down_w, grad_enabled), offsets,
                                  experts.activate, r, grad_enabled)

    def stages(self, experts: nn.Module, *, needs_grad: bool = True) -> MXExpertStages:
        return MXExpertStages(self, experts, needs_grad=needs_grad)

    def describe(self) -> str:
        c = self.config
        return f"mxfp8 {c.scale_mode}, wgrad={c.wgrad}, save_input={c.save_input}"


def _expert_slice(t, lo: int, hi: int):
    """Experts lo..hi of an MX copy (or of what a function gives later: a gathered copy)."""
    if callable(t):
        return lambda: _expert_slice(t(), lo, hi)
    return None if t is None else replace(t, data=t.data[lo:hi], scale=t.scale[lo:hi])


class MXExpertStages:
    """The MXFP8 experts in the three stages of `hyperparallel.moe.stages` (its docstring has the
    interface): the products, quantizations and saved operands of `_MXGroupedLinear` and
    `_MXGatedDown`, with dgrad and wgrad run apart. The weights' MX copies are taken once per
    forward (from the recipe's per-version cache) and sliced by expert."""

    def __init__(self, recipe: MXExpertsRecipe, experts: nn.Module, *, needs_grad: bool = True):
        self.experts, self.r, self.needs_grad = experts, recipe._recipe(), needs_grad
        self.copies = {name: recipe.weight_copies(name, getattr(experts, name), needs_grad)
                       for name in ("gate_up_proj", "down_proj")}

    def _project(self, name, x, offsets, lo, hi, keep_input=True, quantized=None):
        ctx = SimpleNamespace(needs_input_grad=(True, True))
        weight = getattr(self.experts, name)[lo:hi]
        copies = tuple(_expert_slice(c, lo, hi) for c in self.copies[name])
        saved: list = []  # (nothing for backward without grad: no copy made for it)
        y = _project(ctx, x, weight, copies, offsets, self.r, self.needs_grad, saved, keep_input=keep_input,
                     quantized=quantized)
        return y, ctx, saved

    def forward(self, x, offsets, lo, hi, quantized=None):
        gate_up, up_ctx, up_saved = self._project("gate_up_proj", x, offsets, lo, hi, quantized=quantized)
        act = self.experts.activate(gate_up)
        y, down_ctx, down_saved = self._project("down_proj", act, offsets, lo, hi,
                                                keep_input=False)
        return y, (up_saved + down_saved + [gate_up], (up_ctx, down_ctx, len(up_saved)))

    def input_grad(self, saved, dy, offsets, lo, hi):
        tensors, (up_ctx, down_ctx, n_up) = saved
        up_saved, down_saved, gate_up = tensors[:n_up], tensors[n_up:-1], tensors[-1]
        dy = dy.contiguous()
        d_act, down_rest = _project_dgrad(down_ctx, dy, offsets, down_saved)
        d_gate_up, act = activation_grad(gate_up, self.experts.activate, d_act)
        dx, up_rest = _project_dgrad(up_ctx, d_gate_up, offsets, up_saved)
        return dx, (up_ctx, up_rest, d_gate_up, down_ctx, down_rest, dy, act)

    def weight_grad(self, for_wgrad, offsets):
        up_ctx, up_rest, d_gate_up, down_ctx, down_rest, dy, act = for_wgrad
        return (_project_wgrad(up_ctx, d_gate_up, offsets, up_rest),
                _project_wgrad(down_ctx, dy, offsets, down_rest, x=act))

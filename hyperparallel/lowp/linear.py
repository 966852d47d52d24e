"""MXLinear: nn.Linear whose three products (forward, input grad, weight grad) run in MXFP8.

    forward   Y  = X  @ W^T    X row-wise (blocks along K)  x  W row-wise (along K)
    dgrad     dX = dY @ W      dY row-wise (along N)         x  W column-wise (along N)
    wgrad     dW = dY^T @ X    dY column-wise (along M)      x  X column-wise (along M)

Every operand is blocked along the dimension its product sums over, as the MX formats need.
X's row and column copies come from one `quantize_dual` pass, as do dY's. Forward keeps for
backward only X's column-wise copy (when the weight needs a gradient) and W's column-wise copy.
W's two copies are made once per weight version (`hyperparallel.versions.key`: its `_version`
and its generation, which optimizer steps and FSDP gathers of new values bump) and reused across
micro-batches and recompute; or, under FSDP, gathered as MX data (`self.gathered`, lowp/gather.py):
the row-wise copy for forward, the column-wise one when backward gathers the weight again.
Every product runs in the compute dtype (`lowp.dtypes.compute_dtype`: torch.autocast's when it is
on, else the input's), on operands dequantized to it (docs/mx.md: exact, but for two corners):
bf16 products for a bf16 model or under bf16 autocast, as nn.Linear's. The output comes back in
the compute dtype (nn.Linear's under autocast), the input grad in the input's dtype, the weight
grad in the weight's; the bias, in the compute dtype, joins the product's fp32 accumulator, as in
nn.Linear's addmm. Nothing is read back to the host.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel import mx, versions
from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.dtypes import compute_dtype
from hyperparallel.lowp.gather import MXWeightGather, check_has_values
from hyperparallel.mx.tensor import MXTensor


def _mx(data: torch.Tensor, scale: torch.Tensor, axis: int, mode: str) -> MXTensor:
    return MXTensor(data, scale, axis, mode)


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w_row_data, w_row_scale, w_col_data, w_col_scale, gathered, mode, wgrad,
                save_input, dtype):
        needs_wgrad = ctx.needs_input_grad[1]
        keep_columnwise = needs_wgrad and wgrad == "mxfp8" and save_input == "columnwise"
        if keep_columnwise:
            x_row, x_col = mx.quantize_dual(x, scale_mode=mode)
        else:
            x_row = mx.quantize(x, axis=1, scale_mode=mode)
        w_row = _mx(w_row_data, w_row_scale, 1, mode)
        y = mx.mx_mm(x_row, w_row.t(), out_dtype=dtype, bias=bias)
        saved_input = (x_col.data, x_col.scale) if keep_columnwise else ((x, x) if needs_wgrad else (None, None))
        ctx.save_for_backward(w_col_data, w_col_scale, *saved_input)
        # without a column-wise copy here, FSDP gathers it for backward (MXWeightGather)
        ctx.gathered = gathered if w_col_data is None else None
        ctx.keep_columnwise, ctx.mode, ctx.wgrad = keep_columnwise, mode, wgrad
        ctx.x_dtype, ctx.w_dtype, ctx.dtype, ctx.has_bias = x.dtype, weight.dtype, dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        w_col_data, w_col_scale, saved_a, saved_b = ctx.saved_tensors  # unpack once (recompute allows no more)
        mode = ctx.mode
        dy = dy.contiguous().to(ctx.dtype)
        needs_dgrad, needs_wgrad, needs_dbias = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        mx_wgrad = needs_wgrad and ctx.wgrad == "mxfp8"
        if mx_wgrad:
            dy_row, dy_col = mx.quantize_dual(dy, scale_mode=mode)
        elif needs_dgrad:
            dy_row = mx.quantize(dy, axis=1, scale_mode=mode)
        dx = dw = dbias = None
        if needs_dgrad:
            w_col = ctx.gathered.copies["backward"] if ctx.gathered is not None else _mx(w_col_data, w_col_scale, 0, mode)
            dx = mx.mx_mm(dy_row, w_col, out_dtype=ctx.dtype).to(ctx.x_dtype)
        if mx_wgrad:
            if ctx.keep_columnwise:
                x_col = _mx(saved_a, saved_b, 0, mode)
            else:
                x_col = mx.quantize(saved_a, axis=0, scale_mode=mode)
            dw = mx.mx_mm(dy_col.t(), x_col, out_dtype=ctx.dtype).to(ctx.w_dtype)
        elif needs_wgrad:  # wgrad: high_precision, in the compute dtype
            dw = (dy.t() @ saved_a.to(ctx.dtype)).to(ctx.w_dtype)
        if needs_dbias and ctx.has_bias:
            dbias = dy.float().sum(0).to(ctx.w_dtype)
        return dx, dw, dbias, None, None, None, None, None, None, None, None, None


class MXLinear(nn.Module):
    """An nn.Linear in MXFP8; `from_linear` adopts the Linear's own Parameter objects."""

    def __init__(self, in_features: int, out_features: int, config: LowPrecisionConfig):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.config = config
        self.weight: nn.Parameter
        self.bias: nn.Parameter | None
        self._weight_copies: tuple | None = None  # (version, data_ptr, row data, row scale, col data, col scale)
        # the weight's MX copies when FSDP gathers them as MX data (fsdp attaches it: lowp/gather.py)
        self.gathered = MXWeightGather(config.scale_mode)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LowPrecisionConfig) -> MXLinear:
        module = cls(linear.in_features, linear.out_features, config)
        module.weight = linear.weight  # the same Parameter objects: state dicts and optimizers see no change
        module.bias = linear.bias
        return module

    def _quantized_weight(self) -> tuple[torch.Tensor | None, ...]:
        """W's row-wise and column-wise MX copies (data, scale, data, scale): FSDP's gathered ones
        (the column-wise then taken in backward, where it is gathered: None here, always, so that a
        recompute's forward saves what the first one saved), or quantized from the weight."""
        row = self.gathered.copies.get("forward")
        if row is not None:
            return row.data, row.scale, None, None
        w = self.weight
        check_has_values(w, f"MXLinear({self.in_features}, {self.out_features})")
        if torch.compiler.is_compiling():  # a traced graph quantizes anew; no Python-side cache
            row, col = mx.quantize_dual(w.detach(), scale_mode=self.config.scale_mode)
            return row.data, row.scale, col.data, col.scale
        versions.watch_optimizers()
        key = versions.key(w)
        if self._weight_copies is None or self._weight_copies[0] != key:
            row, col = mx.quantize_dual(w.detach(), scale_mode=self.config.scale_mode)
            self._weight_copies = (key, row.data, row.scale, col.data, col.scale)
        return self._weight_copies[1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, self.in_features).contiguous()
        c = self.config
        y = _MXLinearFunction.apply(x2d, self.weight, self.bias, *self._quantized_weight(), self.gathered,
                                    c.scale_mode, c.wgrad, c.save_input, compute_dtype(x2d))
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mxfp8 {c.scale_mode}, wgrad={c.wgrad}, save_input={c.save_input}")

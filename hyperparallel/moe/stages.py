"""The experts' SwiGLU MLP as three stages that a scheduler can place apart: forward, input grad
(dgrad) and weight grad (wgrad), each for a contiguous range of the local experts.

autograd computes a layer's input and weight gradients together; MegaMoE wants the input
gradients of a wave first (so their all-to-all leaves early) and the weight gradients later, in
the gaps. Each recipe of `GroupedExperts` provides `stages(experts)` with this interface:

    forward(x, offsets, lo, hi, quantized=None) -> y, saved     (saved: (tensors, meta))
    input_grad(saved, dy, offsets, lo, hi) -> dx, for_wgrad
    weight_grad(for_wgrad, offsets)        -> d_gate_up [hi-lo, 2I, H], d_down [hi-lo, H, I]

`x` is rows sorted by expert over experts lo..hi-1 (`offsets`: their int32 cumulative ends);
`quantized`, the same rows as MX data where they arrived so (an MX dispatch: MXFP8 recipes only).
The stages compute what the recipe's autograd path computes, with the same operations: here
the high-precision one (`HighPrecision`); `hyperparallel.lowp.grouped` has the MXFP8 one.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.lowp.grouped import activation_grad
from hyperparallel.mx.grouped_products import grouped_rows_mm, grouped_weight_grad_mm


class HighPrecisionStages:
    def __init__(self, experts: nn.Module):
        self.experts = experts

    def _weights(self, lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # read at each call: under FSDP the full weights are gathered again for backward
        gate_up, down = self.experts.gate_up_proj[lo:hi].detach(), self.experts.down_proj[lo:hi].detach()
        if gate_up.dtype != dtype:  # under autocast the products run in its dtype
            gate_up, down = gate_up.to(dtype), down.to(dtype)
        return gate_up, down

    def forward(self, x, offsets, lo, hi, quantized=None):
        if quantized is not None:
            raise AssertionError("MX rows reached high-precision experts (moe.dispatch.dispatch_format refuses them)")
        gate_up_w, down_w = self._weights(lo, hi, x.dtype)
        gate_up = grouped_rows_mm(x, gate_up_w.transpose(1, 2), offsets)
        y = grouped_rows_mm(self.experts.activate(gate_up), down_w.transpose(1, 2), offsets)
        return y, ([x, gate_up], None)

    def input_grad(self, saved, dy, offsets, lo, hi):
        (x, gate_up), _ = saved
        gate_up_w, down_w = self._weights(lo, hi, x.dtype)
        dy = dy.contiguous()
        d_act = grouped_rows_mm(dy, down_w, offsets)
        d_gate_up, act = activation_grad(gate_up, self.experts.activate, d_act)
        dx = grouped_rows_mm(d_gate_up, gate_up_w, offsets)
        return dx, (x, d_gate_up, act, dy)

    def weight_grad(self, for_wgrad, offsets):
        x, d_gate_up, act, dy = for_wgrad
        dtype = self.experts.gate_up_proj.dtype
        if x.shape[0] == 0:  # experts that received no rows: zero gradients
            E = offsets.shape[0]
            return (x.new_zeros(E, d_gate_up.shape[1], x.shape[1], dtype=dtype),
                    x.new_zeros(E, dy.shape[1], act.shape[1], dtype=dtype))
        return (grouped_weight_grad_mm(d_gate_up.t(), x, offsets).to(dtype),
                grouped_weight_grad_mm(dy.t(), act, offsets).to(dtype))

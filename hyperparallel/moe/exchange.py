"""The all-to-alls of expert parallelism, and the format token rows travel in to their experts.

Every exchange is one `all_to_all_single`, counted where it is issued (`hyperparallel.traffic`,
mesh dimension "ep", named: "counts", "dispatch", "combine", and the gradients' "dispatch grad"
and "combine grad"), so a run's dispatch bytes can be told from its combine's.

Rows go to the experts in the products' compute dtype (`moe.dispatch: compute`) or as MX data
(`mx`); they always come back in the compute dtype.

[Note: MX dispatch]
The first thing MXFP8 experts do with the rows they receive is quantize them along the hidden
dimension, in blocks of 32 within a row (the forward product's operand, lowp.grouped). A
row-wise quantization commutes with moving rows, so the sending rank quantizes its tokens once
(not each of their top-k copies), gathers the quantized tokens' rows and sends FP8 elements and
E8M0 scales, side by side as the bytes of one row (H + H/32 bytes, against 2H for bf16: 0.52x;
gloo takes no float8 dtypes, and one tensor is one collective). The experts' first product takes
the received MX rows as they are: the forward is bit for bit what the compute-dtype dispatch
computes. Two things still need the rows in the compute dtype, as values: the input gradient's
way back (the reverse exchange of their gradient, in the compute dtype as before, bit for bit
the same) and the first projection's weight gradient, which quantizes its input along the
tokens of each expert. That quantization now starts from the rows' MX values (dequantized: exact
in bf16) instead of the rows themselves: the one numerical difference, which DeepSeek-V3
accepts for its FP8 dispatch too. It is small because E4M3 rounds to 3 mantissa bits whatever
the power-of-two scale: an MX value quantized again along the tokens comes back as the row's
element would, but for elements that one of the two blocks leaves an E4M3 subnormal (more than
~2^13 under the block's largest value, an outlier's neighbours), rounded on a coarser grid
there. docs/moe.md ("MX dispatch") has its measured size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyperparallel import traffic
from hyperparallel.mx.tensor import MXTensor

ELEMENTS = torch.float8_e4m3fn  # MXFP8's elements: what lowp's recipes quantize to (mx.quantize's default)


def exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, name: str) -> torch.Tensor:
    """`rows` split along dim 0 by `send_splits` to the group's ranks; what arrives, by `recv_splits`."""
    # contiguous: all_to_all_single splits the flat storage, and a gradient may arrive expanded
    sent = rows.contiguous()
    received = sent.new_empty(sum(recv_splits), *sent.shape[1:])
    traffic.all_to_all("ep", sent, send_splits, group, name=name)
    dist.all_to_all_single(received, sent, recv_splits, send_splits, group=group)
    return received


class AllToAll(torch.autograd.Function):
    """`exchange` of rows in the compute dtype; backward sends the gradients back (as `name` grad)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, name: str):
        ctx.splits, ctx.group, ctx.name = (send_splits, recv_splits), group, name
        return exchange(rows, send_splits, recv_splits, group, name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        return exchange(grad, recv_splits, send_splits, ctx.group, f"{ctx.name} grad"), None, None, None, None


@dataclass(frozen=True)
class MXRows:
    """One layer call's rows as MX data ([Note: MX dispatch]): the tokens [T, H] of this rank,
    which token each row is (`token_of_row`, in the order the rows are sent) and the experts'
    MXFP8 recipe, whose quantization the rows get."""

    recipe: object  # hyperparallel.lowp.MXExpertsRecipe
    token_of_row: torch.Tensor
    num_tokens: int
    token_dtype: torch.dtype
    dtype: torch.dtype  # the products' compute dtype

    @classmethod
    def of(cls, tokens: torch.Tensor, token_of_row: torch.Tensor, recipe) -> MXRows:
        return cls(recipe, token_of_row, tokens.shape[0], tokens.dtype, recipe.compute_dtype(tokens))

    def packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows to send: uint8 [rows, H + ceil(H/32)], each row's FP8 elements, then its scales."""
        quantized = self.recipe.quantize_rows(tokens.detach().to(self.dtype))
        packed = torch.cat([quantized.data.view(torch.uint8), quantized.scale.view(torch.uint8)], dim=1)
        return packed.index_select(0, self.token_of_row)

    def unpacked(self, received: torch.Tensor, index: torch.Tensor, hidden: int) -> tuple[torch.Tensor, MXTensor]:
        """Received packed rows, taken in `index`'s order: their values in the compute dtype (exact
        but at the corners docs/mx.md names: an MX value has 4 significant bits) and the MX rows."""
        elements, scales = received[:, :hidden], received[:, hidden:]
        quantized = MXTensor(elements.index_select(0, index).view(ELEMENTS),
                             scales.index_select(0, index).view(torch.float8_e8m0fnu), 1, self.recipe.config.scale_mode)
        return quantized.dequantize(self.dtype, backend=self.recipe.backend), quantized

    def tokens_grad(self, rows_grad: torch.Tensor) -> torch.Tensor:
        """The tokens' gradient from their rows': what autograd makes of the compute-dtype
        dispatch's gather and cast (cast, then summed in the tokens' dtype), bit for bit."""
        grad = rows_grad.to(self.token_dtype)
        return grad.new_zeros(self.num_tokens, grad.shape[1]).index_add_(0, self.token_of_row, grad)


def mx_dispatch(tokens: torch.Tensor, rows: MXRows, regroup: torch.Tensor, send_splits: list[int],
                recv_splits: list[int], group) -> tuple[torch.Tensor, MXTensor]:
    """The dispatch of `rows` as MX data: what arrives, in `regroup`'s order, as values in the
    compute dtype (differentiable) and as the MX rows the experts' first product takes."""
    values, elements, scales = _MXDispatch.apply(tokens, rows, regroup, send_splits, recv_splits, group)
    return values, MXTensor(elements, scales, 1, rows.recipe.config.scale_mode)


class _MXDispatch(torch.autograd.Function):
    """tokens [T, H] -> the rows this rank's experts receive, in `regroup`'s order: their values
    (differentiable: backward sends their gradient back in the compute dtype) and their MX data
    (elements, scales), quantized where they were sent ([Note: MX dispatch])."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, rows: MXRows, regroup: torch.Tensor, send_splits: list[int],
                recv_splits: list[int], group):
        received = exchange(rows.packed(tokens), send_splits, recv_splits, group, "dispatch")
        values, quantized = rows.unpacked(received, regroup, tokens.shape[1])
        ctx.rows, ctx.splits, ctx.group, ctx.shape = rows, (send_splits, recv_splits), group, values.shape
        ctx.save_for_backward(regroup)
        ctx.mark_non_differentiable(quantized.data, quantized.scale)
        ctx.set_materialize_grads(False)
        return values, quantized.data, quantized.scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, *_):
        (regroup,) = ctx.saved_tensors
        if grad is None:  # (no gradient reached the values; the exchange is collective all the same)
            grad = torch.zeros(ctx.shape, dtype=ctx.rows.dtype, device=regroup.device)
        send_splits, recv_splits = ctx.splits
        # back into the order the rows arrived in (regroup is a permutation)
        arrived = torch.empty_like(grad).index_copy_(0, regroup, grad)
        rows_grad = exchange(arrived, recv_splits, send_splits, ctx.group, "dispatch grad")
        return ctx.rows.tokens_grad(rows_grad), None, None, None, None, None

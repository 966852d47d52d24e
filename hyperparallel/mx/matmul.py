"""MX matrix products: dequantize each operand to the product's compute dtype, then one library
matmul (oneDNN on the CPU, cuBLAS on a GPU) accumulating in fp32.

The operand dtype follows from the dtypes alone, never from the values: the output dtype when it
is bf16 or fp16 (the compute dtype of a bf16 / fp16 model, or of torch.autocast), fp32 for an fp32
output, fp64 for the ``reference`` backend. So the product reads nothing back to the host, and on
a GPU it runs on the same tensor cores as a bf16 product. See [Note: MX values in the compute
dtype] for why this is exact, and where it is not.

That is the `dequantize` GEMM path, `mx_mm`'s everywhere but on MX tensor cores (SM100+), where
it runs torch._scaled_mm; a Triton kernel that decodes the tiles in registers runs when forced
(`hyperparallel.mx.gemm_path`): the same products, accumulated in another order.
"""

from __future__ import annotations

import torch

from hyperparallel.errors import ShapeError
from hyperparallel.mx import gemm_path
from hyperparallel.mx.backends import triton_mm
from hyperparallel.mx.format import element_format
from hyperparallel.mx.grouped_products import grouped_rows_mm, grouped_weight_grad_mm
from hyperparallel.mx.groups import check_offsets, check_same_offsets
from hyperparallel.mx.tensor import MXTensor

# [Note: MX values in the compute dtype]
# An MX value is an FP8 element (E4M3: 3 mantissa bits; E5M2: 2) times a power of two, so it has
# at most 4 significant bits: bf16 (8) and fp16 (11) hold it exactly whenever its exponent is in
# their range. What `quantize` makes from a tensor of a dtype stays in that dtype's range, except
# at two corners:
# - underflow: elements below the dtype's smallest normal (bf16 2^-126, fp16 2^-14) are its
#   subnormals, exact down to multiples of its smallest subnormal (bf16 2^-133, fp16 2^-24) and
#   rounded to that below. A block is affected only if its largest value is below about 2^-117
#   (bf16) or 2^-7 (fp16, with E4M3 elements spanning 2^17); each affected element moves by at
#   most half that smallest subnormal: the precision the input itself has there. bf16 dot-product
#   units of some CPUs flush subnormals to zero, as they do for a bf16 product of the input.
# - overflow: with `rceil` a value within one FP8 step of the dtype's largest finite value can
#   round up to the next power of two, which is inf in that dtype (bf16 above 2^128 - 2^123,
#   fp16 above 61440). An fp32 output computes in fp32, where every MX value of an E4M3 or E5M2
#   element is exact (E8M0 scales go down to 2^-127: elements down to 2^-143, above fp32's
#   smallest subnormal 2^-149), again except the overflow corner near fp32's largest value.
# The ``reference`` backend computes in fp64, which holds every MX value.
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def operand_dtype(out_dtype: torch.dtype, backend: str | None = None) -> torch.dtype:
    """The dtype an MX product with this output dequantizes its operands to."""
    if backend == "reference":
        return torch.float64
    return out_dtype if out_dtype in _COMPUTE_DTYPES else torch.float32


def _operand(mx: MXTensor, out_dtype: torch.dtype, backend: str | None) -> torch.Tensor:
    return mx.dequantize(operand_dtype(out_dtype, backend), backend=backend)


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    # the bias (rounded to the operand dtype, as nn.Linear's bias is in a bf16 model) joins the
    # fp32 accumulator before the one rounding of the output, as in nn.Linear's addmm
    y = torch.mm(a, b) if bias is None else torch.addmm(bias.to(a.dtype), a, b)
    return y.to(out_dtype)


def _require(mx, name, ndim, axis):
    if not isinstance(mx, MXTensor):
        raise ShapeError(f"{name} must be an MXTensor (use hyperparallel.mx.quantize), got {type(mx).__name__}")
    element_format(mx.elem_dtype)
    if mx.data.dim() != ndim:
        raise ShapeError(f"{name} must be {ndim}-D, got shape {tuple(mx.shape)}")
    if mx.axis != axis:
        raise ShapeError(
            f"{name} is blocked along axis {mx.axis}, but this product contracts its axis {axis}: "
            f"quantize it with axis={axis}"
        )


def mx_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.bfloat16, *, bias: torch.Tensor | None = None,
          backend: str | None = None) -> torch.Tensor:
    """a [M, K] (blocked along K, axis 1) @ b [K, N] (blocked along K, axis 0) (+ bias [N]) -> [M, N],
    computed in `operand_dtype(out_dtype)`."""
    _require(a, "a", 2, 1)
    _require(b, "b", 2, 0)
    if a.shape[1] != b.shape[0]:
        raise ShapeError(f"mx_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a.shape[1] must equal b.shape[0]")
    if a.group_offsets is not None or b.group_offsets is not None:
        raise ShapeError("mx_mm takes ungrouped operands; use mx_grouped_mm for grouped ones")
    if bias is not None and tuple(bias.shape) != (b.shape[1],):
        raise ShapeError(f"mx_mm: bias must be [{b.shape[1]}], got {tuple(bias.shape)}")
    path, _ = gemm_path.plan(a, b, out_dtype, backend)
    if path == "scaled_mm":
        return gemm_path.scaled_mm(a, b, out_dtype, bias)
    if path == "triton":  # (the bias rounded to the operand dtype first, as _matmul's)
        return triton_mm.mx_mm(a, b, out_dtype, None if bias is None else bias.to(operand_dtype(out_dtype)))
    return _matmul(_operand(a, out_dtype, backend), _operand(b, out_dtype, backend), out_dtype, bias)


def mx_grouped_mm(
    a: MXTensor,
    b: MXTensor,
    offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Grouped products for MoE experts; `offsets` are cumulative group ends.

    Forward / input grad: a [M, K] (axis 1) x b [E, K, N] (axis 1) -> [M, N]; the rows of group g
    use b[g]. Weight grad: a [K, M] x b [M, N], both blocked along the grouped M (a from
    ``quantize_grouped(x).t()``, b from ``quantize_grouped(dy)``) -> [E, K, N]. Either form is
    one grouped product over all groups (see [Note: one grouped product]).
    """
    if not isinstance(b, MXTensor) or not isinstance(a, MXTensor):
        raise ShapeError("mx_grouped_mm takes two MXTensors")
    if b.data.dim() == 3:
        _require(a, "a", 2, 1)
        _require(b, "b", 3, 1)
        M, K = a.shape
        E, Kb, N = b.shape
        if K != Kb:
            raise ShapeError(f"mx_grouped_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; K must match")
        check_offsets(offsets, M)
        if len(offsets) != E:
            raise ShapeError(f"mx_grouped_mm: {len(offsets)} offsets for {E} experts in b")
        av, bv = _operand(a, out_dtype, backend), _operand(b, out_dtype, backend)
        return grouped_rows_mm(av, bv, offsets).to(out_dtype)
    _require(a, "a", 2, 1)
    _require(b, "b", 2, 0)
    K, M = a.shape
    Mb, N = b.shape
    if M != Mb:
        raise ShapeError(f"mx_grouped_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; the grouped M must match")
    check_offsets(offsets, M)
    for name, mx in (("a", a), ("b", b)):
        check_same_offsets(mx.group_offsets, offsets, f"mx_grouped_mm: {name} must be quantized with quantize_grouped "
                                                      f"and these offsets")
    av, bv = _operand(a, out_dtype, backend), _operand(b, out_dtype, backend)
    return grouped_weight_grad_mm(av, bv, offsets).to(out_dtype)

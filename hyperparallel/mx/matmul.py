"""MX matrix products, emulated exactly: dequantize, then one library matmul.

Each operand is dequantized to a dtype that holds every one of its values exactly, and the
product runs in a fast library matmul with fp32 accumulation (oneDNN on the CPU, cuBLAS on the
GPU). The result equals the product of the dequantized operands to fp32 accumulation accuracy,
which is what MX hardware computes. The exact dtype is bf16 when the block scales keep every
value a normal bf16 (bf16 dot-product units treat subnormals as zero), else fp32, else fp64;
the ``reference`` backend always uses fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperparallel.errors import ShapeError
from hyperparallel.mx.format import BLOCK_SIZE, SCALE_BIAS, SCALE_NAN, element_format
from hyperparallel.mx.grouped_products import grouped_rows_mm, grouped_weight_grad_mm
from hyperparallel.mx.groups import check_offsets, grouped_scale_index
from hyperparallel.mx.tensor import MXTensor

# Magnitudes of the smallest nonzero and largest element of each format, as powers of two.
_ELEM_RANGE = {torch.float8_e4m3fn: (-9, 9), torch.float8_e5m2: (-16, 16)}
_NORMAL_RANGE = {torch.bfloat16: (-126, 128), torch.float32: (-149, 128)}


def _blocks_below_are_zero(mx: MXTensor, byte: int) -> bool:
    """Whether every block whose scale byte is below `byte` holds only zeros. All-zero blocks
    get scale byte 0, which would otherwise rule out bf16 for the whole operand."""
    if byte <= 0:
        return True
    small = mx.scale.view(torch.uint8) < byte
    if not bool(small.any()):
        return True
    if mx.group_offsets is not None:
        # Grouped: scale rows that no block uses hold byte 0 and scale nothing; look at the data
        # rows each used scale row scales (on the untransposed [M, K], blocked along M).
        data, small = (mx.data, small) if mx.axis == 0 else (mx.data.t(), small.t())
        scale_row = grouped_scale_index(mx.group_offsets, data.shape[0]).to(small.device)
        return not bool((data.view(torch.uint8)[small[scale_row]] & 0x7F).any())
    data = mx.data.view(torch.uint8).movedim(mx.axis, -1)
    blocks = F.pad(data, (0, -data.shape[-1] % BLOCK_SIZE)).reshape(*data.shape[:-1], -1, BLOCK_SIZE)
    return not bool((blocks[small.movedim(mx.axis, -1)] & 0x7F).any())


def _exact_dtype(mx: MXTensor, out_dtype: torch.dtype, backend: str | None) -> torch.dtype:
    if backend == "reference":
        return torch.float64
    if torch.compiler.is_compiling():
        # A graph cannot choose a dtype from the scales' values. fp32 holds every element of every
        # block that quantize() makes from finite inputs, except one whose largest value rounds up
        # to 2^128 or more (an fp32 input within one FP8 step of fp32's max), which becomes inf.
        return torch.float32
    lo_elem, hi_elem = _ELEM_RANGE[mx.elem_dtype]
    s = mx.scale.view(torch.uint8)
    if s.numel() == 0:
        return torch.bfloat16
    hi_byte = int(s.max())
    if hi_byte == SCALE_NAN:  # NaN blocks dequantize to NaN in any dtype: range over the others
        finite = s[s != SCALE_NAN]
        hi_byte = int(finite.max()) if finite.numel() else SCALE_BIAS
    e_max = hi_byte - SCALE_BIAS
    candidates = (torch.bfloat16, torch.float32) if out_dtype == torch.bfloat16 else (torch.float32,)
    for dtype in candidates:
        lo, hi = _NORMAL_RANGE[dtype]
        smallest_exact_byte = lo - lo_elem + SCALE_BIAS  # blocks scaled lower may underflow
        if e_max + hi_elem < hi and _blocks_below_are_zero(mx, smallest_exact_byte):
            return dtype
    return torch.float64


def _operand(mx: MXTensor, out_dtype: torch.dtype, backend: str | None) -> torch.Tensor:
    return mx.dequantize(_exact_dtype(mx, out_dtype, backend), backend=backend)


def _matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.mm(a.to(dtype), b.to(dtype)).to(out_dtype)


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


def mx_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.bfloat16, *, backend: str | None = None) -> torch.Tensor:
    """a [M, K] (blocked along K, axis 1) @ b [K, N] (blocked along K, axis 0) -> [M, N]."""
    _require(a, "a", 2, 1)
    _require(b, "b", 2, 0)
    if a.shape[1] != b.shape[0]:
        raise ShapeError(f"mx_mm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; a.shape[1] must equal b.shape[0]")
    if a.group_offsets is not None or b.group_offsets is not None:
        raise ShapeError("mx_mm takes ungrouped operands; use mx_grouped_mm for grouped ones")
    return _matmul(_operand(a, out_dtype, backend), _operand(b, out_dtype, backend), out_dtype)


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
        if mx.group_offsets is None or not torch.equal(mx.group_offsets.cpu().long(), offsets.cpu().long()):
            raise ShapeError(f"mx_grouped_mm: {name} must be quantized with quantize_grouped and these offsets")
    av, bv = _operand(a, out_dtype, backend), _operand(b, out_dtype, backend)
    return grouped_weight_grad_mm(av, bv, offsets).to(out_dtype)

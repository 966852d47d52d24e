"""Which GEMM an MX product runs on: chosen by the device's capability, or forced.

    scaled_mm   SM100+ (Blackwell: MX tensor cores): torch._scaled_mm on the FP8 data with the
                E8M0 scales in cuBLAS's tiled layout (`blocked_scales`); bf16 output, K a
                multiple of 32, M and N multiples of 16. The automatic choice there.
    triton      SM89+ (FP8 conversions; Hopper has no MX units): one Triton kernel that decodes
                the FP8 tiles and their scales to bf16 inside the tile and runs bf16 tensor-core
                products (`backends/triton_mm.py`). Only when forced, until a GPU measures it
                faster than `dequantize` (see AUTOMATIC).
    dequantize  everywhere: each operand dequantized to the compute dtype, then one library
                matmul (cuBLAS / oneDNN). The automatic choice below SM100, and the fallback.

Every path computes the same products (exact MX values, fp32 accumulation) in another order,
but for a bias (`scaled_mm` adds it to the bf16 product) and fp16 outputs (`triton` multiplies
bf16 operands, `dequantize` fp16: docs/mx.md "Matmul"'s corners differ).
`HYPERPARALLEL_MX_GEMM` (read at each call) or `plan(..., forced=)` forces one; a forced path
that cannot serve a product raises BackendError with the reason, an automatic choice falls back
to `dequantize`, and `plan` says why. Forcing is for tests and benchmarks: a forced `triton`
launches its kernel from Python, which torch.compile does not trace (a graph break). Grouped
products (MoE experts) take the dequantize path on every device: one torch._grouped_mm over bf16
operands.
"""

from __future__ import annotations

import os

import torch

from hyperparallel.errors import BackendError
from hyperparallel.kernels.env_setting import env_set
from hyperparallel.mx.tensor import MXTensor

PATHS = ("dequantize", "triton", "scaled_mm")
ENV = "HYPERPARALLEL_MX_GEMM"

# [Note: the automatic path on Hopper] The path taken unforced, by the lowest compute capability
# it needs (the first that the device reaches). Hopper (9.x) takes `dequantize`, not `triton`:
# exact MX at block 32 has no FP8 tensor-core form there that beats bf16 (the accumulator would be
# rescaled every 32 of K), and the Triton kernel's decode costs about as many issue slots as its
# bf16 products (benchmarks/mx_sass.py: ~1.1-1.4x the tensor cores' cycles, so at best Triton's
# bf16 speed, ~0.6-0.8x cuBLAS's), while `dequantize` adds two memory passes to cuBLAS's bf16 GEMM
# (~0.8-0.9x bf16's speed at the seed's sizes). scripts/gpu_check.sh measures both on an H200; a
# measurement that favours `triton` moves it here (under torch.compile too, once its launch is
# traceable: a torch.library.triton_op).
AUTOMATIC = (((10, 0), "scaled_mm"),)


def forcing(path: str | None):
    """HYPERPARALLEL_MX_GEMM set to `path` (None: unset) inside the block, as it was after it."""
    return env_set(ENV, path)


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def scaled_mm_reason(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> str | None:
    """Why torch._scaled_mm with MX scales cannot run this product (None: it can)."""
    capability = _capability(a.device)
    if capability is None or capability < (10, 0):
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else f"a {a.device.type} tensor"
        return f"scaled_mm needs MX tensor cores (compute capability 10.0+, Blackwell); this is {where}"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e8m0fnu"):
        return f"scaled_mm needs torch._scaled_mm with float8_e8m0fnu scales; torch {torch.__version__} lacks it"
    if out_dtype != torch.bfloat16:
        return f"scaled_mm writes bf16 here, not {out_dtype}"
    if a.elem_dtype != b.elem_dtype:
        return "scaled_mm takes operands of one element format"
    (M, K), N = a.shape, b.shape[1]
    if K % 32 or M % 16 or N % 16:
        return f"scaled_mm needs K a multiple of 32 and M, N multiples of 16; this is {M}x{K}x{N}"
    return None


def triton_reason(a: MXTensor, b: MXTensor, out_dtype: torch.dtype) -> str | None:
    """Why the Triton GEMM cannot run this product (None: it can)."""
    from hyperparallel.kernels.triton_support import unavailable_reason

    reason = unavailable_reason(a.device)
    if reason:
        return f"the triton GEMM cannot run: {reason}"
    capability = _capability(a.device)
    if capability is not None and capability < (8, 9):
        return ("the triton GEMM needs FP8 conversions (compute capability 8.9+); "
                f"this is {capability[0]}.{capability[1]}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the triton GEMM writes bf16, fp16 or fp32, not {out_dtype}"
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    if max(M * K, K * N, M * N) >= 2**31:  # its offsets are int32 (the faster address arithmetic)
        return f"the triton GEMM takes operands of under 2^31 elements; this is {M}x{K}x{N}"
    return None


def plan(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, backend: str | None = None,
         forced: str | None = None) -> tuple[str, str]:
    """(path, why) for a [M, K] x b [K, N] -> out_dtype on a's device."""
    forced = forced or os.environ.get(ENV) or None
    if forced is not None and forced not in PATHS:
        raise BackendError(f"{ENV}={forced!r} is no MX GEMM path; choose one of {PATHS}")
    if backend == "reference":
        if forced not in (None, "dequantize"):
            raise BackendError(f"the reference backend computes in fp64 on the dequantize path, not {forced}")
        return "dequantize", "the reference backend: fp64 products"
    checks = {"scaled_mm": lambda: scaled_mm_reason(a, b, out_dtype), "triton": lambda: triton_reason(a, b, out_dtype)}
    if forced is not None:
        reason = checks[forced]() if forced in checks else None
        if reason:
            raise BackendError(f"{ENV}={forced}: {reason}")
        return forced, "forced"
    capability = _capability(a.device)
    if capability is None:
        return "dequantize", f"{a.device.type}: no MX or FP8 GEMM units to use"
    where = f"compute capability {capability[0]}.{capability[1]}"
    wanted = next((path for needs, path in AUTOMATIC if capability >= needs), None)
    if wanted is None:
        return "dequantize", f"{where}: no MX tensor cores (the fastest exact path here, docs/mx.md)"
    reason = checks[wanted]()
    return (wanted, where) if reason is None else ("dequantize", reason)


def scaled_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b on MX tensor cores: torch._scaled_mm with the scales in cuBLAS's tiled layout.

    cuBLAS takes a row-major and b column-major (K contiguous in both). MXLinear's forward operands
    are already so; its input- and weight-grad operands are transposed views of copies blocked
    along the other dimension, whose FP8 bytes are copied here into that layout (one byte per
    element, a quarter of what the dequantize path writes)."""
    from hyperparallel.mx.blocked_scales import to_blocked

    a_data = a.data.contiguous()
    b_data = b.data.t().contiguous().t()  # [K, N] with K contiguous
    scale_a = to_blocked(a.scale.contiguous())
    scale_b = to_blocked(b.scale.t().contiguous())  # b's scales as [N, K/32], like a's
    out = torch._scaled_mm(a_data, b_data, scale_a, scale_b, out_dtype=out_dtype)
    # (cuBLAS's bias epilogue with block scales is not relied on: unchecked without a Blackwell GPU;
    # the bias is added to the bf16 product, one more rounding than the other paths)
    return out if bias is None else out + bias.to(out_dtype)

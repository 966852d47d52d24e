"""An MX matrix product as one Triton kernel, for GPUs without MX units (Hopper): FP8 tiles and
their E8M0 scales are read as bytes, decoded to the compute dtype inside the tile and multiplied
on the tensor cores with fp32 accumulation. It never writes the dequantized operands to memory,
which `mx_mm`'s dequantize path does (two passes over each operand's bf16 copy), but spends issue
slots on the decode instead: `gemm_path` takes it only when forced (its [Note: the automatic path
on Hopper]).

The decode is the hardware's FP8 conversion (two codes to fp16 in one instruction, then fp32),
times the block's power of two built from the scale byte, rounded to bf16: exact, as an MX value
has 4 significant bits (docs/mx.md "Matmul"). A scale is built once per row (column) and MX block
of the tile and broadcast over the block's 32 codes.

Operands of any strides (row-major, transposed views); K need not be a multiple of the tile nor
of 32 (a trailing partial block has its own scale). The product equals the dequantize path's to
fp32 accumulation order. Values below fp32's normal range (2^-126) may be flushed by a GPU's
fp32 multiply: the underflow corner of docs/mx.md "Matmul", a little wider.
"""

from __future__ import annotations

import torch

from hyperparallel.kernels.triton_support import JitKernels, interpret, on_device, tl, triton
from hyperparallel.mx.tensor import MXTensor

_KERNELS = JitKernels(globals())
_jit = _KERNELS.register

_ELEM = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Tiles for H100 / H200: 128 x 256 outputs, K in steps of 32 (one MX block), 8 warps, 4 stages:
# of the tiles benchmarks/mx_sass.py compares for sm_90, the fewest issue cycles per product
# without spilling registers. Not timed on a GPU yet: scripts/gpu_check.sh measures it.
TILE = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4}


@_jit
def _values(byte, ELEM: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 values of FP8 codes `byte` (uint8): the hardware's conversion (on Hopper two codes to
    fp16 in one instruction, then fp32). Triton's interpreter converts NaN and infinity codes as if
    they were finite, so there they are set apart by their bits (a GPU converts them itself)."""
    if ELEM == 0:  # E4M3: 0x7F / 0xFF NaN
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if INTERPRETED:
            value = tl.where((byte & 0x7F) == 0x7F, float("nan"), value)
    else:  # E5M2: exponent 31 is infinity (mantissa 0) or NaN
        value = byte.to(tl.float8e5, bitcast=True).to(tl.float32)
        if INTERPRETED:
            special = tl.where((byte & 0x3) == 0, float("inf"), float("nan"))
            value = tl.where((byte & 0x7C) == 0x7C, tl.where(byte >= 128, -special, special), value)
    return value


@_jit
def _scales(byte):
    """fp32 2^(byte - 127) of E8M0 bytes (int32), without a branch: byte 0 is 2^-127 (the
    subnormal 0x00400000), 255 NaN (the quiet NaN 0x7FC00000)."""
    return (tl.maximum(byte << 23, 0x00400000) | (((byte + 1) >> 8) << 22)).to(tl.float32, bitcast=True)


@_jit
def _mx_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K,
                  s_am, s_ak, s_asm, s_ask, s_bk, s_bn, s_bsk, s_bsn, s_cm, s_cn,
                  ELEM_A: tl.constexpr, ELEM_B: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
                  BF16: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N  # (not tl.cdiv: a jit function of triton.language, see JitKernels)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rm < M, rn < N
    KB: tl.constexpr = BLOCK_K // 32  # MX blocks along K in a tile (BLOCK_K is a multiple of 32)
    scale_blocks = (K + 31) // 32
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros is a jit function too)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kb = k0 // 32 + tl.arange(0, KB)
        in_k, in_kb = rk < K, kb < scale_blocks
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=in_m[:, None] & in_k[None, :], other=0)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=in_k[:, None] & in_n[None, :], other=0)
        # one scale per row (column) and MX block of the tile, broadcast over the block's 32 codes
        sa = tl.load(as_ptr + rm[:, None] * s_asm + kb[None, :] * s_ask, mask=in_m[:, None] & in_kb[None, :], other=127)
        sb = tl.load(bs_ptr + kb[:, None] * s_bsk + rn[None, :] * s_bsn, mask=in_kb[:, None] & in_n[None, :], other=127)
        a_val = tl.reshape(_values(a, ELEM_A, INTERPRETED), (BLOCK_M, KB, 32)) * _scales(sa.to(tl.int32))[:, :, None]
        b_val = tl.reshape(_values(b, ELEM_B, INTERPRETED), (KB, 32, BLOCK_N)) * _scales(sb.to(tl.int32))[:, None, :]
        a_val = tl.reshape(a_val, (BLOCK_M, BLOCK_K))
        b_val = tl.reshape(b_val, (BLOCK_K, BLOCK_N))
        if BF16:
            acc = tl.dot(a_val.to(tl.bfloat16), b_val.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a_val, b_val, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=in_n, other=0).to(tl.float32)[None, :]
    if OUT == 1:
        out = acc.to(tl.bfloat16)
    elif OUT == 2:
        out = acc.to(tl.float16)
    else:
        out = acc
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, out, mask=in_m[:, None] & in_n[None, :])


def bf16_operands(out_dtype: torch.dtype) -> bool:
    """Whether the tile's operands go to the tensor cores as bf16: for a bf16 / fp16 output, but
    not under Triton's interpreter, whose numpy has no bf16 (there the same exact values are
    multiplied in fp32: the decode and the product are what the tests check)."""
    return out_dtype != torch.float32 and not interpret()


def mx_mm(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
          tile: dict | None = None) -> torch.Tensor:
    """a [M, K] (blocked along K) @ b [K, N] (blocked along K) (+ bias) -> [M, N] in out_dtype,
    computed in bf16 for a bf16 / fp16 output, fp32 for fp32 (as mx_mm's dequantize path)."""
    tile = dict(TILE if tile is None else tile)
    if tile["BLOCK_K"] % 32:
        raise ValueError(f"the MX GEMM's BLOCK_K must be whole MX blocks (a multiple of 32), not {tile['BLOCK_K']}")
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    _KERNELS.build()
    ad, asc, bd, bsc = (t.view(torch.uint8) for t in (a.data, a.scale, b.data, b.scale))
    bias_arg = bias.contiguous() if bias is not None else out
    grid = (triton.cdiv(M, tile["BLOCK_M"]) * triton.cdiv(N, tile["BLOCK_N"]),)
    with on_device(a.device):
        _mx_mm_kernel[grid](ad, asc, bd, bsc, out, bias_arg, M, N, K, *ad.stride(), *asc.stride(), *bd.stride(),
                            *bsc.stride(), *out.stride(), ELEM_A=_ELEM[a.elem_dtype], ELEM_B=_ELEM[b.elem_dtype],
                            HAS_BIAS=bias is not None, OUT=_OUT[out_dtype], BF16=bf16_operands(out_dtype),
                            INTERPRETED=interpret(), **tile)
    return out

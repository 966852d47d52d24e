"""An MX matrix product as one Triton kernel, for GPUs without MX units (Hopper): FP8 tiles and
their E8M0 scales are read as bytes, decoded to the compute dtype inside the tile (exactly: the
element's bits rebuilt, times its block's power of two) and multiplied on the tensor cores with
fp32 accumulation. It never writes the dequantized operands to memory, which `mx_mm`'s
dequantize path does (two passes over each operand's bf16 copy).

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
# Tiles for H100 / H200: 128 x 128 outputs, K in steps of 64 (two MX blocks), 8 warps, 3 stages.
# Not tuned on a GPU yet (none was lent): scripts/gpu_check.sh measures them.
TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


@_jit
def _decoded(byte, scale_byte, ELEM: tl.constexpr):
    """fp32 value of FP8 codes `byte` (int32, 0..255) times 2^(scale_byte - 127)."""
    sign = (byte >> 7) << 31
    if ELEM == 0:  # E4M3: bias 7, 3 mantissa bits, 0x7F / 0xFF NaN
        e = (byte >> 3) & 0xF
        m = byte & 0x7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
        nan = (e == 15) & (m == 7)
    else:  # E5M2: bias 15, 2 mantissa bits, exponent 31: inf (m 0) or NaN
        e = (byte >> 2) & 0x1F
        m = byte & 0x3
        normal = (sign | ((e + 112) << 23) | (m << 21)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.0000152587890625  # m * 2^-16
        nan = (e == 31) & (m != 0)
        normal = tl.where((e == 31) & (m == 0), (sign | 0x7F800000).to(tl.float32, bitcast=True), normal)  # inf
    value = tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)
    # 2^(s - 127): an fp32 exponent field, 2^-127 (byte 0) the subnormal 0x00400000, 255 NaN
    scale = tl.where(scale_byte == 0, 0x00400000, scale_byte << 23).to(tl.float32, bitcast=True)
    return tl.where(nan | (scale_byte == 255), float("nan"), value * scale)


@_jit
def _mx_mm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K,
                  s_am, s_ak, s_asm, s_ask, s_bk, s_bn, s_bsk, s_bsn, s_cm, s_cn,
                  ELEM_A: tl.constexpr, ELEM_B: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
                  BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N  # (not tl.cdiv: a jit function of triton.language, see JitKernels)
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rm < M, rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # (tl.zeros is a jit function too)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        mask_a = in_m[:, None] & in_k[None, :]
        mask_b = in_k[:, None] & in_n[None, :]
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=mask_a, other=0).to(tl.int32)
        sa = tl.load(as_ptr + rm[:, None] * s_asm + (rk // 32)[None, :] * s_ask, mask=mask_a, other=127).to(tl.int32)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=mask_b, other=0).to(tl.int32)
        sb = tl.load(bs_ptr + (rk // 32)[:, None] * s_bsk + rn[None, :] * s_bsn, mask=mask_b, other=127).to(tl.int32)
        a_val = _decoded(a & 0xFF, sa & 0xFF, ELEM_A)
        b_val = _decoded(b & 0xFF, sb & 0xFF, ELEM_B)
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
                            HAS_BIAS=bias is not None, OUT=_OUT[out_dtype], BF16=bf16_operands(out_dtype), **tile)
    return out

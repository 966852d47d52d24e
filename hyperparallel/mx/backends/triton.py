"""Triton backend: GPU kernels of the MX operators, byte for byte equal to the reference.

Every kernel works on IEEE bit patterns in int32 registers, the algorithm of csrc/mx_generic.c:
inputs are loaded as raw bits (fp32 as int32, bf16/fp16 as int16), the block amax is the largest
absolute bit pattern, the scale byte comes from its exponent field, and the FP8 rounding is done
with integer adds and shifts (normal codes) or one fp32 add of a magic constant (subnormal codes).
Multiplying by the power-of-two inverse scale is done on the exponent field as well: that is the
exact IEEE product, and unlike a float multiply it cannot be flushed to zero by a GPU that treats
fp32 subnormals as zero, so subnormal inputs and scales give the same bytes as on the CPU.

Kernels (one program per tile, 1-D grids so that no grid axis can overflow 65535):
  _quant_rows_kernel   blocks along the contiguous last axis: a [rows, blocks, 32] tile
  _quant_cols_kernel   blocks down the rows of a [rows, cols] view: a [32, cols] tile per block;
                       also the grouped (MoE) layout, whose block table is built on the device
  _quant_dual_kernel   a [32, blocks, 32] tile read once, written row-wise and column-wise
  _dequant_kernel      a [rows, cols] tile, each element gathering its scale byte

The kernels are jitted on first use (hyperparallel.kernels.triton_support's [Note: kernels jitted
on first use]): this module imports without triton, and Triton's interpreter (kernels run on CPU
tensors) is honoured when it is asked for any time before a call.
"""

from __future__ import annotations

import torch

from hyperparallel.kernels.triton_support import JitKernels, on_device, reduce_max, tl, triton, unavailable_reason
from hyperparallel.mx import outputs
from hyperparallel.mx.format import BLOCK_SIZE, num_blocks
from hyperparallel.mx.groups import grouped_scale_rows

_IN_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BIT_VIEWS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# Per element format (see mx_common.h): fp32 bits of the largest and of the smallest normal value,
# a magic value whose ulp is the subnormal step, 23 - mantissa bits, the exponent rebias, emax.
_FORMATS = {
    torch.float8_e4m3fn: {
        "MAX_BITS": 0x43E00000, "NORMAL_BITS": 0x3C800000, "MAGIC_BITS": 0x46800000, "MAGIC": 16384.0,
        "MANT_SHIFT": 20, "REBIAS": 120 << 3, "EMAX": 8, "ELEM": 0,
    },
    torch.float8_e5m2: {
        "MAX_BITS": 0x47600000, "NORMAL_BITS": 0x38800000, "MAGIC_BITS": 0x43000000, "MAGIC": 128.0,
        "MANT_SHIFT": 21, "REBIAS": 112 << 2, "EMAX": 15, "ELEM": 1,
    },
}
_OUT_NATIVE = (torch.float32, torch.bfloat16)
_TILE = 4096  # elements per program: 32 per thread at 4 warps, coalesced 16-byte accesses
_NUM_WARPS = 4


# ------------------------------------------------------------------------------------ kernels
# Plain functions, made triton.jit functions of this module by _KERNELS.build() on first use.

_KERNELS = JitKernels(globals(), shared=("reduce_max",))  # (the block-amax reductions)
_jit = _KERNELS.register


@_jit
def _load_bits(ptr, offs, mask, IN_KIND: tl.constexpr):
    """fp32 bit patterns (int32) of the inputs at ptr + offs; masked lanes read as +0."""
    raw = tl.load(ptr + offs, mask=mask, other=0)
    if IN_KIND == 0:
        bits = raw
    elif IN_KIND == 1:
        bits = (raw.to(tl.int32) & 0xFFFF) << 16
    else:
        h = raw.to(tl.int32) & 0xFFFF
        exp = (h >> 10) & 0x1F
        mant = h & 0x3FF
        normal = ((exp + 112) << 23) | (mant << 13)
        special = 0x7F800000 | (mant << 13)
        # an fp16 subnormal is mant * 2**-24: convert the integer exactly, then lower the exponent
        sub = tl.where(mant == 0, 0, mant.to(tl.float32).to(tl.int32, bitcast=True) - (24 << 23))
        bits = ((h & 0x8000) << 16) | tl.where(exp == 0, sub, tl.where(exp == 31, special, normal))
    return bits


@_jit
def _scale_byte(amax, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """E8M0 byte of blocks whose largest absolute fp32 bit pattern is amax (0xFF for NaN/Inf)."""
    e = (amax >> 23) - 127 - EMAX
    if RCEIL:
        # the element max is 1.75 * 2**emax: round up when amax's mantissa exceeds 1.75
        e += ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    # the lower clamp also covers zero and subnormal amax (exponent field 0)
    e = tl.minimum(tl.maximum(e, -127), 127)
    return tl.where(amax >= 0x7F800000, 255, e + 127)


@_jit
def _encode(xb, byte, MAX_BITS: tl.constexpr, NORMAL_BITS: tl.constexpr, MAGIC_BITS: tl.constexpr,
            MAGIC: tl.constexpr, MANT_SHIFT: tl.constexpr, REBIAS: tl.constexpr):
    """FP8 codes (int32) of fp32 bits xb scaled by 2**-(byte - 127); byte broadcasts against xb."""
    k = 127 - byte  # exponent of the inverse scale
    sign = (xb >> 24) & 0x80
    a = xb & 0x7FFFFFFF
    # x * 2**k on the exponent field. A subnormal x (field 0) is first rewritten as its mantissa
    # converted exactly to a normal float times 2**-149.
    subnormal_in = (a >> 23) == 0
    base = tl.where(subnormal_in, a.to(tl.float32).to(tl.int32, bitcast=True), a)
    shift = tl.where(subnormal_in, k - 149, k)
    # a product below the fp32 normal range is far below half the smallest FP8 subnormal: code 0
    keep = (a != 0) & (((base >> 23) + shift) > 0)
    a = tl.where(keep, base + (shift << 23), 0)
    a = tl.minimum(a, MAX_BITS)  # saturate
    # normal: round the mantissa to nearest even on the integer bits, then rebias the exponent
    r = a + ((1 << (MANT_SHIFT - 1)) - 1) + ((a >> MANT_SHIFT) & 1)
    normal = (r >> MANT_SHIFT) - REBIAS
    # subnormal: adding the magic value makes the fp32 adder round to the subnormal step
    sub = (a.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    return sign | tl.where(a >= NORMAL_BITS, normal, sub)


@_jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, R, N, NB, TILES_C, BLOCK_R: tl.constexpr, BLOCKS: tl.constexpr,
                       IN_KIND: tl.constexpr, RCEIL: tl.constexpr, MAX_BITS: tl.constexpr,
                       NORMAL_BITS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
                       MANT_SHIFT: tl.constexpr, REBIAS: tl.constexpr, EMAX: tl.constexpr):
    """[R, N] row-major input, blocks of 32 along N; one [BLOCK_R, BLOCKS, 32] tile per program."""
    pid = tl.program_id(0)
    pid_r = pid // TILES_C
    pid_c = pid - pid_r * TILES_C
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    blocks = pid_c * BLOCKS + tl.arange(0, BLOCKS)
    cols = blocks[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rows[:, None, None] < R) & (cols < N)
    offs = rows[:, None, None] * N + cols
    xb = _load_bits(x_ptr, offs, mask, IN_KIND)
    byte = _scale_byte(reduce_max(xb & 0x7FFFFFFF, 2), EMAX, RCEIL)
    codes = _encode(xb, byte[:, :, None], MAX_BITS, NORMAL_BITS, MAGIC_BITS, MAGIC, MANT_SHIFT, REBIAS)
    codes = tl.where(byte[:, :, None] == 255, 0x7F, codes)
    tl.store(q_ptr + offs, codes.to(tl.uint8), mask=mask)
    smask = (rows[:, None] < R) & (blocks[None, :] < NB)
    tl.store(s_ptr + rows[:, None] * NB + blocks[None, :], byte.to(tl.uint8), mask=smask)


@_jit
def _quant_cols_kernel(x_ptr, q_ptr, s_ptr, start_ptr, len_ptr, C, n, NB, TILES_C, BLOCK_C: tl.constexpr,
                       GROUPED: tl.constexpr, IN_KIND: tl.constexpr, RCEIL: tl.constexpr,
                       MAX_BITS: tl.constexpr, NORMAL_BITS: tl.constexpr, MAGIC_BITS: tl.constexpr,
                       MAGIC: tl.constexpr, MANT_SHIFT: tl.constexpr, REBIAS: tl.constexpr,
                       EMAX: tl.constexpr):
    """Blocks down the rows of a [rows, C] view; program = (scale row s, tile of BLOCK_C columns).

    Batched (GROUPED false): the rows are `rows // n` slabs of n rows, each blocked on its own, and
    scale row s is block s % NB of slab s // NB. Grouped: scale row s covers len_ptr[s] rows from
    start_ptr[s]; a length <= 0 marks a scale row no block uses, which gets byte 0.
    """
    pid = tl.program_id(0)
    s = (pid // TILES_C).to(tl.int64)
    pid_c = pid - (pid // TILES_C) * TILES_C
    if GROUPED:
        start = tl.load(start_ptr + s)
        length = tl.load(len_ptr + s)
    else:
        slab = s // NB
        j = s - slab * NB
        start = slab * n + j * 32
        length = tl.minimum(n - j * 32, 32)
    r = tl.arange(0, 32)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < length) & (cols[None, :] < C)
    offs = (start + r[:, None]).to(tl.int64) * C + cols[None, :]
    xb = _load_bits(x_ptr, offs, mask, IN_KIND)
    byte = _scale_byte(reduce_max(xb & 0x7FFFFFFF, 0), EMAX, RCEIL)
    codes = _encode(xb, byte[None, :], MAX_BITS, NORMAL_BITS, MAGIC_BITS, MAGIC, MANT_SHIFT, REBIAS)
    codes = tl.where(byte[None, :] == 255, 0x7F, codes)
    tl.store(q_ptr + offs, codes.to(tl.uint8), mask=mask)
    tl.store(s_ptr + s * C + cols, byte.to(tl.uint8), mask=cols < C)


@_jit
def _quant_dual_kernel(x_ptr, qr_ptr, sr_ptr, qc_ptr, sc_ptr, M, K, NBK, TILES_K, BLOCKS: tl.constexpr,
                       IN_KIND: tl.constexpr, RCEIL: tl.constexpr, MAX_BITS: tl.constexpr,
                       NORMAL_BITS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC: tl.constexpr,
                       MANT_SHIFT: tl.constexpr, REBIAS: tl.constexpr, EMAX: tl.constexpr):
    """[M, K] input; each program reads one [32, BLOCKS, 32] tile (32 rows, BLOCKS * 32 columns)
    and writes both its row-wise (blocks along K) and column-wise (blocks along M) quantization."""
    pid = tl.program_id(0)
    pid_m = pid // TILES_K
    pid_k = pid - pid_m * TILES_K
    rows = (pid_m * 32 + tl.arange(0, 32)).to(tl.int64)
    blocks = pid_k * BLOCKS + tl.arange(0, BLOCKS)
    lanes = tl.arange(0, 32)
    cols = blocks[None, :, None] * 32 + lanes[None, None, :]
    mask = (rows[:, None, None] < M) & (cols < K)
    offs = rows[:, None, None] * K + cols
    xb = _load_bits(x_ptr, offs, mask, IN_KIND)
    a = xb & 0x7FFFFFFF

    row_byte = _scale_byte(reduce_max(a, 2), EMAX, RCEIL)  # [32, BLOCKS]
    codes = _encode(xb, row_byte[:, :, None], MAX_BITS, NORMAL_BITS, MAGIC_BITS, MAGIC, MANT_SHIFT, REBIAS)
    codes = tl.where(row_byte[:, :, None] == 255, 0x7F, codes)
    tl.store(qr_ptr + offs, codes.to(tl.uint8), mask=mask)
    smask = (rows[:, None] < M) & (blocks[None, :] < NBK)
    tl.store(sr_ptr + rows[:, None] * NBK + blocks[None, :], row_byte.to(tl.uint8), mask=smask)

    col_byte = _scale_byte(reduce_max(a, 0), EMAX, RCEIL)  # [BLOCKS, 32]
    codes = _encode(xb, col_byte[None, :, :], MAX_BITS, NORMAL_BITS, MAGIC_BITS, MAGIC, MANT_SHIFT, REBIAS)
    codes = tl.where(col_byte[None, :, :] == 255, 0x7F, codes)
    tl.store(qc_ptr + offs, codes.to(tl.uint8), mask=mask)
    scols = blocks[:, None] * 32 + lanes[None, :]
    tl.store(sc_ptr + pid_m.to(tl.int64) * K + scols, col_byte.to(tl.uint8), mask=scols < K)


@_jit
def _decode(code, byte, ELEM: tl.constexpr):
    """fp32 bits (int32) of FP8 code times 2**(byte - 127), exact; NaN for byte 0xFF."""
    m = code & 0x7F
    if ELEM == 0:
        frac = m & 7
        # subnormal frac * 2**-9: convert the integer exactly, then lower the exponent
        sub = tl.where(frac == 0, 0, frac.to(tl.float32).to(tl.int32, bitcast=True) - (9 << 23))
        v = tl.where((m >> 3) == 0, sub, (m << 20) + (120 << 23))
        inf = m < 0  # E4M3FN has no infinity
        nan = m == 0x7F
    else:
        frac = m & 3
        sub = tl.where(frac == 0, 0, frac.to(tl.float32).to(tl.int32, bitcast=True) - (16 << 23))
        v = tl.where((m >> 2) == 0, sub, (m << 21) + (112 << 23))
        inf = m == 0x7C
        nan = m > 0x7C
    # v is zero or a normal fp32 (at least 2**-16); multiply by 2**e on the exponent field.
    # Every product is a multiple of 2**-149, so a result below the normal range is the mantissa
    # shifted right with no bit lost, and the result is the float64 product rounded once.
    e = byte - 127
    new_exp = (v >> 23) + e
    denormal = ((v & 0x7FFFFF) | 0x800000) >> tl.minimum(tl.maximum(1 - new_exp, 0), 31)
    bits = tl.where(new_exp >= 1, v + (e << 23), denormal)
    bits = tl.where(new_exp >= 255, 0x7F800000, bits)
    bits = tl.where((v == 0) & ~inf, 0, bits)
    bits = tl.where(inf, 0x7F800000, bits)
    bits = tl.where(nan | (byte == 255), 0x7FC00000, bits)
    return ((code & 0x80) << 24) | bits


@_jit
def _dequant_kernel(q_ptr, s_ptr, idx_ptr, out_ptr, R, C, n, S, TILES_C, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, AXIS_LAST: tl.constexpr, GROUPED: tl.constexpr,
                    ELEM: tl.constexpr, OUT_BF16: tl.constexpr):
    """Elements of an [R, C] view times their scales.

    AXIS_LAST: blocks run along C (scale [R, S]). Otherwise the rows are R // n slabs of n rows
    blocked along the rows (scale [R // n * S, C]). The scale row of position i along the blocked
    axis is i // 32, or idx_ptr[i] for a grouped layout.
    """
    pid = tl.program_id(0)
    pid_r = pid // TILES_C
    pid_c = pid - pid_r * TILES_C
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None] * C + cols[None, :]
    if AXIS_LAST:
        if GROUPED:
            scol = tl.load(idx_ptr + cols, mask=cols < C, other=0).to(tl.int64)
        else:
            scol = cols // 32
        soffs = rows[:, None] * S + scol[None, :]
    else:
        slab = rows // n
        i = rows - slab * n
        if GROUPED:
            srow = tl.load(idx_ptr + i, mask=rows < R, other=0).to(tl.int64)
        else:
            srow = i // 32
        soffs = (slab * S + srow)[:, None] * C + cols[None, :]
    code = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    byte = tl.load(s_ptr + soffs, mask=mask, other=0).to(tl.int32)
    bits = _decode(code, byte, ELEM)
    if OUT_BF16:
        a = bits & 0x7FFFFFFF
        rounded = (a + 0x7FFF + ((a >> 16) & 1)) >> 16  # the exact fp32 value rounded once
        half = ((bits >> 16) & 0x8000) | tl.where(a > 0x7F800000, 0x7FC0, rounded)
        tl.store(out_ptr + offs, half.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, bits, mask=mask)


# ------------------------------------------------------------------------------------ helpers


def _pow2(n: int, lo: int = 1, hi: int | None = None) -> int:
    p = triton.next_power_of_2(max(n, 1))
    p = max(p, lo)
    return min(p, hi) if hi is not None else p


def _launch(kernel, programs: int, *args, **meta) -> None:
    kernel[(programs,)](*args, num_warps=_NUM_WARPS, **meta)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_BIT_VIEWS[x.dtype])


def _quant_meta(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> dict:
    fmt = dict(_FORMATS[elem_dtype])
    fmt.pop("ELEM")
    return dict(fmt, IN_KIND=_IN_KINDS[x.dtype], RCEIL=scale_mode == "rceil")


def _quant_rows(x, q, s, R: int, N: int, meta: dict) -> None:
    nb = num_blocks(N)
    blocks = _pow2(nb, hi=8)
    block_r = _pow2(R, hi=max(1, _TILE // (blocks * BLOCK_SIZE)))
    tiles_c = triton.cdiv(nb, blocks)
    programs = triton.cdiv(R, block_r) * tiles_c
    _launch(_quant_rows_kernel, programs, x, q, s, R, N, nb, tiles_c, BLOCK_R=block_r, BLOCKS=blocks, **meta)


def _quant_cols(x, q, s, scale_rows: int, C: int, n: int, table, meta: dict) -> None:
    block_c = _pow2(C, lo=16, hi=_TILE // BLOCK_SIZE)
    tiles_c = triton.cdiv(C, block_c)
    start, length = table if table is not None else (s, s)  # unread when not grouped
    _launch(_quant_cols_kernel, scale_rows * tiles_c, x, q, s, start, length, C, n, num_blocks(n), tiles_c,
            BLOCK_C=block_c, GROUPED=table is not None, **meta)


def _grouped_table(offsets: torch.Tensor, rows: int, device: torch.device):
    """(first row, row count) of the block behind every scale row, computed on the device."""
    ends = offsets.to(device=device, dtype=torch.int64)
    num_groups = ends.numel()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    first = starts // BLOCK_SIZE + torch.arange(num_groups, device=device)  # strictly increasing
    s = torch.arange(grouped_scale_rows(rows, num_groups), device=device)
    g = torch.searchsorted(first, s, right=True) - 1
    start = starts[g] + BLOCK_SIZE * (s - first[g])
    length = torch.clamp(ends[g] - start, max=BLOCK_SIZE)  # <= 0: a scale row no block uses
    return start.contiguous(), length.contiguous()


def _grouped_index(offsets: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Scale row of each of the n positions along a grouped axis (groups.grouped_scale_index)."""
    ends = offsets.to(device=device, dtype=torch.int64)
    i = torch.arange(n, device=device)
    g = torch.searchsorted(ends, i, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])[g]
    return (starts // BLOCK_SIZE + g + (i - starts) // BLOCK_SIZE).to(torch.int32)


# ----------------------------------------------------------------------------------- operators


@torch.library.custom_op("hyperparallel::mx_quantize_triton", mutates_args=())
def _quantize(x: torch.Tensor, axis: int, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    data, scale = outputs.quantized(x, axis, elem_dtype)
    outer, n, inner = outputs.split_at_axis(x.shape, axis)
    if x.numel():
        _KERNELS.build()
        meta = _quant_meta(x, elem_dtype, scale_mode)
        q, s = data.view(torch.uint8), scale.view(torch.uint8)
        with on_device(x.device):
            if inner == 1:
                _quant_rows(_bits(x), q, s, outer, n, meta)
            else:
                _quant_cols(_bits(x), q, s, outer * num_blocks(n), inner, n, None, meta)
    return data, scale


@torch.library.custom_op("hyperparallel::mx_quantize_dual_triton", mutates_args=())
def _quantize_dual(x: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    M, K = x.shape
    dev = x.device
    out = outputs.dual(x, elem_dtype)
    row_data, row_scale, col_data, col_scale = (t.view(torch.uint8) for t in out)
    if x.numel():
        _KERNELS.build()
        nbk = num_blocks(K)
        blocks = _pow2(nbk, hi=4)
        tiles_k = triton.cdiv(nbk, blocks)
        with on_device(dev):
            _launch(
                _quant_dual_kernel, num_blocks(M) * tiles_k, _bits(x), row_data, row_scale, col_data, col_scale,
                M, K, nbk, tiles_k, BLOCKS=blocks, **_quant_meta(x, elem_dtype, scale_mode),
            )
    return out


@torch.library.custom_op("hyperparallel::mx_quantize_grouped_triton", mutates_args=())
def _quantize_grouped(x: torch.Tensor, offsets: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    dev = x.device
    data, scale = outputs.grouped(x, offsets.shape[0], elem_dtype)
    if x.numel() == 0:  # no block at all: every scale row is unused
        return data, scale
    _KERNELS.build()
    with on_device(dev):
        table = _grouped_table(offsets, M, dev)
        _quant_cols(_bits(x), data.view(torch.uint8), scale.view(torch.uint8), scale.shape[0], K, M, table,
                    _quant_meta(x, elem_dtype, scale_mode))
    return data, scale


@torch.library.custom_op("hyperparallel::mx_dequantize_triton", mutates_args=())
def _dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int, group_offsets: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype if dtype in _OUT_NATIVE else torch.float32
    dev = data.device
    out = outputs.dequantized(data, out_dtype)
    if data.numel():
        _KERNELS.build()
        outer, n, inner = outputs.split_at_axis(data.shape, axis)
        axis_last = inner == 1
        R, C = (outer, n) if axis_last else (outer * n, inner)
        block_c = _pow2(C, lo=16, hi=256)
        block_r = _pow2(R, hi=max(1, _TILE // block_c))
        tiles_c = triton.cdiv(C, block_c)
        programs = triton.cdiv(R, block_r) * tiles_c
        out_bits = out.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)
        with on_device(dev):
            index = _grouped_index(group_offsets, n, dev) if group_offsets is not None else out_bits
            _launch(
                _dequant_kernel, programs, data.view(torch.uint8), scale.view(torch.uint8), index, out_bits,
                R, C, n, scale.shape[axis], tiles_c, BLOCK_R=block_r, BLOCK_C=block_c, AXIS_LAST=axis_last,
                GROUPED=group_offsets is not None, ELEM=_FORMATS[data.dtype]["ELEM"],
                OUT_BF16=out_dtype == torch.bfloat16,
            )
    return out if out_dtype == dtype else out.to(dtype)


# (their fake implementations, for torch.compile: the outputs, unfilled)
outputs.register_fakes(_quantize, _quantize_dual, _quantize_grouped, _dequantize)


def quantize(x, axis, elem_dtype, scale_mode):
    return _quantize(x, axis % x.dim(), elem_dtype, scale_mode)


def quantize_dual(x, elem_dtype, scale_mode):
    return _quantize_dual(x, elem_dtype, scale_mode)


def quantize_grouped(x, offsets, elem_dtype, scale_mode):
    return _quantize_grouped(x, offsets, elem_dtype, scale_mode)


def dequantize(data, scale, axis, group_offsets, dtype):
    axis = axis % data.dim()
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        # a transposed view (MXTensor.t()): work on the contiguous storage, transpose back
        return _dequantize(data.t(), scale.t().contiguous(), 1 - axis, group_offsets, dtype).t()
    return _dequantize(data.contiguous(), scale.contiguous(), axis, group_offsets, dtype)


__all__ = ["quantize", "quantize_dual", "quantize_grouped", "dequantize", "unavailable_reason"]

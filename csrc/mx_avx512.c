/*
 * AVX-512 implementation of the MX tile kernels (see mx_common.h for the table).
 *
 * The same bit-level algorithm as mx_generic.c, 16 fp32 lanes at a time, with masked loads and
 * stores for partial blocks. Only compiled for x86-64 and only called after the loader has
 * checked the processor for AVX-512 F/BW/VL/DQ.
 */
#include "mx_common.h"

#ifdef HP_ISA_X86
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq")))

AVX512_INLINE __mmask16 lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
}

/* 16 values (fewer under the mask, zeros elsewhere) as fp32 bits. */
/* Full vectors use plain loads and stores: on some cores (Zen 4) the masked and the
 * down-converting memory forms are several times slower. */
AVX512_INLINE __m512i load16(const void *src, int dtype, int64_t off, __mmask16 m) {
    if (dtype == IN_F32)
        return m == 0xFFFF ? _mm512_loadu_si512((const uint32_t *)src + off)
                           : _mm512_maskz_loadu_epi32(m, (const uint32_t *)src + off);
    __m256i h = m == 0xFFFF ? _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + off))
                            : _mm256_maskz_loadu_epi16(m, (const uint16_t *)src + off);
    if (dtype == IN_BF16) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return _mm512_castps_si512(_mm512_cvtph_ps(h)); /* exact, subnormals included */
}

AVX512_INLINE __m512i abs_bits(__m512i x) {
    return _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
}

/* Per lane: E8M0 byte of a block whose largest absolute fp32 bit pattern is amax. */
AVX512_INLINE __m512i scale_bytes16(__m512i amax, int mode, int emax) {
    __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(amax, 23), _mm512_set1_epi32(127 + emax));
    if (mode == SCALE_RCEIL) {
        __mmask16 up = _mm512_cmpgt_epu32_mask(_mm512_and_si512(amax, _mm512_set1_epi32(0x7FFFFF)),
                                               _mm512_set1_epi32(0x600000));
        e = _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
    }
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    __m512i byte = _mm512_add_epi32(e, _mm512_set1_epi32(127));
    __mmask16 bad = _mm512_cmpge_epu32_mask(amax, _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(byte, bad, _mm512_set1_epi32(0xFF));
}

/* 2^-(byte-127) per lane; lanes of NaN blocks get garbage, which callers overwrite. */
AVX512_INLINE __m512 inv_scales16(__m512i byte) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), byte), 23));
}

/* x (fp32 bits) times the inverse scale, to FP8 codes in 32-bit lanes. */
AVX512_INLINE __m512i to_fp8_16(__m512i x, __m512 inv, const elem_fmt *f) {
    __m512i v = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(x), inv));
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(v, 24), _mm512_set1_epi32(0x80));
    __m512i a = _mm512_min_epu32(abs_bits(v), _mm512_set1_epi32((int)f->max_bits));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, f->mant_shift), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (f->mant_shift - 1)) - 1)), lsb);
    __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(r, f->mant_shift), _mm512_set1_epi32(f->rebias));
    __m512 magic = _mm512_castsi512_ps(_mm512_set1_epi32((int)f->magic_bits));
    __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), magic)),
                                   _mm512_castps_si512(magic));
    __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32((int)f->normal_bits));
    return _mm512_or_si512(sign, _mm512_mask_mov_epi32(sub, is_normal, normal));
}

/* The fast conversion splits in two. Rounding |x| to the element's mantissa width does not
 * depend on the power-of-two scale, so it is done once per element ("prep": the rounded fp32
 * exponent and mantissa bits, sign in bit 15) and shared by the row and column copies; a
 * scale then only rebiases the exponent field. Lanes whose result is an element subnormal (or
 * whose input is an fp32 subnormal) round at another position: they take to_fp8_16. */
AVX512_INLINE __m512i prepare16(__m512i x, const elem_fmt *f) {
    __m512i a = abs_bits(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, f->mant_shift), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (f->mant_shift - 1)) - 1)), lsb);
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x8000));
    /* fp32 subnormal inputs get field 0, which sends them to the exact path: their rounded
     * field could carry into exponent 1 and look normal while rounding at the wrong bit */
    __m512i field = _mm512_maskz_mov_epi32(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x00800000)),
                                           _mm512_srli_epi32(r, f->mant_shift));
    return _mm512_or_si512(field, sign);
}

/* fp8 codes of prepared lanes for scales whose exponent field offsets are `offset` (see
 * exponent_offset). Lanes set in *slow still need the exact path (to_fp8_16). */
AVX512_INLINE __m512i encode_fast16(__m512i prep, __m512i offset, const elem_fmt *f, __mmask16 *slow) {
    __m512i r = _mm512_and_si512(prep, _mm512_set1_epi32(0x7FFF));
    __m512i t = _mm512_sub_epi32(r, offset);
    __m512i min_normal = _mm512_set1_epi32(1 << (23 - f->mant_shift));
    *slow = _mm512_cmplt_epi32_mask(t, min_normal) | _mm512_cmplt_epi32_mask(r, min_normal); /* r: see prepare16 */
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(prep, 8), _mm512_set1_epi32(0x80));
    return _mm512_or_si512(_mm512_min_epi32(t, _mm512_set1_epi32(f->max_code)), sign);
}

AVX512_INLINE __m512i encode16(__m512i prep, __m512i offset, __m512i x, __m512 inv, const elem_fmt *f) {
    __mmask16 slow;
    __m512i code = encode_fast16(prep, offset, f, &slow);
    if (slow) code = _mm512_mask_mov_epi32(code, slow, to_fp8_16(x, inv, f));
    return code;
}

/* What a scale byte subtracts from the prepared exponent/mantissa field. */
AVX512_INLINE __m512i exponent_offset(__m512i byte, const elem_fmt *f) {
    __m512i e = _mm512_sub_epi32(byte, _mm512_set1_epi32(127));
    return _mm512_add_epi32(_mm512_slli_epi32(e, 23 - f->mant_shift), _mm512_set1_epi32(f->rebias));
}

AVX512_INLINE void store_codes(uint8_t *q, __mmask16 m, __m512i codes) {
    __m128i bytes = _mm512_cvtepi32_epi8(codes);
    if (m == 0xFFFF)
        _mm_storeu_si128((__m128i *)q, bytes);
    else
        _mm_mask_storeu_epi8(q, m, bytes);
}

/* ---------------------------------------------------------------------------- quantization */

/* Lane i of the result is the largest lane of v[i]: four rounds of pairwise lane shuffles
 * and maxima, 45 instructions for 16 blocks instead of a 9-instruction reduction per block. */
AVX512_INLINE __m512i lane_maxima16(__m512i v[16]) {
    static const int32_t LO[4][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30},
    };
    static const int32_t HI[4][16] = {
        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
        {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
        {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
        {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31},
    };
    for (int round = 0, n = 16; round < 4; round++, n /= 2) {
        __m512i lo = _mm512_loadu_si512(LO[round]), hi = _mm512_loadu_si512(HI[round]);
        for (int i = 0; i < n / 2; i++)
            v[i] = _mm512_max_epu32(_mm512_permutex2var_epi32(v[2 * i], lo, v[2 * i + 1]),
                                    _mm512_permutex2var_epi32(v[2 * i], hi, v[2 * i + 1]));
    }
    return v[0];
}

/* 16 whole blocks (512 values from element `off`; q is the base of the output, s points at
 * the 16 scale bytes) of one row: maxima of all 16 first, so the scales are computed
 * as one vector, then a second pass over the (L1-resident) input converts. */
AVX512_INLINE void quant_16_blocks(int dtype, const elem_fmt *f, const void *src, int64_t off,
                                   uint8_t *q, uint8_t *s, int mode) {
    __m512i amax[16];
    for (int b = 0; b < 16; b++)
        amax[b] = _mm512_max_epu32(abs_bits(load16(src, dtype, off + 32 * b, 0xFFFF)),
                                   abs_bits(load16(src, dtype, off + 32 * b + 16, 0xFFFF)));
    __m512i bytes = scale_bytes16(lane_maxima16(amax), mode, f->emax);
    _mm_storeu_si128((__m128i *)s, _mm512_cvtepi32_epi8(bytes));
    int32_t offsets[16], inv_bits[16];
    _mm512_storeu_si512(offsets, exponent_offset(bytes, f));
    _mm512_storeu_si512(inv_bits, _mm512_castps_si512(inv_scales16(bytes)));
    __mmask16 bad = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
    for (int b = 0; b < 16; b++) {
        int64_t o = off + 32 * b;
        __m512i x0 = load16(src, dtype, o, 0xFFFF), x1 = load16(src, dtype, o + 16, 0xFFFF);
        __m512i offset = _mm512_set1_epi32(offsets[b]);
        __m512i p0 = prepare16(x0, f), p1 = prepare16(x1, f);
        __mmask16 slow0, slow1;
        __m512i c0 = encode_fast16(p0, offset, f, &slow0);
        __m512i c1 = encode_fast16(p1, offset, f, &slow1);
        if (slow0 | slow1 | (bad >> b & 1)) {
            __m512 inv = _mm512_castsi512_ps(_mm512_set1_epi32(inv_bits[b]));
            c0 = _mm512_mask_mov_epi32(c0, slow0, to_fp8_16(x0, inv, f));
            c1 = _mm512_mask_mov_epi32(c1, slow1, to_fp8_16(x1, inv, f));
            if (bad >> b & 1) c0 = c1 = _mm512_set1_epi32(0x7F);
        }
        _mm256_storeu_si256((__m256i *)(q + o),
                            _mm256_set_m128i(_mm512_cvtepi32_epi8(c1), _mm512_cvtepi32_epi8(c0)));
    }
}

#define DUAL_SUB 512 /* columns per dual sub-tile: its prepared values (32 KiB) stay in L1 */

/* ------------------------------------------------- bf16 inputs: 32 lanes of 16 bits at a time
 *
 * A bf16 value is the top half of its fp32 bits, so the rounding of prepare16 can run on the
 * 16-bit patterns directly: (a + half - 1 + lsb) >> (mant_shift - 16) gives the same rounded
 * exponent/mantissa field as the fp32 form (the low 16 fp32 bits are zero). One zmm then holds a
 * whole block of 32 and every step costs half as much. Lanes that need the exact slow path are
 * rare; they go through the 32-bit to_fp8_16. */

typedef struct {
    __m512i half_minus_one, min_normal, max_code;
    int shift;
} fmt_bf16;

AVX512_INLINE fmt_bf16 bf16_format(const elem_fmt *f) {
    fmt_bf16 g;
    g.shift = f->mant_shift - 16;
    g.half_minus_one = _mm512_set1_epi16((short)((1 << (g.shift - 1)) - 1));
    g.min_normal = _mm512_set1_epi16((short)(1 << (23 - f->mant_shift)));
    g.max_code = _mm512_set1_epi16((short)f->max_code);
    return g;
}

/* Codes (16-bit lanes) of 32 bf16 values under per-lane exponent offsets (see exponent_offset):
 * the rounding of prepare16 on 16-bit patterns, then the rebias of encode_fast16. Lanes set in
 * *slow still need exact_codes32. */
/* The scale-independent rounding of 32 bf16 values: rounded exponent/mantissa fields. */
AVX512_INLINE __m512i round_bf16(__m512i x, const fmt_bf16 *g) {
    __m512i a = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi16(a, g->shift), _mm512_set1_epi16(1));
    return _mm512_srli_epi16(_mm512_add_epi16(_mm512_add_epi16(a, g->half_minus_one), lsb), g->shift);
}

/* Codes from rounded fields r under per-lane exponent offsets; x supplies the signs. */
AVX512_INLINE __m512i encode_rounded(__m512i r, __m512i x, __m512i offset, const fmt_bf16 *g, __mmask32 *slow) {
    __m512i t = _mm512_sub_epi16(r, offset);
    /* subnormal inputs (exponent field 0) take the exact path: tested on the input, because a
     * rounded field can carry into exponent 1 and look normal while rounding at the wrong bit */
    *slow = _mm512_cmplt_epi16_mask(t, g->min_normal) | _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x7F80));
    /* min(t, max_code) | (x >> 8 & 0x80) */
    return _mm512_ternarylogic_epi32(_mm512_min_epi16(t, g->max_code), _mm512_srli_epi16(x, 8),
                                     _mm512_set1_epi16(0x80), 0xF8);
}

AVX512_INLINE __m512i encode_bf16(__m512i x, __m512i offset, const fmt_bf16 *g, __mmask32 *slow) {
    return encode_rounded(round_bf16(x, g), x, offset, g, slow);
}

/* The exact codes of 32 bf16 values with per-half inverse scales, as 16-bit lanes. */
AVX512_INLINE __m512i exact_codes32(__m512i x, __m512 inv_lo, __m512 inv_hi, const elem_fmt *f) {
    __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(x)), 16);
    __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1)), 16);
    __m256i clo = _mm512_cvtepi32_epi16(to_fp8_16(lo, inv_lo, f));
    __m256i chi = _mm512_cvtepi32_epi16(to_fp8_16(hi, inv_hi, f));
    return _mm512_inserti64x4(_mm512_castsi256_si512(clo), chi, 1);
}

/* Two 16-lane 32-bit vectors as one 32-lane 16-bit vector (values fit in 16 bits). */
AVX512_INLINE __m512i narrow_pair(__m512i lo, __m512i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)), _mm512_cvtepi32_epi16(hi), 1);
}

AVX512_INLINE __m512i load32_bf16(const void *src, int64_t off, __mmask32 m) {
    const uint16_t *p = (const uint16_t *)src + off;
    return m == 0xFFFFFFFFu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
}

AVX512_INLINE void store32_codes(uint8_t *q, __mmask32 m, __m512i codes) {
    __m256i bytes = _mm512_cvtepi16_epi8(codes);
    if (m == 0xFFFFFFFFu)
        _mm256_storeu_si256((__m256i *)q, bytes);
    else
        _mm256_mask_storeu_epi8(q, m, bytes);
}

/* 64 codes (two 32-lane vectors) to 64 bytes. Large outputs use non-temporal stores: they
 * will not fit in cache anyway, and skipping the read-for-ownership of every output line saves
 * a third of the memory traffic of a quantization. */
AVX512_INLINE void store64_codes(uint8_t *q, __m512i lo, __m512i hi, int stream) {
    __m512i bytes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(lo)), _mm512_cvtepi16_epi8(hi), 1);
    if (stream && ((uintptr_t)q & 63) == 0)
        _mm512_stream_si512((void *)q, bytes);
    else
        _mm512_storeu_si512(q, bytes);
}

/* Largest 16-bit pattern of each 32-lane vector, in 32-bit lanes. */
AVX512_INLINE __m512i pair_max16(__m512i a) {
    return _mm512_max_epu32(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(a, 16));
}

/* Per-block scale bytes and 16-bit exponent offsets from 16 block maxima (16-bit patterns). */
AVX512_INLINE __m512i bf16_block_bytes(__m512i amax16_in_32, int mode, const elem_fmt *f) {
    return scale_bytes16(_mm512_slli_epi32(amax16_in_32, 16), mode, f->emax);
}

/* Codes of one row block of 32 bf16 values whose scale has the given exponent offset and
 * inverse-scale bits; bad marks a NaN/Inf block. */
AVX512_INLINE __m512i bf16_block_codes(const elem_fmt *f, const fmt_bf16 *g, const void *src, int64_t off,
                                       int32_t offset, int32_t inv_bits, int bad) {
    __m512i x = load32_bf16(src, off, 0xFFFFFFFFu);
    __mmask32 slow;
    __m512i codes = encode_bf16(x, _mm512_set1_epi16((short)offset), g, &slow);
    if (slow | bad) {
        __m512 inv = _mm512_castsi512_ps(_mm512_set1_epi32(inv_bits));
        codes = _mm512_mask_mov_epi16(codes, slow, exact_codes32(x, inv, inv, f));
        if (bad) codes = _mm512_set1_epi16(0x7F);
    }
    return codes;
}

/* 16 whole row blocks (512 bf16 values from element `off`; q is the base of the output, s
 * points at the 16 scale bytes). The maxima of all 16 blocks come first so that their scales
 * are one vector; the second loop rereads the input from L1 and converts. */
AVX512_INLINE void bf16_16_blocks(const elem_fmt *f, const fmt_bf16 *g, const void *src, int64_t off,
                                  uint8_t *q, uint8_t *s, int mode, int stream) {
    __m512i blk[16];
    for (int b = 0; b < 16; b++) {
        __m512i x = load32_bf16(src, off + 32 * b, 0xFFFFFFFFu);
        __m512i a = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
        blk[b] = pair_max16(a);
    }
    __m512i bytes = bf16_block_bytes(lane_maxima16(blk), mode, f);
    _mm_storeu_si128((__m128i *)s, _mm512_cvtepi32_epi8(bytes));
    int32_t offsets[16], inv_bits[16];
    _mm512_storeu_si512(offsets, exponent_offset(bytes, f));
    _mm512_storeu_si512(inv_bits, _mm512_castps_si512(inv_scales16(bytes)));
    __mmask16 bad = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
    for (int b = 0; b < 16; b += 2) { /* pairs: one 64-byte store per two blocks */
        __m512i lo = bf16_block_codes(f, g, src, off + 32 * b, offsets[b], inv_bits[b], bad >> b & 1);
        __m512i hi = bf16_block_codes(f, g, src, off + 32 * b + 32, offsets[b + 1], inv_bits[b + 1], bad >> (b + 1) & 1);
        store64_codes(q + off + 32 * b, lo, hi, stream);
    }
}

/* Column scales of up to 32 columns from their maxima (16-bit patterns): bytes stored, 16-bit
 * offsets, inverse scales of both halves and the NaN lanes returned. */
AVX512_INLINE void bf16_col_scales(__m512i amax, int mode, const elem_fmt *f, uint8_t *s, __mmask32 m,
                                   __m512i *offset, __m512 *inv_lo, __m512 *inv_hi, __mmask32 *bad) {
    __m512i lo = bf16_block_bytes(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(amax)), mode, f);
    __m512i hi = bf16_block_bytes(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(amax, 1)), mode, f);
    __m512i bytes = narrow_pair(lo, hi);
    store32_codes(s, m, bytes);
    *offset = narrow_pair(exponent_offset(lo, f), exponent_offset(hi, f));
    *inv_lo = inv_scales16(lo);
    *inv_hi = inv_scales16(hi);
    *bad = _mm512_cmpeq_epi16_mask(bytes, _mm512_set1_epi16(0xFF));
}

/* Codes of one row of up to 32 columns under column scales. */
AVX512_INLINE __m512i bf16_col_codes(const fmt_bf16 *g, const elem_fmt *f, __m512i x, __mmask32 m,
                                     __m512i offset, __m512 inv_lo, __m512 inv_hi, __mmask32 bad) {
    __mmask32 slow;
    __m512i codes = encode_bf16(x, offset, g, &slow);
    slow &= m;
    if (slow) codes = _mm512_mask_mov_epi16(codes, slow, exact_codes32(x, inv_lo, inv_hi, f));
    return _mm512_mask_mov_epi16(codes, bad, _mm512_set1_epi16(0x7F));
}

AVX512_INLINE __mmask32 lanes32(int n) {
    return n >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (n > 0 ? n : 0)) - 1u);
}

/* Two-pass tiles (column-wise and dual) read the input from memory in the first pass and
 * only write to it in the second; prefetching the next tile (128 bytes per 64 values here)
 * into L2 during the second pass keeps the reads going meanwhile. */
AVX512_INLINE void prefetch_next_bf16(const void *src, int64_t off, int64_t next) {
    if (!next) return;
    _mm_prefetch((const char *)((const uint16_t *)src + off + next), _MM_HINT_T1);
    _mm_prefetch((const char *)((const uint16_t *)src + off + next + 32), _MM_HINT_T1);
}

/* Column scales of a block of rows, walked row by row (rows lie 8 KiB apart: walking down a
 * column of them would keep every access in one L1 set). */
typedef struct {
    __m512i offset[COL_CHUNK / 32];
    __m512 inv_lo[COL_CHUNK / 32], inv_hi[COL_CHUNK / 32];
    __mmask32 bad[COL_CHUNK / 32];
} bf16_col_scale_set;

AVX512_INLINE void bf16_scale_set(const __m512i *amax, int ncols, int mode, const elem_fmt *f, uint8_t *s,
                                  bf16_col_scale_set *set) {
    for (int v = 0; v < (ncols + 31) / 32; v++)
        bf16_col_scales(amax[v], mode, f, s + 32 * v, lanes32(ncols - 32 * v), &set->offset[v], &set->inv_lo[v],
                        &set->inv_hi[v], &set->bad[v]);
}

AVX512_INLINE void bf16_cols(const elem_fmt *f, const void *src, int64_t width, int64_t row0, int nrows,
                             int64_t c0, int ncols, uint8_t *q, uint8_t *srow, int mode, int stream,
                             int64_t next) {
    fmt_bf16 g = bf16_format(f);
    int nv = (ncols + 31) / 32;
    __m512i amax[COL_CHUNK / 32];
    for (int v = 0; v < nv; v++) amax[v] = _mm512_setzero_si512();
    for (int r = 0; r < nrows; r++)
        for (int v = 0; v < nv; v++)
            amax[v] = _mm512_max_epu16(amax[v], _mm512_and_si512(load32_bf16(src, (row0 + r) * width + c0 + 32 * v,
                                                                             lanes32(ncols - 32 * v)),
                                                                 _mm512_set1_epi16(0x7FFF)));
    bf16_col_scale_set set;
    bf16_scale_set(amax, ncols, mode, f, srow + c0, &set);
    for (int r = 0; r < nrows; r++) {
        int v = 0;
        for (; v + 2 <= ncols / 32; v += 2) {
            int64_t off = (row0 + r) * width + c0 + 32 * v;
            prefetch_next_bf16(src, off, next);
            __m512i lo = bf16_col_codes(&g, f, load32_bf16(src, off, 0xFFFFFFFFu), 0xFFFFFFFFu, set.offset[v],
                                        set.inv_lo[v], set.inv_hi[v], set.bad[v]);
            __m512i hi = bf16_col_codes(&g, f, load32_bf16(src, off + 32, 0xFFFFFFFFu), 0xFFFFFFFFu,
                                        set.offset[v + 1], set.inv_lo[v + 1], set.inv_hi[v + 1], set.bad[v + 1]);
            store64_codes(q + off, lo, hi, stream);
        }
        for (; v < nv; v++) {
            int64_t off = (row0 + r) * width + c0 + 32 * v;
            __mmask32 m = lanes32(ncols - 32 * v);
            store32_codes(q + off, m, bf16_col_codes(&g, f, load32_bf16(src, off, m), m, set.offset[v],
                                                     set.inv_lo[v], set.inv_hi[v], set.bad[v]));
        }
    }
}

/* Dual for bf16: a block of rows x ncols columns (a multiple of 512, at most COL_CHUNK).
 *
 * The first pass only finds maxima: per row block (its scale goes straight to sr) and per
 * column. The second pass rounds each element once and rebiases it twice, for the row-wise and
 * the column-wise code; it rereads the tile from L2 while it prefetches the next tile, and it is
 * the compute-bound part, so it is kept lean:
 *   - the rebias saturates at zero (unsigned), which codes +-0 exactly, so only nonzero lanes
 *     whose code falls below the smallest normal need the exact path, one test for both codes;
 *   - subnormal inputs need no test of their own: their rounded field is at most min_normal,
 *     so with an offset >= 1 they fall below it, and a negative offset saturates every lane to
 *     zero. With offset 0 exactly, the lanes that reach min_normal are the subnormals of
 *     mantissa >= 120 (E4M3) or >= 112 (E5M2), whose exact code is min_normal as well (ties
 *     to even); test_dual_subnormal_inputs_under_tiny_scales checks every such tile;
 *   - NaN/Inf blocks are rare: their codes are patched after the pass instead of masked in it.
 * Rows are walked in long contiguous streams (the hardware prefetchers lose track of many
 * short ones). */
AVX512_INLINE void bf16_dual(const elem_fmt *f, const void *src, int64_t K, int64_t row0, int nrows, int64_t c0,
                             int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc, uint8_t *sc, int mode, int stream,
                             int64_t next) {
    fmt_bf16 g = bf16_format(f);
    int64_t nbk = K / BLOCK;
    int nv = ncols / 32;
    /* per row block: its 16-bit exponent offset, kept so the second pass broadcasts it from
     * memory; and which blocks are NaN/Inf */
    int16_t row_offset[BLOCK][COL_CHUNK / 32];
    uint16_t row_bad[BLOCK][COL_CHUNK / 512];
    __m512i amax[COL_CHUNK / 32];
    uint32_t any_row_bad = 0;
    for (int v = 0; v < nv; v++) amax[v] = _mm512_setzero_si512();
    for (int r = 0; r < nrows; r++) {
        for (int j = 0; j < ncols; j += 512) {
            __m512i blk[16];
            for (int b = 0; b < 16; b++) {
                __m512i a = _mm512_and_si512(load32_bf16(src, (row0 + r) * K + c0 + j + 32 * b, 0xFFFFFFFFu),
                                             _mm512_set1_epi16(0x7FFF));
                blk[b] = pair_max16(a);
                amax[j / 32 + b] = _mm512_max_epu16(amax[j / 32 + b], a);
            }
            __m512i bytes = bf16_block_bytes(lane_maxima16(blk), mode, f);
            __m512i offsets = exponent_offset(bytes, f);
            _mm_storeu_si128((__m128i *)(sr + (row0 + r) * nbk + (c0 + j) / BLOCK), _mm512_cvtepi32_epi8(bytes));
            _mm256_storeu_si256((__m256i *)&row_offset[r][j / 32], _mm512_cvtepi32_epi16(offsets));
            row_bad[r][j / 512] = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
            any_row_bad |= row_bad[r][j / 512];
        }
    }
    bf16_col_scale_set set;
    bf16_scale_set(amax, ncols, mode, f, sc + (row0 / BLOCK) * K + c0, &set);
    __mmask32 any_col_bad = 0;
    for (int v = 0; v < nv; v++) any_col_bad |= set.bad[v];
    const __m512i nonzero = _mm512_set1_epi16(0x7FFF), sign_bit = _mm512_set1_epi16(0x80);
    for (int r = 0; r < nrows; r++) {
        for (int v = 0; v < nv; v += 2) {
            int64_t off = (row0 + r) * K + c0 + 32 * v;
            prefetch_next_bf16(src, off, next);
            __m512i rows_out[2], cols_out[2];
            for (int h = 0; h < 2; h++) {
                __m512i x = load32_bf16(src, off + 32 * h, 0xFFFFFFFFu);
                __m512i rounded = round_bf16(x, &g);
                __m512i sign = _mm512_srli_epi16(x, 8);
                __m512i tr = _mm512_subs_epu16(rounded, _mm512_set1_epi16(row_offset[r][v + h]));
                __m512i tc = _mm512_subs_epu16(rounded, set.offset[v + h]);
                __mmask32 slow = _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(x, nonzero),
                                                              _mm512_min_epu16(tr, tc), g.min_normal);
                /* min(t, max_code) | (x >> 8 & 0x80) */
                rows_out[h] = _mm512_ternarylogic_epi32(_mm512_min_epu16(tr, g.max_code), sign, sign_bit, 0xF8);
                cols_out[h] = _mm512_ternarylogic_epi32(_mm512_min_epu16(tc, g.max_code), sign, sign_bit, 0xF8);
                if (slow) { /* rare: codes below the smallest normal, exactly */
                    __mmask32 nz = _mm512_test_epi16_mask(x, nonzero);
                    __mmask32 slow_r = _mm512_mask_cmplt_epu16_mask(nz, tr, g.min_normal);
                    __mmask32 slow_c = _mm512_mask_cmplt_epu16_mask(nz, tc, g.min_normal);
                    __m512 inv = _mm512_castsi512_ps(_mm512_set1_epi32((int)inv_scale_bits(
                        sr[(row0 + r) * nbk + (c0 + 32 * (v + h)) / BLOCK])));
                    if (slow_r) rows_out[h] = _mm512_mask_mov_epi16(rows_out[h], slow_r, exact_codes32(x, inv, inv, f));
                    if (slow_c)
                        cols_out[h] = _mm512_mask_mov_epi16(cols_out[h], slow_c,
                                                            exact_codes32(x, set.inv_lo[v + h], set.inv_hi[v + h], f));
                }
            }
            store64_codes(qr + off, rows_out[0], rows_out[1], stream);
            store64_codes(qc + off, cols_out[0], cols_out[1], stream);
        }
    }
    if (any_row_bad | any_col_bad) { /* NaN/Inf blocks: every code NaN */
        if (stream) _mm_sfence(); /* the patches below must land after the streamed codes */
        __m512i nan = _mm512_set1_epi16(0x7F);
        for (int r = 0; r < nrows; r++) {
            for (int v = 0; v < nv; v++) {
                int64_t off = (row0 + r) * K + c0 + 32 * v;
                if (row_bad[r][v / 16] >> (v % 16) & 1) store32_codes(qr + off, 0xFFFFFFFFu, nan);
                if (set.bad[v]) store32_codes(qc + off, set.bad[v], nan);
            }
        }
    }
}

AVX512_INLINE void quant_rows_body(int dtype, int elem, const void *src, int64_t r0, int64_t r1,
                                   int64_t n, uint8_t *q, uint8_t *s, int mode, int stream) {
    const elem_fmt *f = &FORMATS[elem];
    int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = 0;
        if (dtype == IN_BF16) {
            fmt_bf16 g = bf16_format(f);
            for (; b + 16 <= n / BLOCK; b += 16)
                bf16_16_blocks(f, &g, src, r * n + b * BLOCK, q, s + r * nb + b, mode, stream);
        }
        for (; b + 16 <= n / BLOCK; b += 16)
            quant_16_blocks(dtype, f, src, r * n + b * BLOCK, q, s + r * nb + b, mode);
        for (; b < nb; b++) {
            int64_t off = r * n + b * BLOCK;
            int len = (int)(n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK);
            __mmask16 m0 = lanes(len), m1 = lanes(len - 16);
            __m512i x0 = load16(src, dtype, off, m0);
            __m512i x1 = load16(src, dtype, off + 16, m1);
            uint32_t amax = _mm512_reduce_max_epu32(_mm512_max_epu32(abs_bits(x0), abs_bits(x1)));
            uint32_t byte = scale_byte(amax, mode, f->emax);
            s[r * nb + b] = (uint8_t)byte;
            if (byte == 0xFFu) { /* stores, not memset: a call would spill every vector constant */
                store_codes(q + off, m0, _mm512_set1_epi32(0x7F));
                store_codes(q + off + 16, m1, _mm512_set1_epi32(0x7F));
                continue;
            }
            __m512 inv = _mm512_set1_ps(f32_from_bits(inv_scale_bits(byte)));
            __m512i offset = exponent_offset(_mm512_set1_epi32((int)byte), f);
            store_codes(q + off, m0, encode16(prepare16(x0, f), offset, x0, inv, f));
            store_codes(q + off + 16, m1, encode16(prepare16(x1, f), offset, x1, inv, f));
        }
    }
}

/* Column-wise passes over a block of rows walk each row contiguously: first to find the column
 * maxima, then to convert. Walking down 32 rows 8 KiB apart instead would keep every address in
 * one L1 set and thrash it. */
AVX512_INLINE void quant_cols_body(int dtype, int elem, const void *src, int64_t width,
                                   int64_t row0, int nrows, int64_t c0, int ncols, uint8_t *q,
                                   uint8_t *srow, int mode, int stream, int64_t next) {
    /* the fp32/fp16 paths are bound by compute, not memory: prefetching there measured slower */
    const elem_fmt *f = &FORMATS[elem];
    if (dtype == IN_BF16) {
        bf16_cols(f, src, width, row0, nrows, c0, ncols, q, srow, mode, stream, next);
        return;
    }
    __m512i amax[COL_CHUNK / 16];
    __m512 inv[COL_CHUNK / 16];
    __m512i offset[COL_CHUNK / 16];
    __mmask16 bad[COL_CHUNK / 16];
    int nv = (ncols + 15) / 16;
    for (int v = 0; v < nv; v++) amax[v] = _mm512_setzero_si512();
    for (int r = 0; r < nrows; r++)
        for (int v = 0; v < nv; v++)
            amax[v] = _mm512_max_epu32(
                amax[v], abs_bits(load16(src, dtype, (row0 + r) * width + c0 + 16 * v, lanes(ncols - 16 * v))));
    for (int v = 0; v < nv; v++) {
        __m512i bytes = scale_bytes16(amax[v], mode, f->emax);
        store_codes(srow + c0 + 16 * v, lanes(ncols - 16 * v), bytes);
        inv[v] = inv_scales16(bytes);
        offset[v] = exponent_offset(bytes, f);
        bad[v] = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
    }
    __m512i nan = _mm512_set1_epi32(0x7F);
    for (int r = 0; r < nrows; r++)
        for (int v = 0; v < nv; v++) {
            int64_t off = (row0 + r) * width + c0 + 16 * v;
            __mmask16 m = lanes(ncols - 16 * v);
            __m512i x = load16(src, dtype, off, m);
            __m512i codes = encode16(prepare16(x, f), offset[v], x, inv[v], f);
            store_codes(q + off, m, _mm512_mask_mov_epi32(codes, bad[v], nan));
        }
}

/* One block of rows x up to DUAL_SUB columns (c0 a multiple of 32). The first pass converts
 * each row block for the row-wise copy while it is in registers, keeps the scale-independent
 * rounding of every element ("prep", 16 bits) and gathers the column maxima; the second pass
 * only rebiases the kept values for the column-wise copy, rereading the input just for the
 * rare lanes that land on element subnormals. */
AVX512_INLINE void quant_dual_sub(int dtype, const elem_fmt *f, const void *src, int64_t K,
                                  int64_t row0, int nrows, int64_t c0, int ncols, uint8_t *qr,
                                  uint8_t *sr, uint8_t *qc, uint8_t *sc, int mode) {
    int64_t nbk = (K + BLOCK - 1) / BLOCK;
    uint16_t prep[BLOCK][DUAL_SUB];
    __m512i amax[DUAL_SUB / 16];
    int nv = (ncols + 15) / 16;
    for (int v = 0; v < nv; v++) amax[v] = _mm512_setzero_si512();
    for (int r = 0; r < nrows; r++) {
        if (ncols == DUAL_SUB) { /* 16 whole row blocks: scales as one vector, as in quant_16_blocks */
            int64_t off = (row0 + r) * K + c0;
            __m512i blk[16];
            for (int b = 0; b < 16; b++) {
                __m512i x0 = load16(src, dtype, off + 32 * b, 0xFFFF);
                __m512i x1 = load16(src, dtype, off + 32 * b + 16, 0xFFFF);
                __m512i a0 = abs_bits(x0), a1 = abs_bits(x1);
                amax[2 * b] = _mm512_max_epu32(amax[2 * b], a0);
                amax[2 * b + 1] = _mm512_max_epu32(amax[2 * b + 1], a1);
                blk[b] = _mm512_max_epu32(a0, a1);
                _mm256_storeu_si256((__m256i *)&prep[r][32 * b], _mm512_cvtepi32_epi16(prepare16(x0, f)));
                _mm256_storeu_si256((__m256i *)&prep[r][32 * b + 16], _mm512_cvtepi32_epi16(prepare16(x1, f)));
            }
            __m512i bytes = scale_bytes16(lane_maxima16(blk), mode, f->emax);
            _mm_storeu_si128((__m128i *)(sr + (row0 + r) * nbk + c0 / BLOCK), _mm512_cvtepi32_epi8(bytes));
            int32_t offsets[16], inv_bits[16];
            _mm512_storeu_si512(offsets, exponent_offset(bytes, f));
            _mm512_storeu_si512(inv_bits, _mm512_castps_si512(inv_scales16(bytes)));
            __mmask16 bad = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
            for (int b = 0; b < 16; b++) {
                __m512i offset = _mm512_set1_epi32(offsets[b]);
                __mmask16 slow0, slow1;
                __m512i c0v = encode_fast16(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&prep[r][32 * b])), offset, f, &slow0);
                __m512i c1v = encode_fast16(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&prep[r][32 * b + 16])), offset, f, &slow1);
                if (slow0 | slow1 | (bad >> b & 1)) {
                    __m512 inv = _mm512_castsi512_ps(_mm512_set1_epi32(inv_bits[b]));
                    c0v = _mm512_mask_mov_epi32(c0v, slow0, to_fp8_16(load16(src, dtype, off + 32 * b, 0xFFFF), inv, f));
                    c1v = _mm512_mask_mov_epi32(c1v, slow1, to_fp8_16(load16(src, dtype, off + 32 * b + 16, 0xFFFF), inv, f));
                    if (bad >> b & 1) c0v = c1v = _mm512_set1_epi32(0x7F);
                }
                _mm256_storeu_si256((__m256i *)(qr + off + 32 * b),
                                    _mm256_set_m128i(_mm512_cvtepi32_epi8(c1v), _mm512_cvtepi32_epi8(c0v)));
            }
            continue;
        }
        for (int j = 0; j < ncols; j += BLOCK) {
            int64_t off = (row0 + r) * K + c0 + j;
            int len = ncols - j < BLOCK ? ncols - j : BLOCK;
            __mmask16 m0 = lanes(len), m1 = lanes(len - 16);
            __m512i x0 = load16(src, dtype, off, m0), x1 = load16(src, dtype, off + 16, m1);
            __m512i a0 = abs_bits(x0), a1 = abs_bits(x1);
            __m512i p0 = prepare16(x0, f), p1 = prepare16(x1, f);
            _mm256_storeu_si256((__m256i *)&prep[r][j], _mm512_cvtepi32_epi16(p0));
            _mm256_storeu_si256((__m256i *)&prep[r][j + 16], _mm512_cvtepi32_epi16(p1));
            amax[j / 16] = _mm512_max_epu32(amax[j / 16], a0);
            amax[j / 16 + 1] = _mm512_max_epu32(amax[j / 16 + 1], a1);
            uint32_t byte = scale_byte(_mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1)), mode, f->emax);
            sr[(row0 + r) * nbk + (c0 + j) / BLOCK] = (uint8_t)byte;
            if (byte == 0xFFu) {
                store_codes(qr + off, m0, _mm512_set1_epi32(0x7F));
                store_codes(qr + off + 16, m1, _mm512_set1_epi32(0x7F));
                continue;
            }
            __m512 inv = _mm512_set1_ps(f32_from_bits(inv_scale_bits(byte)));
            __m512i offset = exponent_offset(_mm512_set1_epi32((int)byte), f);
            store_codes(qr + off, m0, encode16(p0, offset, x0, inv, f));
            store_codes(qr + off + 16, m1, encode16(p1, offset, x1, inv, f));
        }
    }
    uint8_t *scrow = sc + (row0 / BLOCK) * K + c0;
    __m512 inv[DUAL_SUB / 16];
    __m512i offset[DUAL_SUB / 16];
    __mmask16 bad[DUAL_SUB / 16];
    for (int v = 0; v < nv; v++) {
        __m512i bytes = scale_bytes16(amax[v], mode, f->emax);
        store_codes(scrow + 16 * v, lanes(ncols - 16 * v), bytes);
        inv[v] = inv_scales16(bytes);
        offset[v] = exponent_offset(bytes, f);
        bad[v] = _mm512_cmpeq_epi32_mask(bytes, _mm512_set1_epi32(0xFF));
    }
    __m512i nan = _mm512_set1_epi32(0x7F);
    for (int r = 0; r < nrows; r++)
        for (int v = 0; v < nv; v++) {
            int64_t off = (row0 + r) * K + c0 + 16 * v;
            __mmask16 m = lanes(ncols - 16 * v), slow;
            __m512i p = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)&prep[r][16 * v]));
            __m512i codes = encode_fast16(p, offset[v], f, &slow);
            if (slow & m)
                codes = _mm512_mask_mov_epi32(codes, slow, to_fp8_16(load16(src, dtype, off, m), inv[v], f));
            store_codes(qc + off, m, _mm512_mask_mov_epi32(codes, bad[v], nan));
        }
}

AVX512_INLINE void quant_dual_body(int dtype, int elem, const void *src, int64_t K, int64_t row0,
                                   int nrows, int64_t c0, int ncols, uint8_t *qr, uint8_t *sr,
                                   uint8_t *qc, uint8_t *sc, int mode, int stream, int64_t next) {
    if (dtype == IN_BF16 && ncols % 512 == 0 && K % BLOCK == 0) {
        bf16_dual(&FORMATS[elem], src, K, row0, nrows, c0, ncols, qr, sr, qc, sc, mode, stream, next);
        return;
    }
    for (int j = 0; j < ncols; j += DUAL_SUB) {
        int n = ncols - j < DUAL_SUB ? ncols - j : DUAL_SUB;
        quant_dual_sub(dtype, &FORMATS[elem], src, K, row0, nrows, c0 + j, n, qr, sr, qc, sc, mode);
    }
}

/* -------------------------------------------------------------------------- dequantization */

/* 16 FP8 codes to their exact fp32 values. */
AVX512_INLINE __m512 fp8_values16(const uint8_t *q, __mmask16 m, int elem) {
    __m128i raw = m == 0xFFFF ? _mm_loadu_si128((const __m128i *)q) : _mm_maskz_loadu_epi8(m, q);
    __m512i c = _mm512_cvtepu8_epi32(raw);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
    __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    __m512i v;
    if (elem == ELEM_E4M3) {
        __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
        __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(mag, _mm512_set1_epi32(7))),
                                   _mm512_set1_ps(0.001953125f));
        __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(8));
        v = _mm512_mask_mov_epi32(normal, is_sub, _mm512_castps_si512(sub));
        v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                                  _mm512_set1_epi32(0x7FC00000));
    } else {
        __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 21), _mm512_set1_epi32(112 << 23));
        __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(mag, _mm512_set1_epi32(3))),
                                   _mm512_set1_ps(1.52587890625e-5f));
        __mmask16 is_sub = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(4));
        v = _mm512_mask_mov_epi32(normal, is_sub, _mm512_castps_si512(sub));
        v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7C)),
                                  _mm512_set1_epi32(0x7F800000));
        v = _mm512_mask_mov_epi32(v, _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7C)),
                                  _mm512_set1_epi32(0x7FC00000));
    }
    return _mm512_castsi512_ps(_mm512_or_si512(sign, v));
}

AVX512_INLINE void store_out16(void *out, int out_dtype, int64_t off, __mmask16 m, __m512 v) {
    if (out_dtype == OUT_F32) {
        if (m == 0xFFFF)
            _mm512_storeu_ps((float *)out + off, v);
        else
            _mm512_mask_storeu_ps((float *)out + off, m, v);
        return;
    }
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs_bits(b), _mm512_set1_epi32(0x7F800000));
    __m256i halves = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
    if (m == 0xFFFF)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + off), halves);
    else
        _mm256_mask_storeu_epi16((uint16_t *)out + off, m, halves);
}

AVX512_INLINE __m512 scale_values16(const uint8_t *s, __mmask16 m) {
    __m512i byte = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, s));
    __m512i v = _mm512_slli_epi32(byte, 23);
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(byte, _mm512_setzero_si512()),
                              _mm512_set1_epi32(0x00400000));
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(byte, _mm512_set1_epi32(0xFF)),
                              _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(v);
}

AVX512_INLINE void dequant_rows_body(int out_dtype, int elem, const uint8_t *q, const uint8_t *s,
                                     int64_t r0, int64_t r1, int64_t n, void *out) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = r * n + b * BLOCK;
            int len = (int)(n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK);
            __mmask16 m0 = lanes(len), m1 = lanes(len - 16);
            __m512 sc = _mm512_set1_ps(scale_value(s[r * nb + b]));
            store_out16(out, out_dtype, off, m0, _mm512_mul_ps(fp8_values16(q + off, m0, elem), sc));
            if (m1)
                store_out16(out, out_dtype, off + 16, m1,
                            _mm512_mul_ps(fp8_values16(q + off + 16, m1, elem), sc));
        }
    }
}

AVX512_INLINE void dequant_cols_body(int out_dtype, int elem, const uint8_t *q, const uint8_t *srow,
                                     int64_t width, int64_t row0, int nrows, int64_t c0, int ncols,
                                     void *out) {
    __m512 sc[COL_CHUNK / 16]; /* row by row, not down the columns: see quant_cols_body */
    for (int j = 0; j < ncols; j += 16) sc[j / 16] = scale_values16(srow + c0 + j, lanes(ncols - j));
    for (int r = 0; r < nrows; r++)
        for (int j = 0; j < ncols; j += 16) {
            int64_t off = (row0 + r) * width + c0 + j;
            __mmask16 m = lanes(ncols - j);
            store_out16(out, out_dtype, off, m, _mm512_mul_ps(fp8_values16(q + off, m, elem), sc[j / 16]));
        }
}

/* ----------------------------------------------- entry points with constant dtype and format */

#define SPECIALIZE(BODY, dtype, elem, ...)                                                     \
    do {                                                                                       \
        switch ((dtype) * 2 + (elem)) {                                                        \
        case 0: BODY(0, ELEM_E4M3, __VA_ARGS__); break;                                        \
        case 1: BODY(0, ELEM_E5M2, __VA_ARGS__); break;                                        \
        case 2: BODY(1, ELEM_E4M3, __VA_ARGS__); break;                                        \
        case 3: BODY(1, ELEM_E5M2, __VA_ARGS__); break;                                        \
        case 4: BODY(2, ELEM_E4M3, __VA_ARGS__); break;                                        \
        default: BODY(2, ELEM_E5M2, __VA_ARGS__); break;                                       \
        }                                                                                      \
    } while (0)

AVX512 static void quant_rows(const void *src, int dtype, int64_t r0, int64_t r1, int64_t n,
                              uint8_t *q, uint8_t *s, int elem, int mode, int stream) {
    SPECIALIZE(quant_rows_body, dtype, elem, src, r0, r1, n, q, s, mode, stream);
    if (stream) _mm_sfence();
}

AVX512 static void quant_cols(const void *src, int dtype, int64_t width, int64_t row0, int nrows,
                              int64_t c0, int ncols, uint8_t *q, uint8_t *srow, int elem, int mode,
                              int stream, int64_t next) {
    SPECIALIZE(quant_cols_body, dtype, elem, src, width, row0, nrows, c0, ncols, q, srow, mode, stream, next);
    if (stream) _mm_sfence();
}

AVX512 static void quant_dual(const void *src, int dtype, int64_t K, int64_t row0, int nrows,
                              int64_t c0, int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc,
                              uint8_t *sc, int elem, int mode, int stream, int64_t next) {
    SPECIALIZE(quant_dual_body, dtype, elem, src, K, row0, nrows, c0, ncols, qr, sr, qc, sc, mode, stream, next);
    if (stream) _mm_sfence();
}

AVX512 static void dequant_rows(const uint8_t *q, const uint8_t *s, int64_t r0, int64_t r1,
                                int64_t n, int elem, void *out, int out_dtype) {
    SPECIALIZE(dequant_rows_body, out_dtype, elem, q, s, r0, r1, n, out);
}

AVX512 static void dequant_cols(const uint8_t *q, const uint8_t *srow, int64_t width, int64_t row0,
                                int nrows, int64_t c0, int ncols, int elem, void *out, int out_dtype) {
    SPECIALIZE(dequant_cols_body, out_dtype, elem, q, srow, width, row0, nrows, c0, ncols, out);
}

const mx_kernels MX_AVX512 = {"avx512", quant_rows, quant_cols, quant_dual, dequant_rows,
                              dequant_cols};
#endif

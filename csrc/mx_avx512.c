/*
 * AVX-512 implementation of the MX tile kernels (see mx_common.h for the table).
 *
 * The same bit-level algorithm as mx_generic.c, 16 fp32 lanes at a time, with masked loads and
 * stores for partial blocks. Only compiled for x86-64 and only called after the loader has
 * checked the processor for AVX-512 F/BW/VL/DQ.
 */
#include "mx_common.h"

#ifdef HP_HAVE_AVX512
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq")))

AVX512_INLINE __mmask16 lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
}

/* 16 values (fewer under the mask, zeros elsewhere) as fp32 bits. */
AVX512_INLINE __m512i load16(const void *src, int dtype, int64_t off, __mmask16 m) {
    if (dtype == IN_F32) return _mm512_maskz_loadu_epi32(m, (const uint32_t *)src + off);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)src + off);
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
    return _mm512_or_si512(_mm512_srli_epi32(r, f->mant_shift), sign);
}

/* fp8 codes of prepared lanes for scales whose exponent field offsets are `offset` (see
 * exponent_offset); x and inv serve the lanes that need the exact slow path. */
AVX512_INLINE __m512i encode16(__m512i prep, __m512i offset, __m512i x, __m512 inv, const elem_fmt *f) {
    __m512i r = _mm512_and_si512(prep, _mm512_set1_epi32(0x7FFF));
    __m512i t = _mm512_sub_epi32(r, offset);
    __m512i min_normal = _mm512_set1_epi32(1 << (23 - f->mant_shift));
    __mmask16 slow = _mm512_cmplt_epi32_mask(t, min_normal) | _mm512_cmplt_epi32_mask(r, min_normal);
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(prep, 8), _mm512_set1_epi32(0x80));
    __m512i code = _mm512_or_si512(_mm512_min_epi32(t, _mm512_set1_epi32(f->max_code)), sign);
    if (slow) code = _mm512_mask_mov_epi32(code, slow, to_fp8_16(x, inv, f));
    return code;
}

/* What a scale byte subtracts from the prepared exponent/mantissa field. */
AVX512_INLINE __m512i exponent_offset(__m512i byte, const elem_fmt *f) {
    __m512i e = _mm512_sub_epi32(byte, _mm512_set1_epi32(127));
    return _mm512_add_epi32(_mm512_slli_epi32(e, 23 - f->mant_shift), _mm512_set1_epi32(f->rebias));
}

AVX512_INLINE void store_codes(uint8_t *q, __mmask16 m, __m512i codes) {
    _mm512_mask_cvtepi32_storeu_epi8(q, m, codes);
}

/* ---------------------------------------------------------------------------- quantization */

AVX512_INLINE void quant_rows_body(int dtype, int elem, const void *src, int64_t r0, int64_t r1,
                                   int64_t n, uint8_t *q, uint8_t *s, int mode) {
    const elem_fmt *f = &FORMATS[elem];
    int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int64_t off = r * n + b * BLOCK;
            int len = (int)(n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK);
            __mmask16 m0 = lanes(len), m1 = lanes(len - 16);
            __m512i x0 = load16(src, dtype, off, m0);
            __m512i x1 = load16(src, dtype, off + 16, m1);
            uint32_t amax = _mm512_reduce_max_epu32(_mm512_max_epu32(abs_bits(x0), abs_bits(x1)));
            uint32_t byte = scale_byte(amax, mode, f->emax);
            s[r * nb + b] = (uint8_t)byte;
            if (byte == 0xFFu) {
                memset(q + off, 0x7F, (size_t)len);
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
                                   uint8_t *srow, int mode) {
    const elem_fmt *f = &FORMATS[elem];
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

/* One block of rows x a chunk of columns (c0 a multiple of 32): the first pass converts each
 * row block for the row-wise copy while it is in registers and gathers the column maxima; the
 * second rereads the tile (from L1/L2) for the column-wise copy. */
AVX512_INLINE void quant_dual_body(int dtype, int elem, const void *src, int64_t K, int64_t row0,
                                   int nrows, int64_t c0, int ncols, uint8_t *qr, uint8_t *sr,
                                   uint8_t *qc, uint8_t *sc, int mode) {
    const elem_fmt *f = &FORMATS[elem];
    int64_t nbk = (K + BLOCK - 1) / BLOCK;
    __m512i amax[COL_CHUNK / 16];
    int nv = (ncols + 15) / 16;
    for (int v = 0; v < nv; v++) amax[v] = _mm512_setzero_si512();
    for (int r = 0; r < nrows; r++) {
        for (int j = 0; j < ncols; j += BLOCK) {
            int64_t off = (row0 + r) * K + c0 + j;
            int len = ncols - j < BLOCK ? ncols - j : BLOCK;
            __mmask16 m0 = lanes(len), m1 = lanes(len - 16);
            __m512i x0 = load16(src, dtype, off, m0), x1 = load16(src, dtype, off + 16, m1);
            __m512i a0 = abs_bits(x0), a1 = abs_bits(x1);
            amax[j / 16] = _mm512_max_epu32(amax[j / 16], a0);
            if (m1) amax[j / 16 + 1] = _mm512_max_epu32(amax[j / 16 + 1], a1);
            uint32_t byte = scale_byte(_mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1)), mode, f->emax);
            sr[(row0 + r) * nbk + (c0 + j) / BLOCK] = (uint8_t)byte;
            if (byte == 0xFFu) {
                memset(qr + off, 0x7F, (size_t)len);
                continue;
            }
            __m512 inv = _mm512_set1_ps(f32_from_bits(inv_scale_bits(byte)));
            __m512i offset = exponent_offset(_mm512_set1_epi32((int)byte), f);
            store_codes(qr + off, m0, encode16(prepare16(x0, f), offset, x0, inv, f));
            store_codes(qr + off + 16, m1, encode16(prepare16(x1, f), offset, x1, inv, f));
        }
    }
    uint8_t *scrow = sc + (row0 / BLOCK) * K + c0;
    __m512 inv[COL_CHUNK / 16];
    __m512i offset[COL_CHUNK / 16];
    __mmask16 bad[COL_CHUNK / 16];
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
            __mmask16 m = lanes(ncols - 16 * v);
            __m512i x = load16(src, dtype, off, m);
            __m512i codes = encode16(prepare16(x, f), offset[v], x, inv[v], f);
            store_codes(qc + off, m, _mm512_mask_mov_epi32(codes, bad[v], nan));
        }
}

/* -------------------------------------------------------------------------- dequantization */

/* 16 FP8 codes to their exact fp32 values. */
AVX512_INLINE __m512 fp8_values16(const uint8_t *q, __mmask16 m, int elem) {
    __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, q));
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
        _mm512_mask_storeu_ps((float *)out + off, m, v);
        return;
    }
    __m512i b = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs_bits(b), _mm512_set1_epi32(0x7F800000));
    _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)out + off, m, _mm512_mask_mov_epi32(rounded, nan, quiet));
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
    for (int j = 0; j < ncols; j += 16) {
        __mmask16 m = lanes(ncols - j);
        __m512 sc = scale_values16(srow + c0 + j, m);
        for (int r = 0; r < nrows; r++) {
            int64_t off = (row0 + r) * width + c0 + j;
            store_out16(out, out_dtype, off, m, _mm512_mul_ps(fp8_values16(q + off, m, elem), sc));
        }
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
                              uint8_t *q, uint8_t *s, int elem, int mode) {
    SPECIALIZE(quant_rows_body, dtype, elem, src, r0, r1, n, q, s, mode);
}

AVX512 static void quant_cols(const void *src, int dtype, int64_t width, int64_t row0, int nrows,
                              int64_t c0, int ncols, uint8_t *q, uint8_t *srow, int elem, int mode) {
    SPECIALIZE(quant_cols_body, dtype, elem, src, width, row0, nrows, c0, ncols, q, srow, mode);
}

AVX512 static void quant_dual(const void *src, int dtype, int64_t K, int64_t row0, int nrows,
                              int64_t c0, int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc,
                              uint8_t *sc, int elem, int mode) {
    SPECIALIZE(quant_dual_body, dtype, elem, src, K, row0, nrows, c0, ncols, qr, sr, qc, sc, mode);
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

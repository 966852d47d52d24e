/*
 * Portable C implementation of the MX tile kernels (see mx_common.h for the table).
 *
 * Everything works on the IEEE bits of fp32 values in integer registers, written so that GCC
 * auto-vectorizes it; the entry points are compiled for x86-64-v3 and baseline x86-64
 * (HP_ISA_CLONES_AVX2: the tables MX_AVX2 and MX_GENERIC of [Note: one ISA choice]). It is the
 * fallback where AVX-512 is missing and the second implementation that the tests hold byte-equal
 * to the reference.
 * No -ffast-math: the subnormal path relies on exact IEEE rounding.
 */
#include "mx_common.h"

/* Calls BODY(dtype, elem, ...) with compile-time constant dtype and elem. */
#define SPECIALIZE(BODY, dtype, elem, ...)                                                     \
    do {                                                                                       \
        switch ((dtype) * 2 + (elem)) {                                                        \
        case 0: BODY(IN_F32, ELEM_E4M3, __VA_ARGS__); break;                                   \
        case 1: BODY(IN_F32, ELEM_E5M2, __VA_ARGS__); break;                                   \
        case 2: BODY(IN_BF16, ELEM_E4M3, __VA_ARGS__); break;                                  \
        case 3: BODY(IN_BF16, ELEM_E5M2, __VA_ARGS__); break;                                  \
        case 4: BODY(IN_F16, ELEM_E4M3, __VA_ARGS__); break;                                   \
        default: BODY(IN_F16, ELEM_E5M2, __VA_ARGS__); break;                                  \
        }                                                                                      \
    } while (0)

#define TILE_COLS 256 /* columns of one column-wise tile: 32 rows x 256 fp32 fit in L1 */
#define DUAL_COLS 128 /* columns of one dual tile */

/* IEEE half bits -> fp32 bits, exact, including subnormals, Inf and NaN. */
HP_INLINE uint32_t half_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);
    uint32_t special = sign | 0x7F800000u | (mant << 13);
    uint32_t sub = sign | bits_from_f32((float)(int)mant * 5.9604644775390625e-8f); /* m * 2^-24 */
    return select_bits(mask_if(exp == 0), sub, select_bits(mask_if(exp == 31), special, normal));
}

/* Load n values starting at element index `off` of `src` as fp32 bits. */
HP_INLINE void load_bits(const void *src, int dtype, int64_t off, int n, uint32_t *dst) {
    if (dtype == IN_F32) {
        const uint32_t *s = (const uint32_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = s[i];
    } else if (dtype == IN_BF16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = (uint32_t)s[i] << 16;
    } else {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = half_to_f32_bits(s[i]);
    }
}

/* One element: x (fp32 bits) times the inverse scale, to an FP8 code. */
HP_INLINE uint8_t to_fp8(uint32_t x, float inv_scale, const elem_fmt *f) {
    uint32_t v = bits_from_f32(f32_from_bits(x) * inv_scale);
    uint32_t sign = (v >> 24) & 0x80u;
    uint32_t a = v & 0x7FFFFFFFu;
    a = a < f->max_bits ? a : f->max_bits; /* saturate */
    /* normal: round the mantissa to nearest even, then rebias the exponent */
    uint32_t r = a + ((1u << (f->mant_shift - 1)) - 1u) + ((a >> f->mant_shift) & 1u);
    uint32_t normal = (r >> f->mant_shift) - (uint32_t)f->rebias;
    /* subnormal: adding a magic value makes the FPU round to the subnormal step */
    uint32_t sub = bits_from_f32(f32_from_bits(a) + f32_from_bits(f->magic_bits)) - f->magic_bits;
    return (uint8_t)(sign | select_bits(mask_if(a >= f->normal_bits), normal, sub));
}

/* What a scale byte subtracts from an element's rounded exponent/mantissa field. */
HP_INLINE int32_t exponent_offset(uint32_t byte, const elem_fmt *f) {
    return ((int32_t)byte - 127) * (1 << (23 - f->mant_shift)) + f->rebias;
}

/* The fast conversion (see prepare16 in mx_avx512.c): rounding |x| to the element's mantissa
 * width does not depend on the power-of-two scale, which then only rebiases the exponent
 * field. Element x[i] uses offset[i * stride] (stride 0: one scale for the run). Returns
 * nonzero when some element lands on an element subnormal (or is an fp32 subnormal): that run
 * must be redone exactly. Branch-free, so that it vectorizes. */
HP_INLINE uint32_t fast_codes(const uint32_t *x, int n, const int32_t *offset, int stride, const elem_fmt *f,
                              uint8_t *q) {
    const int shift = f->mant_shift, min_normal = 1 << (23 - shift);
    uint32_t slow = 0;
    for (int i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu;
        int32_t r = (int32_t)((a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift);
        int32_t t = r - offset[i * stride];
        /* subnormal inputs are tested unrounded: rounding can carry them into exponent 1 */
        slow |= (uint32_t)(t < min_normal) | (uint32_t)(a < 0x00800000u);
        int32_t c = t < f->max_code ? t : f->max_code;
        q[i] = (uint8_t)((uint32_t)c | ((x[i] >> 24) & 0x80u));
    }
    return slow;
}

HP_INLINE void convert(const uint32_t *x, int n, uint32_t byte, const elem_fmt *f, uint8_t *q) {
    if (byte == 0xFFu) {
        for (int i = 0; i < n; i++) q[i] = 0x7F; /* a loop, not memset: a call would spill */
        return;
    }
    int32_t offset = exponent_offset(byte, f);
    if (!fast_codes(x, n, &offset, 0, f, q)) return;
    float inv = f32_from_bits(inv_scale_bits(byte));
    for (int i = 0; i < n; i++) q[i] = to_fp8(x[i], inv, f);
}

/* One row of a column-wise tile: element j scaled by column j's byte. */
HP_INLINE void convert_cols(const uint32_t *x, int n, const uint32_t *bytes, const int32_t *offsets,
                            const float *inv, int any_bad, const elem_fmt *f, uint8_t *q) {
    if (fast_codes(x, n, offsets, 1, f, q))
        for (int j = 0; j < n; j++) q[j] = to_fp8(x[j], inv[j], f);
    if (any_bad)
        for (int j = 0; j < n; j++)
            if (bytes[j] == 0xFFu) q[j] = 0x7F;
}

HP_INLINE uint32_t block_amax(const uint32_t *x, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* fp32 bits of an FP8 code's value (exact). NaN codes give a quiet NaN. */
HP_INLINE uint32_t fp8_to_f32_bits(uint8_t c, int elem) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t m = c & 0x7Fu;
    uint32_t v;
    if (elem == ELEM_E4M3) {
        uint32_t normal = (m << 20) + (120u << 23);
        uint32_t sub = bits_from_f32((float)(int)(m & 7u) * 0.001953125f); /* m * 2^-9 */
        v = select_bits(mask_if((m >> 3) == 0), sub, normal);
        v = select_bits(mask_if(m == 0x7Fu), 0x7FC00000u, v);
    } else {
        uint32_t normal = (m << 21) + (112u << 23);
        uint32_t sub = bits_from_f32((float)(int)(m & 3u) * 1.52587890625e-5f); /* m * 2^-16 */
        v = select_bits(mask_if((m >> 2) == 0), sub, normal);
        v = select_bits(mask_if(m == 0x7Cu), 0x7F800000u, v);
        v = select_bits(mask_if(m > 0x7Cu), 0x7FC00000u, v);
    }
    return sign | v;
}

HP_INLINE uint16_t f32_to_bf16_rne(uint32_t b) {
    uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (b >> 16) | 0x40u;
    return (uint16_t)select_bits(mask_if((b & 0x7FFFFFFFu) > 0x7F800000u), quiet_nan, rounded);
}

/* ---------------------------------------------------------------- row-wise (axis = last) */

HP_INLINE void quant_rows_body(int dtype, int elem, const void *src, int64_t r0, int64_t r1,
                               int64_t n, uint8_t *q, uint8_t *s, int mode) {
    const elem_fmt *f = &FORMATS[elem];
    int64_t nb = (n + BLOCK - 1) / BLOCK;
    uint32_t buf[BLOCK];
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = 0;
        for (; b < n / BLOCK; b++) {
            int64_t off = r * n + b * BLOCK;
            load_bits(src, dtype, off, BLOCK, buf);
            uint32_t byte = scale_byte(block_amax(buf, BLOCK), mode, f->emax);
            s[r * nb + b] = (uint8_t)byte;
            convert(buf, BLOCK, byte, f, q + off);
        }
        if (b < nb) { /* trailing partial block */
            int len = (int)(n - b * BLOCK);
            int64_t off = r * n + b * BLOCK;
            load_bits(src, dtype, off, len, buf);
            uint32_t byte = scale_byte(block_amax(buf, len), mode, f->emax);
            s[r * nb + b] = (uint8_t)byte;
            convert(buf, len, byte, f, q + off);
        }
    }
}

HP_INLINE void quant_rows_range_body(const void *src, int dtype, int64_t r0, int64_t r1, int64_t n,
                                     uint8_t *q, uint8_t *s, int elem, int mode, int stream) {
    (void)stream;
    SPECIALIZE(quant_rows_body, dtype, elem, src, r0, r1, n, q, s, mode);
}
HP_ISA_CLONES_AVX2(void, quant_rows_range,
                   (const void *src, int dtype, int64_t r0, int64_t r1, int64_t n, uint8_t *q,
                    uint8_t *s, int elem, int mode, int stream),
                   (src, dtype, r0, r1, n, q, s, elem, mode, stream))


/* ------------------------------------------------- column-wise: blocks run down the rows */

/* One task: rows [row0, row0+nrows) (one block, nrows <= 32) x columns [c0, c0+ncols). */
HP_INLINE void quant_cols_body(int dtype, int elem, const void *src, int64_t width, int64_t row0,
                               int nrows, int64_t c0, int ncols, uint8_t *q, uint8_t *srow,
                               int mode) {
    const elem_fmt *f = &FORMATS[elem];
    uint32_t buf[BLOCK][TILE_COLS];
    uint32_t amax[TILE_COLS];
    uint32_t bytes[TILE_COLS];
    int32_t offsets[TILE_COLS];
    float inv[TILE_COLS];
    for (int j = 0; j < ncols; j++) amax[j] = 0;
    for (int r = 0; r < nrows; r++) {
        load_bits(src, dtype, (row0 + r) * width + c0, ncols, buf[r]);
        for (int j = 0; j < ncols; j++) {
            uint32_t a = buf[r][j] & 0x7FFFFFFFu;
            amax[j] = a > amax[j] ? a : amax[j];
        }
    }
    int any_bad = 0;
    for (int j = 0; j < ncols; j++) {
        bytes[j] = scale_byte(amax[j], mode, f->emax);
        srow[c0 + j] = (uint8_t)bytes[j];
        offsets[j] = exponent_offset(bytes[j], f);
        inv[j] = f32_from_bits(inv_scale_bits(bytes[j]));
        any_bad |= bytes[j] == 0xFFu;
    }
    for (int r = 0; r < nrows; r++)
        convert_cols(buf[r], ncols, bytes, offsets, inv, any_bad, f, q + (row0 + r) * width + c0);
}

HP_INLINE void quant_cols_tile_body(const void *src, int dtype, int64_t width, int64_t row0, int nrows,
                                    int64_t c0, int ncols, uint8_t *q, uint8_t *srow, int elem, int mode,
                                    int stream, int64_t next) {
    (void)stream;
    (void)next;
    for (int j = 0; j < ncols; j += TILE_COLS) {
        int n = ncols - j < TILE_COLS ? ncols - j : TILE_COLS;
        SPECIALIZE(quant_cols_body, dtype, elem, src, width, row0, nrows, c0 + j, n, q, srow, mode);
    }
}
HP_ISA_CLONES_AVX2(void, quant_cols_tile,
                   (const void *src, int dtype, int64_t width, int64_t row0, int nrows, int64_t c0,
                    int ncols, uint8_t *q, uint8_t *srow, int elem, int mode, int stream,
                    int64_t next),
                   (src, dtype, width, row0, nrows, c0, ncols, q, srow, elem, mode, stream, next))

/* ---------------------------------------------------- dual: row-wise and column-wise at once */

HP_INLINE void quant_dual_body(int dtype, int elem, const void *src, int64_t K, int64_t row0,
                               int nrows, int64_t c0, int ncols, uint8_t *qr, uint8_t *sr,
                               uint8_t *qc, uint8_t *sc, int mode) {
    const elem_fmt *f = &FORMATS[elem];
    int64_t nbk = (K + BLOCK - 1) / BLOCK;
    uint32_t buf[BLOCK][DUAL_COLS];
    uint32_t amax[DUAL_COLS];
    uint32_t bytes[DUAL_COLS];
    int32_t offsets[DUAL_COLS];
    float inv[DUAL_COLS];
    for (int j = 0; j < ncols; j++) amax[j] = 0;
    for (int r = 0; r < nrows; r++) {
        load_bits(src, dtype, (row0 + r) * K + c0, ncols, buf[r]);
        for (int j = 0; j < ncols; j++) {
            uint32_t a = buf[r][j] & 0x7FFFFFFFu;
            amax[j] = a > amax[j] ? a : amax[j];
        }
    }
    /* column-wise copy */
    int any_bad = 0;
    for (int j = 0; j < ncols; j++) {
        bytes[j] = scale_byte(amax[j], mode, f->emax);
        sc[(row0 / BLOCK) * K + c0 + j] = (uint8_t)bytes[j];
        offsets[j] = exponent_offset(bytes[j], f);
        inv[j] = f32_from_bits(inv_scale_bits(bytes[j]));
        any_bad |= bytes[j] == 0xFFu;
    }
    for (int r = 0; r < nrows; r++)
        convert_cols(buf[r], ncols, bytes, offsets, inv, any_bad, f, qc + (row0 + r) * K + c0);
    /* row-wise copy: c0 is a multiple of 32, so the tile holds whole row blocks */
    for (int r = 0; r < nrows; r++) {
        for (int j = 0; j < ncols; j += BLOCK) {
            int len = ncols - j < BLOCK ? ncols - j : BLOCK;
            uint32_t byte = scale_byte(block_amax(buf[r] + j, len), mode, f->emax);
            sr[(row0 + r) * nbk + (c0 + j) / BLOCK] = (uint8_t)byte;
            convert(buf[r] + j, len, byte, f, qr + (row0 + r) * K + c0 + j);
        }
    }
}

HP_INLINE void quant_dual_tile_body(const void *src, int dtype, int64_t K, int64_t row0, int nrows,
                                    int64_t c0, int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc,
                                    uint8_t *sc, int elem, int mode, int stream, int64_t next) {
    (void)stream;
    (void)next;
    for (int j = 0; j < ncols; j += DUAL_COLS) {
        int n = ncols - j < DUAL_COLS ? ncols - j : DUAL_COLS;
        SPECIALIZE(quant_dual_body, dtype, elem, src, K, row0, nrows, c0 + j, n, qr, sr, qc, sc,
                   mode);
    }
}
HP_ISA_CLONES_AVX2(void, quant_dual_tile,
                   (const void *src, int dtype, int64_t K, int64_t row0, int nrows, int64_t c0,
                    int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc, uint8_t *sc, int elem,
                    int mode, int stream, int64_t next),
                   (src, dtype, K, row0, nrows, c0, ncols, qr, sr, qc, sc, elem, mode, stream, next))


/* ------------------------------------------------------------------------- dequantization */

HP_INLINE void store_vals(const uint8_t *q, int n, float sc, int elem, int out_dtype,
                              void *out, int64_t off) {
    if (out_dtype == OUT_F32) {
        float *o = (float *)out + off;
        for (int i = 0; i < n; i++) o[i] = f32_from_bits(fp8_to_f32_bits(q[i], elem)) * sc;
    } else {
        uint16_t *o = (uint16_t *)out + off;
        for (int i = 0; i < n; i++)
            o[i] = f32_to_bf16_rne(bits_from_f32(f32_from_bits(fp8_to_f32_bits(q[i], elem)) * sc));
    }
}

HP_INLINE void dequant_rows_body(int out_dtype, int elem, const uint8_t *q, const uint8_t *s,
                                 int64_t r0, int64_t r1, int64_t n, void *out) {
    int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t b = 0; b < nb; b++) {
            int len = (int)(n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK);
            int64_t off = r * n + b * BLOCK;
            store_vals(q + off, len, scale_value(s[r * nb + b]), elem, out_dtype, out, off);
        }
    }
}

HP_INLINE void dequant_rows_range_body(const uint8_t *q, const uint8_t *s, int64_t r0, int64_t r1,
                                       int64_t n, int elem, void *out, int out_dtype) {
    SPECIALIZE(dequant_rows_body, out_dtype, elem, q, s, r0, r1, n, out);
}
HP_ISA_CLONES_AVX2(void, dequant_rows_range,
                   (const uint8_t *q, const uint8_t *s, int64_t r0, int64_t r1, int64_t n, int elem,
                    void *out, int out_dtype),
                   (q, s, r0, r1, n, elem, out, out_dtype))


HP_INLINE void dequant_cols_body(int out_dtype, int elem, const uint8_t *q, const uint8_t *srow,
                                 int64_t width, int64_t row0, int nrows, int64_t c0, int ncols,
                                 void *out) {
    float sc[TILE_COLS];
    for (int j = 0; j < ncols; j++) sc[j] = scale_value(srow[c0 + j]);
    for (int r = 0; r < nrows; r++) {
        int64_t off = (row0 + r) * width + c0;
        if (out_dtype == OUT_F32) {
            float *o = (float *)out + off;
            for (int j = 0; j < ncols; j++)
                o[j] = f32_from_bits(fp8_to_f32_bits(q[off + j], elem)) * sc[j];
        } else {
            uint16_t *o = (uint16_t *)out + off;
            for (int j = 0; j < ncols; j++)
                o[j] = f32_to_bf16_rne(
                    bits_from_f32(f32_from_bits(fp8_to_f32_bits(q[off + j], elem)) * sc[j]));
        }
    }
}

HP_INLINE void dequant_cols_tile_body(const uint8_t *q, const uint8_t *srow, int64_t width, int64_t row0,
                                      int nrows, int64_t c0, int ncols, int elem, void *out,
                                      int out_dtype) {
    for (int j = 0; j < ncols; j += TILE_COLS) {
        int n = ncols - j < TILE_COLS ? ncols - j : TILE_COLS;
        SPECIALIZE(dequant_cols_body, out_dtype, elem, q, srow, width, row0, nrows, c0 + j, n, out);
    }
}
HP_ISA_CLONES_AVX2(void, dequant_cols_tile,
                   (const uint8_t *q, const uint8_t *srow, int64_t width, int64_t row0, int nrows,
                    int64_t c0, int ncols, int elem, void *out, int out_dtype),
                   (q, srow, width, row0, nrows, c0, ncols, elem, out, out_dtype))

const mx_kernels MX_GENERIC = {
    "generic", quant_rows_range_generic, quant_cols_tile_generic, quant_dual_tile_generic,
    dequant_rows_range_generic, dequant_cols_tile_generic,
};
#ifdef HP_ISA_X86
const mx_kernels MX_AVX2 = {
    "avx2", quant_rows_range_avx2, quant_cols_tile_avx2, quant_dual_tile_avx2, dequant_rows_range_avx2,
    dequant_cols_tile_avx2,
};
#endif

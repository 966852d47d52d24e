/* Shared definitions of the CPU MX kernels: formats, scalar bit helpers, the kernel table. */
#ifndef HP_MX_COMMON_H
#define HP_MX_COMMON_H
#include <stdint.h>
#include <string.h>

#include "hp_isa.h"

/* Helpers are forced inline so that constant arguments fold into straight-line vector code. */
#define HP_INLINE static inline __attribute__((always_inline))

enum { IN_F32 = 0, IN_BF16 = 1, IN_F16 = 2 };
enum { ELEM_E4M3 = 0, ELEM_E5M2 = 1 };
enum { SCALE_RCEIL = 0, SCALE_FLOOR = 1 };
enum { OUT_F32 = 0, OUT_BF16 = 1 };
#define BLOCK 32
#define COL_CHUNK 4096 /* most columns one column-wise or dual task covers; a multiple of 512 */

typedef struct {
    uint32_t max_bits;     /* fp32 bits of the largest finite element value (448 / 57344) */
    uint32_t normal_bits;  /* fp32 bits of the smallest normal element value (2^-6 / 2^-14) */
    uint32_t magic_bits;   /* fp32 bits of a value whose ulp is the subnormal step */
    int mant_shift;        /* 23 - element mantissa bits */
    int rebias;            /* (127 - element bias) << element mantissa bits */
    int emax;              /* exponent of the largest element binade (8 / 15) */
    int max_code;          /* code of the largest finite element (0x7E / 0x7B) */
} elem_fmt;

static const elem_fmt FORMATS[2] = {
    /* E4M3: max 448 = 1.75 * 2^8, min normal 2^-6, subnormal step 2^-9 -> magic 2^14 */
    {0x43E00000u, 0x3C800000u, 0x46800000u, 20, 120 << 3, 8, 0x7E},
    /* E5M2: max 57344 = 1.75 * 2^15, min normal 2^-14, subnormal step 2^-16 -> magic 2^7 */
    {0x47600000u, 0x38800000u, 0x43000000u, 21, 112 << 2, 15, 0x7B},
};

HP_INLINE float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

HP_INLINE uint32_t bits_from_f32(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* Scale exponent of a block from the largest absolute fp32 bit pattern in it.
 * Returns the E8M0 byte; 0xFF for NaN/Inf. */
HP_INLINE uint32_t scale_byte(uint32_t amax_bits, int mode, int emax) {
    if (amax_bits >= 0x7F800000u) return 0xFFu;
    int e = (int)(amax_bits >> 23) - 127 - emax; /* floor(log2(amax)) - emax for normal amax */
    /* rceil: the element max is 1.75 * 2^emax, so round up when amax's mantissa exceeds 1.75 */
    if (mode == SCALE_RCEIL) e += (amax_bits & 0x7FFFFFu) > 0x600000u;
    if (e < -127) e = -127; /* also catches zero and subnormal amax (exponent field 0) */
    if (e > 127) e = 127;
    return (uint32_t)(e + 127);
}

/* fp32 bits of 2^-(byte-127): always a normal fp32 because byte - 127 lies in [-127, 120]. */
HP_INLINE uint32_t inv_scale_bits(uint32_t byte) { return (254u - byte) << 23; }

/* All-ones when cond holds, else zero: selects written as masks keep loops branch-free,
 * which GCC needs to vectorize them. */
HP_INLINE uint32_t mask_if(int cond) { return 0u - (uint32_t)(cond != 0); }

HP_INLINE uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {
    return (a & mask) | (b & ~mask);
}

/* 2^(byte-127); NaN for 0xFF. byte 0 is 2^-127, an fp32 subnormal. */
HP_INLINE float scale_value(uint8_t byte) {
    uint32_t v = select_bits(mask_if(byte == 0), 0x00400000u, (uint32_t)byte << 23);
    return f32_from_bits(select_bits(mask_if(byte == 0xFFu), 0x7FC00000u, v));
}

/* One implementation of the per-tile work, for one instruction set. The OpenMP drivers in
 * mx_quant.c split the work into tasks and call these; each call is single-threaded. */
/* `stream` asks for non-temporal stores of the codes: the driver sets it for outputs too large
 * to stay in cache; kernels may ignore it. */
typedef struct {
    const char *name;
    /* rows [r0, r1) of a row-major [rows, n] input, blocks along n */
    void (*quant_rows)(const void *src, int dtype, int64_t r0, int64_t r1, int64_t n, uint8_t *q,
                       uint8_t *s, int elem, int mode, int stream);
    /* one block of rows [row0, row0 + nrows), nrows <= 32, columns [c0, c0 + ncols), ncols <=
     * COL_CHUNK, of a
     * row-major [*, width] input; srow is the scale row of that block; `next` as for quant_dual */
    void (*quant_cols)(const void *src, int dtype, int64_t width, int64_t row0, int nrows,
                       int64_t c0, int ncols, uint8_t *q, uint8_t *srow, int elem, int mode, int stream,
                       int64_t next);
    /* one block of rows x columns [c0, c0 + ncols) of an [M, K] input, c0 a multiple of 32:
     * both the row-wise and the column-wise copies. `next` is where the tile this thread will
     * probably do next starts, in elements from this one's start (0: none); kernels may
     * prefetch it (prefetches never fault, so a shorter next tile is harmless) */
    void (*quant_dual)(const void *src, int dtype, int64_t K, int64_t row0, int nrows, int64_t c0,
                       int ncols, uint8_t *qr, uint8_t *sr, uint8_t *qc, uint8_t *sc, int elem,
                       int mode, int stream, int64_t next);
    void (*dequant_rows)(const uint8_t *q, const uint8_t *s, int64_t r0, int64_t r1, int64_t n,
                         int elem, void *out, int out_dtype);
    void (*dequant_cols)(const uint8_t *q, const uint8_t *srow, int64_t width, int64_t row0,
                         int nrows, int64_t c0, int ncols, int elem, void *out, int out_dtype);
} mx_kernels;

/* One table per level of [Note: one ISA choice] (hp_isa.h): the portable kernels compiled for
 * baseline x86-64 and for x86-64-v3 (mx_generic.c), and the AVX-512 intrinsics (mx_avx512.c). */
extern const mx_kernels MX_GENERIC;
#ifdef HP_ISA_X86
extern const mx_kernels MX_AVX2;
extern const mx_kernels MX_AVX512;
#endif

#endif

/*
 * The DVM tile interpreter, compiled once per instruction set: dvm_generic.c, dvm_avx2.c and
 * dvm_avx512.c set the target (a `#pragma GCC target` before including this file), define
 * DVM_ISA_TABLE / DVM_ISA_NAME, and optionally DVM_HAVE_FMA (fused multiply-adds in the math),
 * DVM_USE_AVX2 or DVM_USE_AVX512 (F16C conversions and the widest non-temporal stores).
 *
 * A tile is tr rows x tc columns. A FULL register is a tr*tc float buffer with rows packed
 * (pitch tc), so element-wise work on FULL registers is one flat loop; a ROW register holds tr
 * floats, a SCALAR one. Dispatch happens once per instruction per tile; every loop over a tile
 * is a `#pragma omp simd` loop of branch-free code, which is also what makes a destination
 * that aliases an operand (the planner reuses buffers in place) safe.
 */
#include <stdlib.h>

#include "dvm_math.h"
#include "dvm_vm.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <immintrin.h>
#if defined(DVM_USE_AVX512)
#define STREAM_VEC 64
DVM_INLINE void stream_vec(char *d, const char *s) { _mm512_stream_si512((__m512i *)d, _mm512_loadu_si512(s)); }
#elif defined(DVM_USE_AVX2)
#define STREAM_VEC 32
DVM_INLINE void stream_vec(char *d, const char *s) {
    _mm256_stream_si256((__m256i *)d, _mm256_loadu_si256((const __m256i *)s));
}
#else
#define STREAM_VEC 16
DVM_INLINE void stream_vec(char *d, const char *s) { _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s)); }
#endif
#endif

#define SIMD _Pragma("omp simd")

/* n bytes with non-temporal stores where the destination is vector-aligned: an output too
 * large for the caches is not read into them first (a third less memory traffic) */
static void stream_bytes(char *d, const char *s, size_t n) {
#ifdef STREAM_VEC
    size_t head = (size_t)(-(uintptr_t)d) & (STREAM_VEC - 1);
    if (head > n) head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + STREAM_VEC <= n; i += STREAM_VEC) stream_vec(d + i, s + i);
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* non-temporal stores become visible to other threads after a fence */
static void stream_fence(void) {
#ifdef STREAM_VEC
    _mm_sfence();
#endif
}

/* ---------------------------------------------------------------- loads and stores */

static void f16_row_to_f32(float *d, const uint16_t *s, int64_t n) {
    int64_t j = 0;
#if defined(DVM_USE_AVX512)
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(d + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + j))));
#elif defined(DVM_USE_AVX2)
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(d + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j))));
#endif
    SIMD for (int64_t i = j; i < n; i++) d[i] = f16_bits_to_f32(s[i]);
}

static void f32_row_to_f16(uint16_t *d, const float *s, int64_t n) {
    int64_t j = 0;
#if defined(DVM_USE_AVX512)
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(d + j),
                            _mm512_cvtps_ph(_mm512_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(DVM_USE_AVX2)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(d + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    SIMD for (int64_t i = j; i < n; i++) d[i] = f32_to_f16_bits(s[i]);
}

DVM_INLINE float load_one(const char *p, int dtype) {
    if (dtype == DT_F32) {
        float v;
        memcpy(&v, p, 4);
        return v;
    }
    if (dtype == DT_BOOL) return *(const uint8_t *)p ? 1.0f : 0.0f;
    uint16_t h;
    memcpy(&h, p, 2);
    return dtype == DT_BF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
}

DVM_INLINE void store_one(char *p, int dtype, float v) {
    if (dtype == DT_F32) {
        memcpy(p, &v, 4);
    } else {
        uint16_t h = dtype == DT_BF16 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v);
        memcpy(p, &h, 2);
    }
}

/* n elements of a tensor row starting at p, col stride cs (elements), to fp32 */
static void load_row(float *d, const char *p, int dtype, int64_t cs, int64_t n) {
    if (cs == 1) {
        if (dtype == DT_F32) {
            memcpy(d, p, (size_t)n * 4);
        } else if (dtype == DT_BF16) {
            const uint16_t *s = (const uint16_t *)p;
            SIMD for (int64_t j = 0; j < n; j++) d[j] = bf16_bits_to_f32(s[j]);
        } else if (dtype == DT_BOOL) {
            const uint8_t *s = (const uint8_t *)p;
            SIMD for (int64_t j = 0; j < n; j++) d[j] = s[j] ? 1.0f : 0.0f;
        } else {
            f16_row_to_f32(d, (const uint16_t *)p, n);
        }
    } else if (cs == 0) {
        float v = load_one(p, dtype);
        SIMD for (int64_t j = 0; j < n; j++) d[j] = v;
    } else {
        int64_t step = cs * dvm_esize(dtype);
        for (int64_t j = 0; j < n; j++) d[j] = load_one(p + j * step, dtype);
    }
}

static void store_row(char *p, int dtype, int64_t cs, const float *s, int64_t n, int stream) {
    if (cs == 1 && stream) {
        if (dtype == DT_F32) {
            stream_bytes(p, (const char *)s, (size_t)n * 4);
            return;
        }
        uint16_t h[1024]; /* converted in L1, then streamed */
        for (int64_t j0 = 0; j0 < n; j0 += 1024) {
            int64_t m = n - j0 < 1024 ? n - j0 : 1024;
            store_row((char *)h, dtype, 1, s + j0, m, 0);
            stream_bytes(p + j0 * 2, (const char *)h, (size_t)m * 2);
        }
    } else if (cs == 1) {
        if (dtype == DT_F32) {
            memcpy(p, s, (size_t)n * 4);
        } else if (dtype == DT_BF16) {
            uint16_t *d = (uint16_t *)p;
            SIMD for (int64_t j = 0; j < n; j++) d[j] = f32_to_bf16_bits(s[j]);
        } else {
            f32_row_to_f16((uint16_t *)p, s, n);
        }
    } else {
        int64_t step = cs * dvm_esize(dtype);
        for (int64_t j = 0; j < n; j++) store_one(p + j * step, dtype, s[j]);
    }
}

/* the value v in n elements of a row (cs != 0) */
static void fill_row(char *p, int dtype, int64_t cs, float v, int64_t n) {
    if (cs == 1 && dtype == DT_F32) {
        float *d = (float *)p;
        SIMD for (int64_t j = 0; j < n; j++) d[j] = v;
    } else if (cs == 1) {
        uint16_t h = dtype == DT_BF16 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v);
        uint16_t *d = (uint16_t *)p;
        SIMD for (int64_t j = 0; j < n; j++) d[j] = h;
    } else {
        int64_t step = cs * dvm_esize(dtype);
        for (int64_t j = 0; j < n; j++) store_one(p + j * step, dtype, v);
    }
}

/* ---------------------------------------------------------------- element-wise operations */

DVM_INLINE float round_bf16(float x) { return bf16_bits_to_f32(f32_to_bf16_bits(x)); }
DVM_INLINE float round_f16(float x) { return f16_bits_to_f32(f32_to_f16_bits(x)); }
DVM_INLINE float relu(float x) { return x < 0.0f ? 0.0f : x; } /* NaN stays NaN */
/* NaN if either is NaN (torch.maximum / minimum) */
DVM_INLINE float max_nan(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
DVM_INLINE float min_nan(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }

/* sin and cos go to libm for |x| > SINCOS_MAX, inf and NaN (see dvm_math.h) */
#define UNARY_OPS(X)                                                                           \
    X(OP_NEG, -x) X(OP_ABS, fabsf(x)) X(OP_EXP, f_exp(x)) X(OP_LOG, f_log(x))                  \
    X(OP_SQRT, sqrtf(x)) X(OP_RSQRT, 1.0f / sqrtf(x)) X(OP_RECIP, 1.0f / x)                    \
    X(OP_TANH, f_tanh(x)) X(OP_SIGMOID, f_sigmoid(x)) X(OP_RELU, relu(x)) X(OP_ERF, f_erf(x))  \
    X(OP_SILU, f_silu(x)) X(OP_GELU_ERF, f_gelu_erf(x)) X(OP_GELU_TANH, f_gelu_tanh(x))        \
    X(OP_LOG1P, f_log1p(x)) X(OP_EXPM1, f_expm1(x)) X(OP_ROUND_BF16, round_bf16(x))            \
    X(OP_ROUND_F16, round_f16(x)) X(OP_COPY, x)

#define BINARY_OPS(X)                                                                          \
    X(OP_ADD, a + b) X(OP_SUB, a - b) X(OP_MUL, a * b) X(OP_DIV, a / b)                        \
    X(OP_MAX, max_nan(a, b)) X(OP_MIN, min_nan(a, b))                                          \
    X(OP_GT, a > b ? 1.0f : 0.0f) X(OP_GE, a >= b ? 1.0f : 0.0f)                               \
    X(OP_LT, a < b ? 1.0f : 0.0f) X(OP_LE, a <= b ? 1.0f : 0.0f)                               \
    X(OP_EQ, a == b ? 1.0f : 0.0f) X(OP_NE, a != b ? 1.0f : 0.0f)

/* ---------------------------------------------------------------- VFs
 * The generated vector functions (hyperparallel/fusion/vf_spec.py writes them from
 * vf_table.txt): each op of a VF is the formula the per-op loops above use, so a VF's results are
 * bitwise theirs; its values stay in registers from the load of its inputs to its outputs. */
#define VF_UNARY_FN(OP, EXPR) DVM_INLINE float vf_e_##OP(float x) { return EXPR; }
UNARY_OPS(VF_UNARY_FN)
#undef VF_UNARY_FN
#define VF_BINARY_FN(OP, EXPR) DVM_INLINE float vf_e_##OP(float a, float b) { return EXPR; }
BINARY_OPS(VF_BINARY_FN)
#undef VF_BINARY_FN
DVM_INLINE float vf_e_OP_WHERE(float c, float x, float y) { return c != 0.0f ? x : y; }

#define DVM_VF_BODIES
#include "generated/dvm_vf_table.h"
#undef DVM_VF_BODIES

static void sincos_loop(float *d, const float *s, int64_t n, int cos) {
    int slow = 0;
    _Pragma("omp simd reduction(| : slow)")
    for (int64_t i = 0; i < n; i++) slow |= !(fabsf(s[i]) <= SINCOS_MAX);
    if (slow) {
        for (int64_t i = 0; i < n; i++) d[i] = cos ? cosf(s[i]) : sinf(s[i]);
    } else if (cos) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = f_cos(s[i]);
    } else {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = f_sin(s[i]);
    }
}

static void unary(int op, float *d, const float *s, int64_t n) {
    switch (op) {
#define UCASE(OP, EXPR)                                                                        \
    case OP:                                                                                   \
        SIMD for (int64_t i = 0; i < n; i++) {                                                 \
            float x = s[i];                                                                    \
            d[i] = EXPR;                                                                       \
        }                                                                                      \
        break;
        UNARY_OPS(UCASE)
#undef UCASE
    case OP_SIN: sincos_loop(d, s, n, 0); break;
    case OP_COS: sincos_loop(d, s, n, 1); break;
    default: break;
    }
}

/* d = u(s) * b over n elements, b a single value if sb (u: a UNARY_OPS operation) */
static void unary_mul(int op, float *d, const float *s, const float *b, int sb, int64_t n) {
    switch (op) {
#define UMCASE(OP, EXPR)                                                                       \
    case OP:                                                                                   \
        if (sb) {                                                                              \
            float bv = b[0];                                                                   \
            SIMD for (int64_t i = 0; i < n; i++) {                                             \
                float x = s[i];                                                                \
                d[i] = (EXPR) * bv;                                                            \
            }                                                                                  \
        } else {                                                                               \
            SIMD for (int64_t i = 0; i < n; i++) {                                             \
                float x = s[i];                                                                \
                d[i] = (EXPR) * b[i];                                                          \
            }                                                                                  \
        }                                                                                      \
        break;
        UNARY_OPS(UMCASE)
#undef UMCASE
    default: break;
    }
}

/* x ** y for a scalar exponent: the exponents PyTorch special-cases get exact loops with
 * powf's results (including its special values); the others call powf. */
static void pow_scalar_exp(float *d, const float *s, float y, int64_t n) {
    if (y == 2.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = s[i] * s[i];
    } else if (y == 1.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = s[i];
    } else if (y == 0.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = 1.0f;
    } else if (y == 3.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = s[i] * s[i] * s[i];
    } else if (y == -1.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = 1.0f / s[i];
    } else if (y == -2.0f) {
        SIMD for (int64_t i = 0; i < n; i++) d[i] = 1.0f / (s[i] * s[i]);
    } else if (y == 0.5f || y == -0.5f) {
        /* powf(-0, .5) = +0, powf(-inf, .5) = inf, where sqrt gives -0 and NaN */
        float sign = y;
        SIMD for (int64_t i = 0; i < n; i++) {
            float r = s[i] == -INFINITY ? INFINITY : sqrtf(s[i]) + 0.0f;
            d[i] = sign > 0.0f ? r : 1.0f / r;
        }
    } else {
        for (int64_t i = 0; i < n; i++) d[i] = powf(s[i], y);
    }
}

/* d = a OP b over n elements; sa / sb: operand is a single value (broadcast) */
DVM_INLINE void binary_loop(int op, float *d, const float *pa, int sa, const float *pb, int sb, int64_t n) {
    switch (op) {
#define BCASE(OP, EXPR)                                                                        \
    case OP:                                                                                   \
        SIMD for (int64_t i = 0; i < n; i++) {                                                 \
            float a = pa[sa ? 0 : i], b = pb[sb ? 0 : i];                                      \
            d[i] = EXPR;                                                                       \
        }                                                                                      \
        break;
        BINARY_OPS(BCASE)
#undef BCASE
    case OP_POW:
        if (sb) {
            if (sa) d[0] = powf(pa[0], pb[0]);
            else pow_scalar_exp(d, pa, pb[0], n);
        } else {
            for (int64_t i = 0; i < n; i++) d[i] = powf(pa[sa ? 0 : i], pb[i]);
        }
        break;
    default: break;
    }
}

static void binary_vv(int op, float *d, const float *a, const float *b, int64_t n) { binary_loop(op, d, a, 0, b, 0, n); }
static void binary_vs(int op, float *d, const float *a, const float *b, int64_t n) { binary_loop(op, d, a, 0, b, 1, n); }
static void binary_sv(int op, float *d, const float *a, const float *b, int64_t n) { binary_loop(op, d, a, 1, b, 0, n); }

/* n elements of d from operands whose kinds are `kd` or narrower; FULL registers have pitch tc */
static void binary(int op, float *d, int kd, const float *a, int ka, const float *b, int kb, int64_t tr, int64_t tc) {
    int64_t n = kd == KIND_FULL ? tr * tc : kd == KIND_ROW ? tr : 1;
    if (ka == kd && kb == kd) {
        binary_vv(op, d, a, b, n);
    } else if (ka == kd && kb == KIND_SCALAR) {
        binary_vs(op, d, a, b, n);
    } else if (kb == kd && ka == KIND_SCALAR) {
        binary_sv(op, d, a, b, n);
    } else if (ka == KIND_FULL) { /* b ROW */
        for (int64_t i = 0; i < tr; i++) binary_vs(op, d + i * tc, a + i * tc, b + i, tc);
    } else { /* a ROW, b FULL */
        for (int64_t i = 0; i < tr; i++) binary_sv(op, d + i * tc, a + i, b + i * tc, tc);
    }
}

DVM_INLINE void where_loop(float *d, const float *c, int sc, const float *x, int sx, const float *y, int sy, int64_t n) {
    SIMD for (int64_t i = 0; i < n; i++) {
        float cv = c[sc ? 0 : i], xv = x[sx ? 0 : i], yv = y[sy ? 0 : i]; /* loads outside the select */
        d[i] = cv != 0.0f ? xv : yv;
    }
}

static void where_row(float *d, const float *c, int sc, const float *x, int sx, const float *y, int sy, int64_t n) {
    switch (sc * 4 + sx * 2 + sy) {
    case 0: where_loop(d, c, 0, x, 0, y, 0, n); break;
    case 1: where_loop(d, c, 0, x, 0, y, 1, n); break;
    case 2: where_loop(d, c, 0, x, 1, y, 0, n); break;
    case 3: where_loop(d, c, 0, x, 1, y, 1, n); break;
    case 4: where_loop(d, c, 1, x, 0, y, 0, n); break;
    case 5: where_loop(d, c, 1, x, 0, y, 1, n); break;
    case 6: where_loop(d, c, 1, x, 1, y, 0, n); break;
    default: where_loop(d, c, 1, x, 1, y, 1, n); break;
    }
}

static void where(float *d, int kd, const float *c, int kc, const float *x, int kx, const float *y, int ky, int64_t tr,
                  int64_t tc) {
    if (kd != KIND_FULL || (kc == kd && kx == kd && ky == kd)) {
        int64_t n = kd == KIND_FULL ? tr * tc : kd == KIND_ROW ? tr : 1;
        where_row(d, c, kc != kd, x, kx != kd, y, ky != kd, n);
        return;
    }
    for (int64_t i = 0; i < tr; i++) {
        /* per row: a FULL operand advances by rows, a ROW operand is the row's value */
        const float *ci = kc == KIND_FULL ? c + i * tc : kc == KIND_ROW ? c + i : c;
        const float *xi = kx == KIND_FULL ? x + i * tc : kx == KIND_ROW ? x + i : x;
        const float *yi = ky == KIND_FULL ? y + i * tc : ky == KIND_ROW ? y + i : y;
        where_row(d + i * tc, ci, kc != KIND_FULL, xi, kx != KIND_FULL, yi, ky != KIND_FULL, tc);
    }
}

DVM_INLINE void mul_mul_loop(float *d, const float *a, int sa, const float *b, int sb, const float *c, int sc,
                             int64_t n) {
    SIMD for (int64_t i = 0; i < n; i++) d[i] = (a[sa ? 0 : i] * b[sb ? 0 : i]) * c[sc ? 0 : i];
}

static void mul_mul_row(float *d, const float *a, int sa, const float *b, int sb, const float *c, int sc, int64_t n) {
    switch (sa * 4 + sb * 2 + sc) {
    case 0: mul_mul_loop(d, a, 0, b, 0, c, 0, n); break;
    case 1: mul_mul_loop(d, a, 0, b, 0, c, 1, n); break;
    case 2: mul_mul_loop(d, a, 0, b, 1, c, 0, n); break;
    case 3: mul_mul_loop(d, a, 0, b, 1, c, 1, n); break;
    case 4: mul_mul_loop(d, a, 1, b, 0, c, 0, n); break;
    case 5: mul_mul_loop(d, a, 1, b, 0, c, 1, n); break;
    default: mul_mul_loop(d, a, 1, b, 1, c, 0, n); break; /* a * b is FULL: not both broadcast */
    }
}

/* d (FULL) = (a * b) * c */
static void mul_mul(float *d, const float *a, int ka, const float *b, int kb, const float *c, int kc, int64_t tr,
                    int64_t tc) {
    if (ka == KIND_FULL && kb == KIND_FULL && kc == KIND_FULL) {
        mul_mul_row(d, a, 0, b, 0, c, 0, tr * tc);
        return;
    }
    for (int64_t i = 0; i < tr; i++) {
        const float *ai = ka == KIND_FULL ? a + i * tc : ka == KIND_ROW ? a + i : a;
        const float *bi = kb == KIND_FULL ? b + i * tc : kb == KIND_ROW ? b + i : b;
        const float *ci = kc == KIND_FULL ? c + i * tc : kc == KIND_ROW ? c + i : c;
        mul_mul_row(d + i * tc, ai, ka != KIND_FULL, bi, kb != KIND_FULL, ci, kc != KIND_FULL, tc);
    }
}

/* The 16 lanes of a row sum added pairwise, halves first: lanes l + 8 into l, then l + 4, l + 2,
 * l + 1 (on x86 in SSE registers: the compiler's loop over the array waits on store forwarding) */
DVM_INLINE float lanes_total(float *acc) {
#if defined(__x86_64__) && defined(__SSE2__)
    __m128 lo = _mm_add_ps(_mm_loadu_ps(acc), _mm_loadu_ps(acc + 8));
    __m128 hi = _mm_add_ps(_mm_loadu_ps(acc + 4), _mm_loadu_ps(acc + 12));
    __m128 quad = _mm_add_ps(lo, hi);
    __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
#else
    for (int w = 8; w > 0; w /= 2) SIMD for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
#endif
}

/* Row sums in 16 lanes written out here rather than left to `omp simd reduction`: without
 * reassociation the compiler ends such a reduction by adding its lanes one after another (a
 * dependent scalar addition per lane, 16 a row under AVX-512: the larger part of RMSNorm's sum of squares over 256
 * columns: its native call at 2048 x 256 took 57-59 us that way, 52-54 so). Lane l adds the
 * row's terms l, l + 16, ..., four vectors a step (the running lanes wait one addition per 64
 * terms), the tail's terms into the first lanes, then lanes_total: an order fixed by n alone,
 * the same under every ISA. The body of a function returning the sum of T(0 .. n - 1). */
#define ROW_SUM_OF(T, n)                                                                                    \
    float acc[16] = {0};                                                                                    \
    int64_t j = 0;                                                                                          \
    for (; j + 64 <= (n); j += 64)                                                                          \
        SIMD for (int l = 0; l < 16; l++) acc[l] += (T(j + l) + T(j + 16 + l)) + (T(j + 32 + l) + T(j + 48 + l)); \
    for (; j + 16 <= (n); j += 16) SIMD for (int l = 0; l < 16; l++) acc[l] += T(j + l);                   \
    for (int l = 0; j + l < (n); l++) acc[l] += T(j + l);                                                   \
    return lanes_total(acc)

static float row_sum(const float *s, int64_t n) {
#define TERM(k) s[k]
    ROW_SUM_OF(TERM, n);
#undef TERM
}

static float row_dot(const float *a, const float *b, int64_t n) {
#define TERM(k) (a[k] * b[k])
    ROW_SUM_OF(TERM, n);
#undef TERM
}

/* d (ROW) = row sums of a * b, both FULL */
static void sum_mul(float *d, const float *a, const float *b, int64_t tr, int64_t tc) {
    for (int64_t i = 0; i < tr; i++) d[i] = row_dot(a + i * tc, b + i * tc, tc);
}

/* tc: the tile's columns, all of the row's when `a` is FULL; cols: the row's */
static void reduce_rows(int op, float *d, const float *a, int ka, int64_t tr, int64_t tc, int64_t cols) {
    if (ka != KIND_FULL) { /* one value repeated along the row */
        for (int64_t i = 0; i < tr; i++) {
            float v = a[ka == KIND_ROW ? i : 0];
            d[i] = op == OP_RSUM ? v * (float)cols : v;
        }
        return;
    }
    for (int64_t i = 0; i < tr; i++) {
        const float *s = a + i * tc;
        if (op == OP_RSUM) {
            d[i] = row_sum(s, tc);
        } else {
            float m = op == OP_RMAX ? -INFINITY : INFINITY;
            int nan = 0;
            if (op == OP_RMAX) {
                _Pragma("omp simd reduction(max : m) reduction(| : nan)")
                for (int64_t j = 0; j < tc; j++) {
                    m = s[j] > m ? s[j] : m;
                    nan |= s[j] != s[j];
                }
            } else {
                _Pragma("omp simd reduction(min : m) reduction(| : nan)")
                for (int64_t j = 0; j < tc; j++) {
                    m = s[j] < m ? s[j] : m;
                    nan |= s[j] != s[j];
                }
            }
            d[i] = nan ? NAN : m;
        }
    }
}

/* a register of kind ks broadcast into a wider (or the same) kind kd */
static void broadcast(float *d, int kd, const float *s, int ks, int64_t tr, int64_t tc) {
    int64_t n = kd == KIND_FULL ? tr * tc : kd == KIND_ROW ? tr : 1;
    if (ks == kd) {
        memmove(d, s, (size_t)n * 4);
    } else if (ks == KIND_SCALAR) {
        float v = s[0];
        SIMD for (int64_t i = 0; i < n; i++) d[i] = v;
    } else { /* ROW into FULL */
        for (int64_t i = 0; i < tr; i++) {
            float v = s[i];
            float *di = d + i * tc;
            SIMD for (int64_t j = 0; j < tc; j++) di[j] = v;
        }
    }
}

/* ---------------------------------------------------------------- the interpreter */

static void load(const dvm_tensor *t, float *d, int kd, int64_t r0, int64_t c0, int64_t tr, int64_t tc) {
    int es = dvm_esize(t->dtype);
    if (kd == KIND_SCALAR) {
        d[0] = load_one(t->ptr, t->dtype);
    } else if (kd == KIND_ROW) {
        for (int64_t i = 0; i < tr; i++) d[i] = load_one(t->ptr + dvm_row(t, r0 + i) * es, t->dtype);
    } else {
        const char *p = t->ptr + (dvm_row(t, r0) + c0 * t->cs) * es;
        if (t->rs == 0 && t->linear) { /* the same row for every row of the tile */
            load_row(d, p, t->dtype, t->cs, tc);
            for (int64_t i = 1; i < tr; i++) memcpy(d + i * tc, d, (size_t)tc * 4);
        } else if (t->linear) {
            for (int64_t i = 0; i < tr; i++) load_row(d + i * tc, p + i * t->rs * es, t->dtype, t->cs, tc);
        } else {
            for (int64_t i = 0; i < tr; i++)
                load_row(d + i * tc, t->ptr + (dvm_row(t, r0 + i) + c0 * t->cs) * es, t->dtype, t->cs, tc);
        }
    }
}

static void store(const dvm_tensor *t, const float *s, int ks, int64_t r0, int64_t c0, int64_t tr, int64_t tc) {
    int es = dvm_esize(t->dtype);
    char *p = t->ptr + (dvm_row(t, r0) + c0 * t->cs) * es;
    if (ks == KIND_FULL) {
        for (int64_t i = 0; i < tr; i++)
            store_row(t->linear ? p + i * t->rs * es : t->ptr + (dvm_row(t, r0 + i) + c0 * t->cs) * es, t->dtype,
                      t->cs, s + i * tc, tc, t->stream);
        return;
    }
    /* a ROW or SCALAR value: into broadcast dimensions of the output only once (by the tile
     * at column 0 / at the origin), else repeated along them */
    if (t->cs == 0 && c0 != 0) return;
    int64_t n = t->cs == 0 ? 1 : tc;
    if (ks == KIND_SCALAR && t->rs == 0 && t->linear) {
        if (r0 == 0) fill_row(p, t->dtype, t->cs ? t->cs : 1, s[0], n);
        return;
    }
    for (int64_t i = 0; i < tr; i++)
        fill_row(t->ptr + (dvm_row(t, r0 + i) + c0 * t->cs) * es, t->dtype, t->cs ? t->cs : 1,
                 ks == KIND_ROW ? s[i] : s[0], n);
}

/* Prefetching the inputs of the tile a thread runs next, spread over the instructions of this
 * one. An interpreter loads a tile in a burst and then computes: without it memory would idle
 * while the tile computes and the loads would wait for memory; issued all at once, prefetches
 * would overrun the core's outstanding-miss slots and be lost. */
#define PF_MAX 8
typedef struct {
    const char *base[PF_MAX];
    int64_t row_step[PF_MAX], rows[PF_MAX], row_bytes[PF_MAX];
    int n, cur;
    int64_t row, off, per_step;
} pf_cursor;

/* The next tile's inputs (FULL loads of rows with unit column stride that are not kept from
 * tile to tile), to be prefetched in `steps` portions. */
static void pf_plan(const dvm_plan *p, const int64_t *next, int steps, pf_cursor *c) {
    c->n = c->cur = 0;
    c->row = c->off = c->per_step = 0;
    int64_t lines = 0;
    int only_in_place = 0;
    if (!p->prefetch || next[2] == 0) return;
    for (int k = 0; k < p->n_instr && c->n < PF_MAX; k++) {
        const dvm_ins *I = &p->ins[k];
        if (I->op != OP_LOAD || I->kd != KIND_FULL || I->keep) continue;
        const dvm_tensor *t = &p->in[I->idx];
        if (t->cs != 1 || !t->linear) continue;
        int dup = 0;
        for (int j = 0; j < c->n; j++) dup |= c->base[j] == t->ptr + (next[0] * t->rs + next[1]) * dvm_esize(t->dtype);
        if (dup) continue; /* an input loaded twice */
        int es = dvm_esize(t->dtype);
        c->base[c->n] = t->ptr + (next[0] * t->rs + next[1]) * es;
        c->row_step[c->n] = t->rs * es;
        c->rows[c->n] = t->rs == 0 ? 1 : next[2];
        c->row_bytes[c->n] = next[3] * es;
        lines += c->rows[c->n] * ((c->row_bytes[c->n] + 63) / 64);
        c->n++;
        only_in_place = c->n == 1 && I->in_place && I->readers == 1;
    }
    /* one stream read in place, once, by the computation itself is what the hardware prefetcher
     * follows best */
    if (c->n == 1 && only_in_place) c->n = 0;
    c->per_step = lines / (steps > 0 ? steps : 1) + 1;
}

static void pf_step(pf_cursor *c) {
    for (int64_t left = c->per_step; left > 0 && c->cur < c->n; left--) {
        __builtin_prefetch(c->base[c->cur] + c->row * c->row_step[c->cur] + c->off, 0, 2);
        c->off += 64;
        if (c->off >= c->row_bytes[c->cur]) {
            c->off = 0;
            if (++c->row >= c->rows[c->cur]) {
                c->row = 0;
                c->cur++;
            }
        }
    }
}

/* d = rotate_half(a) along each of the tile's tr rows of tc (all the row's) columns */
static void rot_half(float *d, const float *a, int64_t tr, int64_t tc) {
    int64_t h = tc / 2;
    for (int64_t i = 0; i < tr; i++) {
        const float *ai = a + i * tc;
        float *di = d + i * tc;
        SIMD for (int64_t j = 0; j < h; j++) di[j] = -ai[j + h];
        SIMD for (int64_t j = 0; j < h; j++) di[j + h] = ai[j];
    }
}

/* The VF of instruction I over the tile: one call over the packed tile, or a call per row when an
 * input is a ROW register (its value is the row's) or a FULL operand lies at a pitch of its own
 * (P[r]: an input only VFs read, walked where it lies; an output only a STORE reads, computed in
 * the output's memory at the output's row stride). */
static void run_vf(const dvm_plan *p, const dvm_ins *I, float **R, int64_t *P, int64_t r0, int64_t c0, int64_t tr,
                   int64_t tc) {
    float *o[DVM_VF_MAX_OUTPUTS];
    const float *x[DVM_VF_MAX_ARGS];
    int64_t pitch[DVM_VF_MAX_ARGS]; /* per FULL operand: elements from one of the tile's rows to the next */
    int n_out = I->n_vf_out, n_in = I->n_vf_in, per_row = 0;
    for (int j = 0; j < n_out; j++) {
        int r = I->vf_regs[j];
        if (I->vf_direct[j]) { /* straight into the output, at its own row stride */
            const dvm_tensor *t = &p->out[I->vf_direct[j] - 1];
            R[r] = (float *)(t->ptr + (dvm_row(t, r0) + c0 * t->cs) * 4);
            P[r] = tr == 1 || t->rs == tc ? 0 : t->rs;
        }
        o[j] = R[r];
        pitch[j] = P[r] ? P[r] : tc;
        per_row |= pitch[j] != tc;
    }
    for (int i = 0; i < n_in; i++) {
        int r = I->vf_regs[n_out + i], kind = I->vf_kinds[n_out + i];
        x[i] = R[r];
        pitch[n_out + i] = kind == KIND_FULL ? (P[r] ? P[r] : tc) : kind == KIND_ROW ? 1 : 0;
        per_row |= kind == KIND_ROW || (kind == KIND_FULL && pitch[n_out + i] != tc);
    }
    dvm_vf_fn f = VF_FNS[I->idx];
    if (!per_row || tr == 1) {
        f(tr * tc, o, x);
        return;
    }
    for (int64_t i = 0; i < tr; i++) {
        float *oi[DVM_VF_MAX_OUTPUTS];
        const float *xi[DVM_VF_MAX_ARGS];
        for (int j = 0; j < n_out; j++) oi[j] = o[j] + i * pitch[j];
        for (int m = 0; m < n_in; m++) xi[m] = x[m] + i * pitch[n_out + m];
        f(tc, oi, xi);
    }
}

/* The program over the tile at (r0, c0) of tr x tc. R: the registers' buffers (S + reg_off),
 * except fp32 LOADs that point into their input; held: what kept registers hold; pf: the
 * prefetching of the next tile, a step per instruction. */
static void run_tile(const dvm_plan *p, float *S, float **R, int64_t *held, int64_t *P, int64_t r0, int64_t c0,
                     int64_t tr, int64_t tc, pf_cursor *pf) {
    for (int k = 0; k < p->n_instr; k++) {
        const dvm_ins *I = &p->ins[k];
        pf_step(pf);
        float *d = R[I->d];
        if (I->direct && I->op != OP_STORE) { /* computed in its output where the tile's rows are contiguous */
            const dvm_tensor *o = &p->out[I->direct - 1];
            d = R[I->d] = tr == 1 || o->rs == tc ? (float *)(o->ptr + (dvm_row(o, r0) + c0 * o->cs) * 4)
                                                 : S + p->reg_off[I->d];
        }
        switch (I->op) {
        case OP_LOAD: {
            const dvm_tensor *t = &p->in[I->idx];
            if (I->keep) { /* held: the column, columns and rows the kept register holds */
                int64_t *h = held + 3 * I->d;
                if (h[0] == c0 && h[1] == tc && h[2] >= tr) break;
                h[0] = c0, h[1] = tc, h[2] = tr;
            }
            if (I->in_place && (tr == 1 || (t->rs == tc && t->linear))) {
                R[I->d] = (float *)(t->ptr + (dvm_row(t, r0) + c0 * t->cs) * 4);
                P[I->d] = 0;
            } else if (I->pitched) { /* only VFs read it: they walk its rows where they lie */
                R[I->d] = (float *)(t->ptr + (dvm_row(t, r0) + c0 * t->cs) * 4);
                P[I->d] = t->rs;
            } else {
                if (I->in_place) R[I->d] = d = S + p->reg_off[I->d];
                load(t, d, I->kd, r0, c0, tr, tc);
            }
            break;
        }
        case OP_CONST: {
            float v = (float)p->imms[I->idx];
            broadcast(d, I->kd, &v, KIND_SCALAR, tr, tc);
            break;
        }
        case OP_STORE:
            if (!(I->direct == 2 || (I->direct && (tr == 1 || p->out[I->idx].rs == tc))))
                store(&p->out[I->idx], R[I->a], I->ka, r0, c0, tr, tc);
            break;
        case OP_COPY: broadcast(d, I->kd, R[I->a], I->ka, tr, tc); break;
        case OP_WHERE: where(d, I->kd, R[I->a], I->ka, R[I->b], I->kb, R[I->c], I->kc, tr, tc); break;
        case OP_RSUM:
        case OP_RMAX:
        case OP_RMIN: reduce_rows(I->op, d, R[I->a], I->ka, tr, tc, p->cols); break;
        case OP_NOP: break;
        case OP_VF: run_vf(p, I, R, P, r0, c0, tr, tc); break;
        case OP_ROT_HALF: rot_half(d, R[I->a], tr, tc); break;
        case OP_MUL_MUL: mul_mul(d, R[I->a], I->ka, R[I->b], I->kb, R[I->c], I->kc, tr, tc); break;
        case OP_SUM_MUL: sum_mul(d, R[I->a], R[I->b], tr, tc); break;
        case OP_UNARY_MUL:
            if (I->kb == KIND_ROW) {
                for (int64_t i = 0; i < tr; i++) unary_mul(I->idx, d + i * tc, R[I->a] + i * tc, R[I->b] + i, 1, tc);
            } else {
                unary_mul(I->idx, d, R[I->a], R[I->b], I->kb == KIND_SCALAR, tr * tc);
            }
            break;
        default:
            if (I->op >= OP_ADD) {
                binary(I->op, d, I->kd, R[I->a], I->ka, R[I->b], I->kb, tr, tc);
            } else {
                int64_t n = I->kd == KIND_FULL ? tr * tc : I->kd == KIND_ROW ? tr : 1;
                unary(I->op, d, R[I->a], n);
            }
        }
    }
}

/* row, column, rows, columns of tile t */
static void tile_at(const dvm_plan *p, int64_t t, int64_t *at) {
    int64_t r0 = (t / p->n_col_tiles) * p->tile_rows, c0 = (t % p->n_col_tiles) * p->tile_cols;
    at[0] = r0;
    at[1] = c0;
    at[2] = p->rows - r0 < p->tile_rows ? p->rows - r0 : p->tile_rows;
    at[3] = p->cols - c0 < p->tile_cols ? p->cols - c0 : p->tile_cols;
}

static void run_tiles(const dvm_plan *p, int64_t t0, int64_t t1, float *scratch) {
    float **R = (float **)(scratch + (p->scratch_floats - 10 * (size_t)p->n_regs));
    int64_t *held = (int64_t *)(R + p->n_regs), *P = held + 3 * p->n_regs;
    for (int r = 0; r < p->n_regs; r++) {
        R[r] = scratch + p->reg_off[r];
        held[3 * r] = -1;
        P[r] = 0; /* the register's rows are packed in the tile (pitch: the tile's columns) */
    }
    int64_t cur[4], next[4] = {0, 0, 0, 0};
    pf_cursor pf;
    if (t0 < t1) tile_at(p, t0, next);
    for (int64_t t = t0; t < t1; t++) {
        memcpy(cur, next, sizeof cur);
        if (t + 1 < t1) tile_at(p, t + 1, next);
        else next[2] = 0;
        pf_plan(p, next, p->n_instr, &pf);
        run_tile(p, scratch, R, held, P, cur[0], cur[1], cur[2], cur[3], &pf);
    }
    stream_fence();
}

const dvm_isa DVM_ISA_TABLE = {DVM_ISA_NAME, run_tiles};

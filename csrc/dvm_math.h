/*
 * Vectorizable float32 math for the DVM interpreter (csrc/dvm_kernels.h).
 *
 * libm's expf & co. do not vectorize without -ffast-math, so every function here is
 * branch-free straight-line code (selects, bit casts, polynomials) that GCC vectorizes inside
 * `#pragma omp simd` loops once inlined. No -ffast-math anywhere: the range reductions and the
 * special cases rely on exact IEEE arithmetic. Polynomial coefficients are near-minimax fits
 * (weighted least squares with Lawson reweighting on Chebyshev nodes, against mpmath), rounded
 * to float32.
 *
 * Measured max error over every float32 input (exhaustive sweep against double-precision libm,
 * in ulps of the float32 result; AVX-512 build with FMA / generic build without):
 *   f_exp        0.99 / 0.95      (subnormal results: within one subnormal step)
 *   f_exp_nonpos 0.98 / 0.95      (x >= -87.33; 0 below, where e^x < 2^-126)
 *   f_expm1      1.44 / 1.49
 *   f_log        0.84 / 0.84
 *   f_log1p      1.44 / 1.44
 *   f_tanh       1.51 / 1.51
 *   f_sigmoid    2.40 / 2.40      (x >= -87.3; 0 below, where the value is < 2^-126)
 *   f_erf        2.29 / 2.91
 *   f_sin, f_cos 1.59 / 1.59      (|x| <= 2^20; larger, inf and NaN inputs go to libm sinf/cosf)
 *   f_silu       3.39 / 3.39
 *   f_gelu_erf   2.63 / 2.66      (x >= -1)
 *   f_gelu_tanh  3.39 / 3.39      (x >= -1; 17 at x >= -3: the rounding of the float32 argument
 *                                  u, amplified by 2|u| in e^-2|u|, as in any float32 formula)
 * Special values: exp(+-inf) = inf / 0, exp overflow -> inf, log(0) = -inf, log(<0) = NaN,
 * tanh and erf saturate to +-1, sigmoid(-inf) = 0, NaN in -> NaN out everywhere.
 */
#ifndef HP_DVM_MATH_H
#define HP_DVM_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define DVM_INLINE static inline __attribute__((always_inline))

/* With a hardware FMA (AVX2 / AVX-512 builds) fused multiply-adds shorten the reductions; the
 * baseline build has no FMA instruction and would call libm's fmaf, so it multiplies and adds. */
#ifdef DVM_HAVE_FMA
#define FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

DVM_INLINE uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

DVM_INLINE float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

DVM_INLINE float copysign_f(float mag, float sign) {
    return u2f((f2u(mag) & 0x7FFFFFFFu) | (f2u(sign) & 0x80000000u));
}

#define SHIFTER 12582912.0f /* 1.5 * 2^23: x + SHIFTER rounds x to an integer held in the low bits */
#define LOG2E 1.44269502163f
#define LN2_HI 0.693145751953125f /* 15 significant bits: n * LN2_HI is exact for |n| < 512 */
#define LN2_LO 1.428606765330187e-06f

/* e^r - 1 for |r| <= ln2 / 2: r + r^2 * P(r). */
DVM_INLINE float expm1_poly(float r) {
    float p = FMA(1.985779818e-04f, r, 1.393360435e-03f);
    p = FMA(p, r, 8.333360776e-03f);
    p = FMA(p, r, 4.166646674e-02f);
    p = FMA(p, r, 1.666666716e-01f);
    p = FMA(p, r, 0.5f);
    return FMA(p, r * r, r);
}

/* x = n * ln2 + r, |r| <= ln2 / 2; returns r and sets *n (an integer-valued float). */
DVM_INLINE float exp_reduce(float x, float *n, int32_t *ni) {
    float t = FMA(x, LOG2E, SHIFTER);
    *n = t - SHIFTER;
    *ni = (int32_t)(f2u(t) - f2u(SHIFTER)); /* same exponent: the difference of the bits is n */
    float r = FMA(*n, -LN2_HI, x);
    return FMA(*n, -LN2_LO, r);
}

/* 2^n for -126 <= n <= 127. */
DVM_INLINE float pow2i(int32_t n) { return u2f((uint32_t)(n + 127) << 23); }

DVM_INLINE float f_exp(float x) {
    x = x < -104.0f ? -104.0f : x; /* e^-104 is below half the smallest subnormal; NaN passes */
    x = x > 89.0f ? 89.0f : x;     /* e^89 overflows */
    float n;
    int32_t ni;
    float p = expm1_poly(exp_reduce(x, &n, &ni));
    /* n lies in [-150, 128]: 2^n as two factors, the first a normal number, the second a power
     * in [2^-24, 2]: the product rounds once, also where it is subnormal or overflows. */
    int32_t n1 = ni < -126 ? -126 : (ni > 127 ? 127 : ni);
    float s1 = pow2i(n1);
    return FMA(p, s1, s1) * pow2i(ni - n1);
}

/* e^x for x <= 0 (or NaN), flushed to 0 where it is below 2^-126 (x < -87.33). The cheap
 * exponential of sigmoid, SiLU, tanh and GELU, which only need it for non-positive arguments:
 * one scale factor, taken straight from the rounding constant's bits. */
#define EXP_NONPOS_MIN -87.33f
DVM_INLINE float f_exp_nonpos(float x) {
    float xc = x < EXP_NONPOS_MIN ? EXP_NONPOS_MIN : x;
    float t = FMA(xc, LOG2E, SHIFTER);
    float n = t - SHIFTER;
    float r = FMA(n, -LN2_HI, xc);
    r = FMA(n, -LN2_LO, r);
    float p = expm1_poly(r);
    /* the bits of t are SHIFTER's plus n, and SHIFTER's bits vanish from the exponent field */
    float s = u2f((f2u(t) + 127u) << 23);
    float e = FMA(p, s, s);
    return x < EXP_NONPOS_MIN ? 0.0f : e;
}

DVM_INLINE float f_expm1(float x) {
    x = x < -18.0f ? -18.0f : x; /* expm1(x < -17.33) rounds to -1 */
    x = x > 89.0f ? 89.0f : x;
    float n;
    int32_t ni;
    float p = expm1_poly(exp_reduce(x, &n, &ni));
    /* 2^n (e^r - 1) + (2^n - 1), rounded once while n <= 64 (2^n - 1 is exact for n <= 24);
     * beyond, the -1 is far below an ulp and 2^n is split so that it does not overflow. */
    int32_t n1 = ni < 64 ? ni : 64, n2 = ni - n1;
    float s1 = pow2i(n1);
    return FMA(p, s1, s1 - pow2i(-n2)) * pow2i(n2);
}

/* log of x > 0, finite, normal; then the special cases. */
DVM_INLINE float log_core(float x, float k_extra) {
    /* x = 2^k * m with m in [sqrt(1/2), sqrt(2)) */
    uint32_t ux = f2u(x) - 0x3F3504F3u; /* bits of sqrt(1/2) */
    float k = (float)((int32_t)ux >> 23) + k_extra;
    float m = u2f((ux & 0x007FFFFFu) + 0x3F3504F3u);
    float f = m - 1.0f;
    /* log(1 + f) = 2 atanh(s), s = f / (2 + f); written as f - (hfsq - s (hfsq + R)) so that the
     * large term f enters exactly */
    float s = f / (2.0f + f);
    float z = s * s;
    float R = FMA(2.333135605e-01f, z, 2.855078280e-01f);
    R = FMA(R, z, 4.000012279e-01f);
    R = FMA(R, z, 6.666666865e-01f);
    R = R * z;
    float hfsq = 0.5f * f * f;
    float lo = FMA(s, hfsq + R, k * LN2_LO);
    return FMA(k, LN2_HI, f - (hfsq - lo));
}

DVM_INLINE float f_log(float x) {
    int sub = x < 1.17549435e-38f; /* subnormals (and zero, negatives: replaced below) */
    float xs = sub ? x * 8388608.0f : x;
    float r = log_core(xs, sub ? -23.0f : 0.0f);
    float special = x < 0.0f ? NAN : (x == 0.0f ? -INFINITY : x); /* also inf and NaN */
    return (x > 0.0f && x < INFINITY) ? r : special;
}

DVM_INLINE float f_log1p(float x) {
    float u = 1.0f + x;
    /* log(1 + x) = log(u) + log((1 + x) / u), the second term to first order; u - 1 is exact */
    float c = (x - (u - 1.0f)) / u;
    c = (u > 0.0f && u < INFINITY) ? c : 0.0f;
    return f_log(u) + c;
}

/* sigmoid(x) = 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below: the exponential never
 * overflows, -inf gives 0 (and x < -87.33, whose sigmoid is below 2^-126); one division. */
DVM_INLINE float f_sigmoid(float x) {
    float e = f_exp_nonpos(-fabsf(x));
    return (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* x sigmoid(x) the same way; silu(-inf) = -inf * 0 = NaN, as PyTorch's x / (1 + exp(-x)). */
DVM_INLINE float f_silu(float x) {
    float e = f_exp_nonpos(-fabsf(x));
    return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

DVM_INLINE float f_tanh(float x) {
    float ax = fabsf(x);
    /* small |x|: odd polynomial x + x^3 T(x^2) */
    float z = x * x;
    float t = FMA(-8.622483583e-04f, z, 3.306284547e-03f);
    t = FMA(t, z, -8.791021071e-03f);
    t = FMA(t, z, 2.185989916e-02f);
    t = FMA(t, z, -5.396763980e-02f);
    t = FMA(t, z, 1.333333254e-01f);
    t = FMA(t, z, -3.333333433e-01f);
    float small = FMA(t * z, x, x);
    /* else (1 - e) / (1 + e), e = e^-2|x|, which saturates to 1 */
    float e = f_exp_nonpos(-2.0f * ax);
    float big = copysign_f((1.0f - e) / (1.0f + e), x);
    return ax < 0.625f ? small : big;
}

/* 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): the same function with
 * one exponential and no cancellation in 1 + tanh for negative x; computed as the sigmoid. */
DVM_INLINE float f_gelu_tanh(float x) {
    float u = 0.7978845608028654f * FMA(0.044715f * x, x * x, x);
    float e = f_exp_nonpos(-2.0f * fabsf(u));
    return (u >= 0.0f ? x : x * e) / (1.0f + e);
}

DVM_INLINE float f_erf(float x) {
    float ax = fabsf(x);
    float z = x * x;
    /* |x| < 1: x E(x^2) */
    float e = FMA(7.853857824e-05f, z, -8.010192541e-04f);
    e = FMA(e, z, 5.188327748e-03f);
    e = FMA(e, z, -2.685381100e-02f);
    e = FMA(e, z, 1.128358543e-01f);
    e = FMA(e, z, -3.761262596e-01f);
    e = FMA(e, z, 1.283791661e-01f); /* 2 / sqrt(pi) - 1: x enters exactly */
    float small = FMA(e, x, x);
    /* 1 <= |x|: 1 - exp(H(|x| - 2.4)), H a fit of log(erfc); erf rounds to 1 from 3.92 on */
    float t = (ax > 3.93f ? 3.93f : ax) - 2.4f;
    float h = FMA(-4.976143941e-08f, t, -2.254152065e-08f);
    h = FMA(h, t, 1.930933422e-06f);
    h = FMA(h, t, -1.447898467e-05f);
    h = FMA(h, t, 8.646243805e-05f);
    h = FMA(h, t, -4.696907708e-04f);
    h = FMA(h, t, 2.387947636e-03f);
    h = FMA(h, t, -1.176803466e-02f);
    h = FMA(h, t, -9.405020475e-01f);
    h = FMA(h, t, -5.164236546e+00f);
    h = FMA(h, t, -7.280974865e+00f);
    float big = copysign_f(1.0f - f_exp_nonpos(h), x);
    return ax < 1.0f ? small : big;
}

DVM_INLINE float f_gelu_erf(float x) { return 0.5f * x * (1.0f + f_erf(x * 0.70710678118654752f)); }

/* sin and cos for |x| <= SINCOS_MAX. The reduction x = q pi/2 + r runs in double with pi/2 in
 * three pieces whose first two have 32 significant bits (products with q < 2^21 are exact), so r
 * is accurate to double precision even next to a multiple of pi/2. */
#define SINCOS_MAX 1048576.0f
DVM_INLINE float sincos_core(float x, uint32_t quadrant_shift) {
    double xd = x;
    double t = xd * 0.63661977236758134308 + 6755399441055744.0; /* 1.5 * 2^52 */
    double q = t - 6755399441055744.0;
    uint64_t tb;
    memcpy(&tb, &t, 8);
    double rd = xd - q * 0x1.921fb544p+0;
    rd = rd - q * 0x1.0b4611a6p-34;
    rd = rd - q * 0x1.3198a2e037073p-69; /* the rest of pi/2 */
    float r = (float)rd;
    float z = r * r;
    float s = FMA(2.724941169e-06f, z, -1.984008268e-04f);
    s = FMA(s, z, 8.333331905e-03f);
    s = FMA(s, z, -1.666666716e-01f);
    s = FMA(s * z, r, r);
    float c = FMA(-2.730068616e-07f, z, 2.480059811e-05f);
    c = FMA(c, z, -1.388888806e-03f);
    c = FMA(c, z, 4.166666791e-02f);
    c = FMA(c * z, z, FMA(-0.5f, z, 1.0f));
    uint32_t quadrant = ((uint32_t)tb + quadrant_shift) & 3u;
    float v = (quadrant & 1u) ? c : s;
    return (quadrant & 2u) ? -v : v;
}

DVM_INLINE float f_sin(float x) { return sincos_core(x, 0); }
DVM_INLINE float f_cos(float x) { return sincos_core(x, 1); }

/* bf16 and fp16 rounding (round to nearest even), NaN kept NaN (quiet, sign kept). */
DVM_INLINE uint16_t f32_to_bf16_bits(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : r);
}

DVM_INLINE float bf16_bits_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* fp32 -> fp16 bits with float arithmetic doing the rounding: scaling |f| by 2^112 then 2^-110
 * maps it to where the fp16 mantissa lines up with the fp32 one for the addition of a bias of
 * the right exponent, whose rounding is the fp16 rounding (subnormals included); overflow comes
 * out as inf. */
DVM_INLINE uint16_t f32_to_f16_bits(float f) {
    uint32_t w = f2u(f);
    uint32_t shl1 = w + w;
    uint32_t sign = w & 0x80000000u;
    float base = (fabsf(f) * 5.192296858534828e+33f) * 7.703719777548943e-34f; /* 2^112, 2^-110 */
    uint32_t bias = shl1 & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = u2f((bias >> 1) + 0x07800000u) + base;
    uint32_t b = f2u(base);
    uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

/* fp16 bits -> fp32, exact: normal values by rebiasing the exponent with a multiply (which also
 * carries inf and NaN), subnormals by subtracting a magic number. */
DVM_INLINE float f16_bits_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w;
    float normal = u2f((two_w >> 4) + 0x70000000u) * 1.925929944387236e-34f; /* 2^-112 */
    float denormal = u2f((two_w >> 17) | 0x3F000000u) - 0.5f;
    uint32_t r = two_w < 0x08000000u ? f2u(denormal) : f2u(normal);
    return u2f(sign | r);
}

#endif

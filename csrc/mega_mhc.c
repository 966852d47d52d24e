/*
 * MegaMHC: DeepSeek-V4's manifold-constrained hyper-connections as fused operations
 * (hyperparallel.kernels.mega_mhc), forward and backward.
 *
 * Streams x are [T, N, D] (a token's N streams are one row of K = N * D values), fp32 or bf16.
 * Per token, the weights come from the RMS-normalized row projected by fn [M, K] (M = (2 + N) N;
 * M = N for the head): z = x . fn^T and r = rsqrt(mean(x^2) + norm_eps), so the normalized
 * projection is a = z * r and one pass over the row gives both. Then
 *   pre  = sigmoid(a_pre * scale0 + base_pre) + hc_eps
 *   post = 2 sigmoid(a_post * scale1 + base_post)
 *   comb = Sinkhorn(softmax_rows(a_comb * scale2 + base_comb) + hc_eps)
 *   collapsed = sum_n pre_n x_n
 * and after the block, out_k = post_k block_out + sum_j comb_jk x_j.
 *
 * [Note: what backward keeps] Forward returns z [T, M] and r [T] (fp32), and backward keeps only
 * those and its inputs. The weights are recomputed per token, the Sinkhorn iterates on a
 * per-thread buffer, so backward differentiates exactly the finite iterations forward ran.
 *
 * Backward of the pre operation is two passes: "weights" (per token: the collapse's gradient
 * w.r.t. pre, then back through the sigmoids, Sinkhorn and softmax to gu, the gradient w.r.t.
 * u = a * scale + base) and "inputs" (the gradients w.r.t. x and fn, with gz = gu * scale * r and
 * coef = r^2 / K (gz . z) from the caller):
 *   grad_x[k]     = sum_m gz[m] fn[m, k] - coef x[k] + grad_collapsed[d] pre[n]    (k = n D + d)
 *   grad_fn[m, k] = sum_t gz[t, m] x[t, k]
 * The inputs pass runs over column chunks of the rows (all tokens for one chunk), so that each
 * thread owns its part of grad_fn: no per-thread copies of [M, K] to add up, and a result that
 * does not depend on the thread count.
 *
 * [Note: blocks] The projection (forward) and the inputs pass (backward) are T x K x M
 * multiply-adds, and fn [M, K] is larger than L1: each takes TB tokens at a time, so that every
 * fn (and grad_fn) vector loaded serves TB tokens, with the sums of a block in registers.
 *
 * [Note: the per-token weights] Sigmoids, softmax and Sinkhorn (a few hundred scalar operations
 * a token) run on LANES tokens at once, one token per vector lane (group_weights), in functions
 * compiled for baseline x86-64 only: their bits never depend on the processor.
 *
 * Math: fp32 throughout, libm's expf for the weights, and every long sum kept in LANES partial
 * sums with a fixed index-to-lane assignment, so that results do not depend on the vector width,
 * the blocking or the thread count. The row loops multiply-add fused where the level has FMA
 * (the x86-64-v3 and v4 copies, the same bits on both); the baseline copy, for processors without
 * FMA (before 2013) or run by hp_mega_mhc_set_isa(0), rounds the products separately.
 */
/* FP operations may be computed ahead of a select (the bf16 rounding's NaN case), which lets GCC
 * vectorize the conversion loops; neither this nor the contraction is -ffast-math (no reordered
 * sums, no approximations). */
#pragma GCC optimize("no-trapping-math")
#pragma GCC optimize("fp-contract=fast")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MHC_VERSION 1
#define LANES 16
#define MAX_STREAMS 8
#define MAX_WEIGHTS ((2 + MAX_STREAMS) * MAX_STREAMS)
/* Elements of a row handled at a time: a converted chunk and the fn rows it meets stay in L1. */
#define CHUNK 256
/* Tokens taken together by the projection and the inputs pass (see [Note: blocks]). */
#define TB 4
/* fn rows a projection step takes together: TB x ROWS running sums in registers. */
#define ROWS 4
/* Columns (of D) per task of the inputs pass: its grad_fn accumulator [M, N, COLS] stays small. */
#define COLS 64
#define COLV (COLS / LANES)

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { MHC_OK = 0, MHC_BAD_ARGUMENT = -1, MHC_NO_MEMORY = -2 };

/* The row loops are compiled once per level of [Note: one ISA choice] (HP_ISA_CLONES): x86-64-v4
 * (AVX-512), v3 (AVX2, FMA) and baseline x86-64. */
#include "hp_isa.h"

HP_ISA_LIBRARY(mega_mhc)
#define INLINE static inline __attribute__((always_inline))

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------------------ rows */

/* LANES floats as one value: GCC lowers its arithmetic to one AVX-512 register, two AVX2 ones or
 * four SSE ones, whichever level's copy runs; loads and stores of it need no alignment. Always inlined:
 * as functions of their own, passing a vec by value would follow no one ABI. */
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
#pragma GCC diagnostic ignored "-Wpsabi"
INLINE vec vload(const float *p) { return *(const vec_unaligned *)p; }
INLINE void vstore(float *p, vec v) { *(vec_unaligned *)p = v; }

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as PyTorch's .to(torch.bfloat16); NaN stays NaN (quieted). */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    uint16_t nan = (uint16_t)((u >> 16) | 0x40u);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

/* n values at element `offset` of an fp32 or bf16 array, as fp32: the array itself (fp32) or buf
 * (bf16, converted). */
INLINE const float *load_f32(const void *array, int dt, int64_t offset, int64_t n, float *restrict buf) {
    if (dt == DT_F32) return (const float *)array + offset;
    const uint16_t *src = (const uint16_t *)array + offset;
    for (int64_t i = 0; i < n; i++) buf[i] = bf16_value(src[i]);
    return buf;
}

/* Writes bytes to dst with non-temporal stores where it can: the large outputs here are written
 * once and not read back soon, and an ordinary store would first read each line in (a third more
 * memory traffic). Callers end with store_fence(). SSE2, so every x86-64 has it. */
#if defined(__x86_64__)
#include <emmintrin.h>
INLINE void stream_bytes(void *dst, const void *src, size_t bytes) {
    char *d = dst;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > bytes) head = bytes;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 16 <= bytes; i += 16) _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    memcpy(d + i, s + i, bytes - i);
}
static inline void store_fence(void) { _mm_sfence(); }
#else
INLINE void stream_bytes(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static inline void store_fence(void) {}
#endif

INLINE void store_f32(void *array, int dt, int64_t offset, int64_t n, const float *restrict v) {
    if (dt == DT_F32) {
        stream_bytes((float *)array + offset, v, (size_t)n * sizeof(float));
        return;
    }
    uint16_t buf[CHUNK];
    for (int64_t c = 0; c < n; c += CHUNK) {
        int64_t len = min64(CHUNK, n - c);
        for (int64_t i = 0; i < len; i++) buf[i] = bf16_round(v[c + i]);
        stream_bytes((uint16_t *)array + offset + c, buf, (size_t)len * sizeof(uint16_t));
    }
}

/* The sum of LANES partial sums, pairwise. */
static float lanes_total(const float *acc) {
    float s[LANES];
    memcpy(s, acc, sizeof s);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) s[l] += s[l + width];
    return s[0];
}

/* acc[r][l] += the products a[r][i] b[i] with i = l (mod LANES), r < R <= MAX_STREAMS. Chunks
 * start at multiples of LANES, so an element's lane is its index in the whole row mod LANES: the
 * order of additions is fixed, whatever the vector width. The R sums are independent, so that
 * the additions' latency overlaps. */
INLINE void dot_rows(const float *const *a, const float *restrict b, int R, int64_t n, float *restrict acc) {
    vec s[MAX_STREAMS];
    for (int r = 0; r < R; r++) s[r] = vload(acc + r * LANES);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vec bv = vload(b + i);
        for (int r = 0; r < R; r++) s[r] += vload(a[r] + i) * bv;
    }
    for (int r = 0; r < R; r++) vstore(acc + r * LANES, s[r]);
    for (int r = 0; r < R; r++)
        for (int l = 0; i + l < n; l++) acc[r * LANES + l] += a[r][i + l] * b[i + l];
}

/* out = sum_j w[j] v_j, j = 0 .. n-1 in order. */
INLINE void weighted_sum(const float *const *v, const float *w, int n, int64_t len, float *restrict out) {
    int64_t e = 0;
    for (; e + LANES <= len; e += LANES) {
        vec o = w[0] * vload(v[0] + e);
        for (int j = 1; j < n; j++) o += w[j] * vload(v[j] + e);
        vstore(out + e, o);
    }
    for (; e < len; e++) {
        float o = w[0] * v[0][e];
        for (int j = 1; j < n; j++) o += w[j] * v[j][e];
        out[e] = o;
    }
}

/* ------------------------------------------------------------ per-token weights, G at once */

/* The weights are a few hundred scalar operations per token (24 exponentials, 39 Sinkhorn steps),
 * the same for every token: they run on G = LANES tokens at once, token l in lane l of a vec (so
 * element i of the tokens' comb matrices is the vec c[i]). These functions have no per-level
 * copies: they are compiled for baseline x86-64 on every machine (SSE2 vectors, no fused
 * multiply-add), so the weights never depend on the processor, and each exponential is libm's
 * expf, lane by lane. */
#define G LANES

typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec vsplat(float x) { return (vec){0} + x; }

static inline vec vexpf(vec u) {
    vec e;
    for (int l = 0; l < LANES; l++) e[l] = expf(u[l]);
    return e;
}

static inline vec vsigmoid(vec u) { return 1.0f / (1.0f + vexpf(-u)); }

static inline vec vmax(vec a, vec b) {
    ivec a_bigger = a > b;
    return (vec)(((ivec)a & a_bigger) | ((ivec)b & ~a_bigger));
}

/* Sinkhorn-Knopp as transformers runs it: columns, then (rows, columns) iters - 1 times. */
static int sinkhorn_steps(int iters) { return iters > 1 ? 2 * iters - 1 : 1; }

/* Step s divides each column (s even) or row (s odd) of c [n, n] by its sum + eps. */
static void sinkhorn_step(vec *c, int n, int s, float eps) {
    int along = s % 2 == 0 ? n : 1;   /* stride between the elements of one sum */
    int across = s % 2 == 0 ? 1 : n;  /* stride between sums */
    for (int i = 0; i < n; i++) {
        vec *v = c + i * across;
        vec sum = v[0];
        for (int j = 1; j < n; j++) sum += v[j * along];
        vec d = sum + eps;
        for (int j = 0; j < n; j++) v[j * along] /= d;
    }
}

/* g: the gradient w.r.t. step s's output, in place -> w.r.t. its input c (out = c / d). */
static void sinkhorn_step_backward(vec *g, const vec *c, int n, int s, float eps) {
    int along = s % 2 == 0 ? n : 1;
    int across = s % 2 == 0 ? 1 : n;
    for (int i = 0; i < n; i++) {
        vec *gv = g + i * across;
        const vec *v = c + i * across;
        vec sum = v[0], gc = gv[0] * v[0];
        for (int j = 1; j < n; j++) {
            sum += v[j * along];
            gc += gv[j * along] * v[j * along];
        }
        vec d = sum + eps;
        vec gd = -gc / (d * d); /* the gradient w.r.t. d, which every element of the sum gets */
        for (int j = 0; j < n; j++) gv[j * along] = gv[j * along] / d + gd;
    }
}

typedef struct {
    int n;      /* streams */
    int head;   /* 1: the hyper-head (pre only, one scale) */
    int iters;  /* Sinkhorn iterations */
    float eps;  /* hc_eps */
} Weights;

static int weight_count(const Weights *w) { return w->head ? w->n : (2 + w->n) * w->n; }

/* The weights of G tokens, lane l for token l. sig: the sigmoids of pre and post; prob: the
 * softmax (before + eps); comb: after Sinkhorn. */
typedef struct {
    vec sig[2 * MAX_STREAMS], pre[MAX_STREAMS], post[MAX_STREAMS];
    vec prob[MAX_STREAMS * MAX_STREAMS], comb[MAX_STREAMS * MAX_STREAMS];
} GroupWeights;

/* The weights of tokens 0 .. tb - 1 (tb <= G) from their projections z [tb, M] and r [tb]
 * (lanes past tb: zeros, unused). trace [steps, n * n]: each Sinkhorn step's input, when given. */
static void group_weights(const Weights *w, const float *z, const float *r, int tb, const float *base,
                          const float *scale, GroupWeights *gw, vec *trace) {
    int n = w->n, nn = n * n, M = weight_count(w);
    vec a[MAX_WEIGHTS];
    for (int m = 0; m < M; m++) {
        a[m] = vsplat(0.0f);
        for (int l = 0; l < tb; l++) a[m][l] = z[(int64_t)l * M + m];
    }
    vec rv = vsplat(1.0f);
    for (int l = 0; l < tb; l++) rv[l] = r[l];
    for (int i = 0; i < n; i++) {
        gw->sig[i] = vsigmoid(a[i] * rv * scale[0] + base[i]);
        gw->pre[i] = gw->sig[i] + w->eps;
    }
    if (w->head) return;
    for (int i = 0; i < n; i++) {
        gw->sig[n + i] = vsigmoid(a[n + i] * rv * scale[1] + base[n + i]);
        gw->post[i] = 2.0f * gw->sig[n + i];
    }
    const vec *ac = a + 2 * n;
    const float *bc = base + 2 * n;
    for (int j = 0; j < n; j++) { /* softmax of each row, as PyTorch: exp(x - max) times 1 / sum */
        vec logit[MAX_STREAMS], top = vsplat(-INFINITY), sum = vsplat(0.0f);
        for (int k = 0; k < n; k++) {
            logit[k] = ac[j * n + k] * rv * scale[2] + bc[j * n + k];
            top = vmax(logit[k], top);
        }
        for (int k = 0; k < n; k++) {
            gw->prob[j * n + k] = vexpf(logit[k] - top);
            sum += gw->prob[j * n + k];
        }
        vec inv = 1.0f / sum;
        for (int k = 0; k < n; k++) {
            gw->prob[j * n + k] *= inv;
            gw->comb[j * n + k] = gw->prob[j * n + k] + w->eps;
        }
    }
    int steps = sinkhorn_steps(w->iters);
    for (int s = 0; s < steps; s++) {
        if (trace) memcpy(trace + (int64_t)s * nn, gw->comb, (size_t)nn * sizeof(vec));
        sinkhorn_step(gw->comb, n, s, w->eps);
    }
}

/* Lane l of v[i] to out[l * stride + i], for l < tb, i < count. */
static void scatter_lanes(const vec *v, int count, int tb, float *out, int64_t stride) {
    for (int l = 0; l < tb; l++)
        for (int i = 0; i < count; i++) out[l * stride + i] = v[i][l];
}

/* out[i] lanes l < tb from in[l * stride + i] (other lanes 0); in may be NULL: all 0. */
static void gather_lanes(const float *in, int64_t stride, int count, int tb, vec *out) {
    for (int i = 0; i < count; i++) {
        out[i] = vsplat(0.0f);
        for (int l = 0; in && l < tb; l++) out[i][l] = in[l * stride + i];
    }
}

/* gu [tb, M]: the gradient w.r.t. u = a * scale + base, and pre [tb, n], from the gradients
 * w.r.t. pre g_pre [tb, n], post g_post [tb, n] and comb g_comb [tb, n * n] (these two may be
 * NULL: zero). The weights again, the Sinkhorn iterates kept in trace. */
static void group_weights_backward(const Weights *w, const float *z, const float *r, int tb, const float *base,
                                   const float *scale, const float *g_pre, const float *g_post,
                                   const float *g_comb, vec *trace, float *pre, float *gu) {
    int n = w->n, nn = n * n, M = weight_count(w);
    GroupWeights gw;
    vec g[MAX_WEIGHTS], gv[MAX_STREAMS * MAX_STREAMS];
    int need_comb = !w->head && g_comb != NULL;
    group_weights(w, z, r, tb, base, scale, &gw, need_comb ? trace : NULL);
    scatter_lanes(gw.pre, n, tb, pre, n);
    gather_lanes(g_pre, n, n, tb, g);
    for (int i = 0; i < n; i++) g[i] = g[i] * (1.0f - gw.sig[i]) * gw.sig[i];
    if (!w->head) {
        gather_lanes(g_post, n, n, tb, g + n);
        for (int i = 0; i < n; i++) {
            vec s = gw.sig[n + i];
            g[n + i] = g[n + i] * 2.0f * (1.0f - s) * s;
        }
        gather_lanes(need_comb ? g_comb : NULL, nn, nn, tb, gv);
        if (need_comb) {
            for (int s = sinkhorn_steps(w->iters) - 1; s >= 0; s--)
                sinkhorn_step_backward(gv, trace + (int64_t)s * nn, n, s, w->eps);
            /* comb0 = prob + eps: the same gradient; then softmax's: prob (g - sum(g prob)) per row */
            for (int j = 0; j < n; j++) {
                vec dot = gv[j * n] * gw.prob[j * n];
                for (int k = 1; k < n; k++) dot += gv[j * n + k] * gw.prob[j * n + k];
                for (int k = 0; k < n; k++) gv[j * n + k] = gw.prob[j * n + k] * (gv[j * n + k] - dot);
            }
        }
        memcpy(g + 2 * n, gv, (size_t)nn * sizeof(vec));
    }
    scatter_lanes(g, M, tb, gu, M);
}

static int valid_shape(int64_t T, int n, int64_t D) {
    return T >= 0 && n >= 1 && n <= MAX_STREAMS && D >= 1;
}

/* ------------------------------------------------------------------------ pre: forward */

/* acc[b][r] += xs[b] . f[r] in lanes (see dot_rows), for b < tb <= TB, r < R <= ROWS: every f
 * vector loaded serves tb tokens. acc[b] is bstride floats after acc[b - 1]. */
INLINE void dot_block(const float *const *f, int R, const float *const *xs, int tb, int64_t n, float *acc,
                      int64_t bstride) {
    vec s[TB][ROWS];
    for (int b = 0; b < tb; b++)
        for (int r = 0; r < R; r++) s[b][r] = vload(acc + b * bstride + r * LANES);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vec xv[TB];
        for (int b = 0; b < tb; b++) xv[b] = vload(xs[b] + i);
        for (int r = 0; r < R; r++) {
            vec fv = vload(f[r] + i);
            for (int b = 0; b < tb; b++) s[b][r] += xv[b] * fv;
        }
    }
    for (int b = 0; b < tb; b++)
        for (int r = 0; r < R; r++) vstore(acc + b * bstride + r * LANES, s[b][r]);
    for (int b = 0; b < tb; b++)
        for (int r = 0; r < R; r++)
            for (int l = 0; i + l < n; l++) acc[b * bstride + r * LANES + l] += xs[b][i + l] * f[r][i + l];
}

/* sq[b] += xs[b] . xs[b] in lanes, b < tb: tb independent sums. */
INLINE void squares_block(const float *const *xs, int tb, int64_t n, float sq[TB][LANES]) {
    vec s[TB];
    for (int b = 0; b < tb; b++) s[b] = vload(sq[b]);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int b = 0; b < tb; b++) {
            vec xv = vload(xs[b] + i);
            s[b] += xv * xv;
        }
    for (int b = 0; b < tb; b++) vstore(sq[b], s[b]);
    for (int b = 0; b < tb; b++)
        for (int l = 0; i + l < n; l++) sq[b][l] += xs[b][i + l] * xs[b][i + l];
}

/* dot_block over all M rows of fn, in groups of constant size (kept in registers). */
INLINE void dot_block_rows(const float *const *f, int M, const float *const *xs, int tb, int64_t n, float *acc,
                           int64_t bstride) {
    int r = 0;
    for (; r + ROWS <= M; r += ROWS) dot_block(f + r, ROWS, xs, tb, n, acc + r * LANES, bstride);
    for (; r < M; r++) dot_block(f + r, 1, xs, tb, n, acc + r * LANES, bstride);
}

/* fn [M, K] chunk by chunk: the M rows of the chunk at c (CHUNK columns, fewer in the last) are
 * contiguous from packed + c M. In fn itself they are K floats apart, and for K a multiple of 1024
 * all at the same L1 set offsets: the rows of a chunk would evict each other. */
static void pack_chunks(const float *fn, int M, int64_t K, float *packed, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < K; c += CHUNK) {
        int64_t len = min64(CHUNK, K - c);
        for (int m = 0; m < M; m++) memcpy(packed + c * M + m * len, fn + (int64_t)m * K + c, (size_t)len * sizeof(float));
    }
}

/* Tokens t0 .. t0 + tb - 1: their projections z [tb, M] (x . fn^T, fn as pack_chunks lays it out)
 * and sums of squares, in one pass over their rows [K]. */
HP_ISA_BODY void project_block_body(const void *x, int x_dt, int64_t t0, int tb, int64_t K, const float *packed,
                                    int M, float *z, float *sumsq) {
    enum { STRIDE = MAX_WEIGHTS * LANES };
    float acc[TB * STRIDE], sq[TB][LANES], buf[TB][CHUNK];
    const float *xs[TB], *rows[MAX_WEIGHTS];
    for (int b = 0; b < tb; b++) memset(acc + b * STRIDE, 0, (size_t)M * LANES * sizeof(float));
    memset(sq, 0, sizeof sq);
    for (int64_t c = 0; c < K; c += CHUNK) {
        int64_t len = min64(CHUNK, K - c);
        for (int b = 0; b < tb; b++) xs[b] = load_f32(x, x_dt, (t0 + b) * K + c, len, buf[b]);
        if (tb == TB)
            squares_block(xs, TB, len, sq);
        else
            squares_block(xs, tb, len, sq);
        for (int m = 0; m < M; m++) rows[m] = packed + c * M + m * len;
        if (tb == TB)
            dot_block_rows(rows, M, xs, TB, len, acc, STRIDE); /* constant trip counts */
        else
            dot_block_rows(rows, M, xs, tb, len, acc, STRIDE);
    }
    for (int b = 0; b < tb; b++) {
        for (int m = 0; m < M; m++) z[(int64_t)b * M + m] = lanes_total(acc + b * STRIDE + m * LANES);
        sumsq[b] = lanes_total(sq[b]);
    }
}
HP_ISA_CLONES(void, project_block,
              (const void *x, int x_dt, int64_t t0, int tb, int64_t K, const float *packed, int M, float *z,
               float *sumsq),
              (x, x_dt, t0, tb, K, packed, M, z, sumsq))

/* collapsed [D] = sum_n pre_n x_n for one token. */
INLINE void collapse_body(const void *x, int x_dt, int64_t t, int n, int64_t D, const float *pre, void *collapsed,
                          int col_dt) {
    float bufs[MAX_STREAMS][CHUNK], out[CHUNK];
    const float *rows[MAX_STREAMS];
    for (int64_t d = 0; d < D; d += CHUNK) {
        int64_t len = min64(CHUNK, D - d);
        for (int i = 0; i < n; i++) rows[i] = load_f32(x, x_dt, (t * n + i) * D + d, len, bufs[i]);
        weighted_sum(rows, pre, n, len, out);
        store_f32(collapsed, col_dt, t * D + d, len, out);
    }
}

HP_ISA_BODY void collapse_token_body(const void *x, int x_dt, int64_t t, int n, int64_t D, const float *pre,
                                     void *collapsed, int col_dt) {
    if (n == 4)
        collapse_body(x, x_dt, t, 4, D, pre, collapsed, col_dt);
    else
        collapse_body(x, x_dt, t, n, D, pre, collapsed, col_dt);
    store_fence();
}
HP_ISA_CLONES(void, collapse_token,
              (const void *x, int x_dt, int64_t t, int n, int64_t D, const float *pre, void *collapsed,
               int col_dt),
              (x, x_dt, t, n, D, pre, collapsed, col_dt))

/* post [T, n], comb [T, n, n] (both skipped for the head), collapsed [T, D], and what backward
 * keeps: z [T, M], r [T]. */
int hp_mega_mhc_pre_forward(const void *x, int x_dt, int64_t T, int n, int64_t D, const float *fn,
                            const float *base, const float *scale, int head, int iters, float hc_eps, float norm_eps,
                            float *z, float *r, float *post, float *comb, void *collapsed, int col_dt, int threads) {
    if (!valid_shape(T, n, D)) return MHC_BAD_ARGUMENT;
    Weights w = {n, head, iters, hc_eps};
    int M = weight_count(&w);
    int64_t K = (int64_t)n * D, groups = (T + G - 1) / G;
    float *packed = malloc((size_t)M * K * sizeof(float));
    if (!packed) return MHC_NO_MEMORY;
    pack_chunks(fn, M, K, packed, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t grp = 0; grp < groups; grp++) {
        int64_t t0 = grp * G;
        int tg = (int)min64(G, T - t0);
        for (int b0 = 0; b0 < tg; b0 += TB) { /* the projections, TB tokens at a time */
            float sumsq[TB];
            int tb = (int)min64(TB, tg - b0);
            project_block(x, x_dt, t0 + b0, tb, K, packed, M, z + (t0 + b0) * M, sumsq);
            for (int b = 0; b < tb; b++) r[t0 + b0 + b] = 1.0f / sqrtf(sumsq[b] / (float)K + norm_eps);
        }
        GroupWeights gw;
        float pre[G * MAX_STREAMS];
        group_weights(&w, z + t0 * M, r + t0, tg, base, scale, &gw, NULL);
        scatter_lanes(gw.pre, n, tg, pre, n);
        if (!head) {
            scatter_lanes(gw.post, n, tg, post + t0 * n, n);
            scatter_lanes(gw.comb, n * n, tg, comb + t0 * n * n, n * n);
        }
        for (int l = 0; l < tg; l++) collapse_token(x, x_dt, t0 + l, n, D, pre + l * n, collapsed, col_dt);
    }
    free(packed);
    return MHC_OK;
}

/* ---------------------------------------------------------------------- pre: backward */

/* g_pre [n] = grad_collapsed . x_n for one token. */
INLINE void collapse_backward_body(const void *x, int x_dt, const void *g_col, int g_dt, int64_t t, int n,
                                   int64_t D, float *g_pre) {
    float acc[MAX_STREAMS][LANES], gbuf[CHUNK], xbufs[MAX_STREAMS][CHUNK];
    const float *rows[MAX_STREAMS];
    memset(acc, 0, sizeof acc);
    for (int64_t d = 0; d < D; d += CHUNK) {
        int64_t len = min64(CHUNK, D - d);
        const float *gs = load_f32(g_col, g_dt, t * D + d, len, gbuf);
        for (int i = 0; i < n; i++) rows[i] = load_f32(x, x_dt, (t * n + i) * D + d, len, xbufs[i]);
        dot_rows(rows, gs, n, len, acc[0]);
    }
    for (int i = 0; i < n; i++) g_pre[i] = lanes_total(acc[i]);
}

HP_ISA_BODY void collapse_backward_token_body(const void *x, int x_dt, const void *g_col, int g_dt, int64_t t,
                                              int n, int64_t D, float *g_pre) {
    if (n == 4)
        collapse_backward_body(x, x_dt, g_col, g_dt, t, 4, D, g_pre);
    else
        collapse_backward_body(x, x_dt, g_col, g_dt, t, n, D, g_pre);
}
HP_ISA_CLONES(void, collapse_backward_token,
              (const void *x, int x_dt, const void *g_col, int g_dt, int64_t t, int n, int64_t D,
               float *g_pre),
              (x, x_dt, g_col, g_dt, t, n, D, g_pre))

/* The weights pass: gu [T, M] (the gradient w.r.t. u = a * scale + base) and pre [T, n].
 * g_post [T, n], g_comb [T, n, n] and g_col [T, D] may each be NULL (no gradient: zero). */
int hp_mega_mhc_pre_backward_weights(const void *x, int x_dt, int64_t T, int n, int64_t D, const float *z,
                                     const float *r, const float *base, const float *scale, int head, int iters,
                                     float hc_eps, const float *g_post, const float *g_comb, const void *g_col,
                                     int g_dt, float *gu, float *pre, int threads) {
    if (!valid_shape(T, n, D)) return MHC_BAD_ARGUMENT;
    Weights w = {n, head, iters, hc_eps};
    int M = weight_count(&w);
    int64_t groups = (T + G - 1) / G;
    int status = MHC_OK;
#pragma omp parallel num_threads(threads)
    {
        /* (aligned as a vec must be: malloc's 16 bytes are not enough for AVX's vector moves) */
        vec *trace = aligned_alloc(sizeof(vec), (size_t)sinkhorn_steps(iters) * n * n * sizeof(vec));
        if (!trace) {
#pragma omp atomic write
            status = MHC_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t grp = 0; grp < groups; grp++) {
            if (!trace) continue;
            int64_t t0 = grp * G;
            int tg = (int)min64(G, T - t0);
            float g_pre[G * MAX_STREAMS] = {0};
            for (int l = 0; g_col && l < tg; l++) collapse_backward_token(x, x_dt, g_col, g_dt, t0 + l, n, D, g_pre + l * n);
            group_weights_backward(&w, z + t0 * M, r + t0, tg, base, scale, g_pre, g_post ? g_post + t0 * n : NULL,
                                   g_comb ? g_comb + t0 * n * n : NULL, trace, pre + t0 * n, gu + t0 * M);
        }
        free(trace);
    }
    return status;
}

typedef struct {
    const void *x, *g_col;
    int x_dt, g_dt, gx_dt, n, M;
    int64_t T, D, K;
    const float *fn, *gz, *coef, *pre;
    void *grad_x;
    float *grad_fn;
} InputsPass;

/* acc[m, i, :len] += sum_b gz[b, m] x_b[:len], b in token order (acc: [M, n, COLS]). The vector
 * path (tb == TB, len == COLS) holds the TB x COLS inputs in registers over all M rows. */
INLINE void accumulate_fn(float *acc, int n, int i, int M, const float *gz, int tb, int64_t len,
                          const float *const *x) {
    if (tb == TB && len == COLS) {
        vec xv[TB][COLV];
        for (int b = 0; b < TB; b++)
            for (int v = 0; v < COLV; v++) xv[b][v] = vload(x[b] + v * LANES);
        for (int m = 0; m < M; m++) {
            float *a = acc + ((int64_t)m * n + i) * COLS;
            for (int v = 0; v < COLV; v++) {
                vec s = vload(a + v * LANES);
                for (int b = 0; b < TB; b++) s += gz[(int64_t)b * M + m] * xv[b][v];
                vstore(a + v * LANES, s);
            }
        }
        return;
    }
    for (int m = 0; m < M; m++) {
        float *a = acc + ((int64_t)m * n + i) * COLS;
        for (int64_t e = 0; e < len; e++) {
            float s = a[e];
            for (int b = 0; b < tb; b++) s += gz[(int64_t)b * M + m] * x[b][e];
            a[e] = s;
        }
    }
}

/* gx[b] = sum_m gz[b, m] fn[m, :len] (fn: the chunk's rows, COLS apart), m in order. */
INLINE void project_back(const float *fn, int64_t K, int M, const float *gz, int tb, int64_t len,
                         float gx[TB][COLS]) {
    if (tb == TB && len == COLS) {
        vec s[TB][COLV];
        for (int b = 0; b < TB; b++)
            for (int v = 0; v < COLV; v++) s[b][v] = (vec){0};
        for (int m = 0; m < M; m++) {
            vec fv[COLV];
            for (int v = 0; v < COLV; v++) fv[v] = vload(fn + (int64_t)m * K + v * LANES);
            for (int b = 0; b < TB; b++) {
                float g = gz[(int64_t)b * M + m];
                for (int v = 0; v < COLV; v++) s[b][v] += g * fv[v];
            }
        }
        for (int b = 0; b < TB; b++)
            for (int v = 0; v < COLV; v++) vstore(gx[b] + v * LANES, s[b][v]);
        return;
    }
    for (int b = 0; b < tb; b++)
        for (int64_t e = 0; e < len; e++) gx[b][e] = 0.0f;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < tb; b++) {
            float g = gz[(int64_t)b * M + m];
            for (int64_t e = 0; e < len; e++) gx[b][e] += g * fn[(int64_t)m * K + e];
        }
}

/* Tokens [t0, t0 + tb), stream i, columns [d0, d0 + len): grad_x, and acc (when given). fnc:
 * the chunk's columns of fn, [n, M, COLS]. */
INLINE void inputs_block(const InputsPass *p, int64_t t0, int tb, int i, int64_t d0, int64_t len,
                         const float *const *g_col, const float *fnc, float *acc) {
    float xbuf[TB][COLS], gx[TB][COLS], out[COLS];
    const float *x[TB];
    int64_t k0 = (int64_t)i * p->D + d0;
    for (int b = 0; b < tb; b++) x[b] = load_f32(p->x, p->x_dt, (t0 + b) * p->K + k0, len, xbuf[b]);
    const float *gz = p->gz + t0 * p->M;
    if (acc) accumulate_fn(acc, p->n, i, p->M, gz, tb, len, x);
    if (!p->grad_x) return;
    project_back(fnc + (int64_t)i * p->M * COLS, COLS, p->M, gz, tb, len, gx);
    for (int b = 0; b < tb; b++) {
        float coef = p->coef[t0 + b], pre = p->pre[(t0 + b) * p->n + i];
        int64_t e = 0;
        for (; e + LANES <= len; e += LANES) {
            vec o = vload(gx[b] + e) - coef * vload(x[b] + e);
            vstore(out + e, g_col ? o + pre * vload(g_col[b] + e) : o);
        }
        for (; e < len; e++) {
            float o = gx[b][e] - coef * x[b][e];
            out[e] = g_col ? o + pre * g_col[b][e] : o;
        }
        store_f32(p->grad_x, p->gx_dt, (t0 + b) * p->K + k0, len, out);
    }
}

/* Asks for the cache lines of [start, start + bytes) ahead of their use. The inputs pass reads a
 * few hundred bytes per row, rows K floats apart: more than the hardware prefetchers follow. */
INLINE void prefetch(const void *start, int64_t bytes, int for_write) {
    for (int64_t o = 0; o < bytes; o += 64) {
        if (for_write)
            __builtin_prefetch((const char *)start + o, 1);
        else
            __builtin_prefetch((const char *)start + o, 0);
    }
}

/* Token blocks the inputs pass prefetches ahead. */
#define PREFETCH_BLOCKS 2

INLINE void prefetch_block(const InputsPass *p, int64_t t0, int64_t d0, int64_t len) {
    int64_t xs = p->x_dt == DT_F32 ? 4 : 2, gs = p->g_dt == DT_F32 ? 4 : 2, os = p->gx_dt == DT_F32 ? 4 : 2;
    for (int64_t t = t0; t < min64(t0 + TB, p->T); t++) {
        if (p->g_col) prefetch((const char *)p->g_col + (t * p->D + d0) * gs, len * gs, 0);
        for (int i = 0; i < p->n; i++) {
            int64_t k = t * p->K + (int64_t)i * p->D + d0;
            prefetch((const char *)p->x + k * xs, len * xs, 0);
            if (p->grad_x) prefetch((char *)p->grad_x + k * os, len * os, 1);
        }
    }
}

/* Every token's part of columns [d0, d0 + len) of each stream; acc (when given) ends as those
 * columns of grad_fn, accumulated in token order. fnc: room for those columns of fn, [n, M, COLS]
 * (copied there once: in fn its rows are K floats apart, see pack_chunks). */
HP_ISA_BODY void inputs_chunk_body(const InputsPass *p, int64_t d0, int64_t len, float *fnc, float *acc) {
    float gbuf[TB][COLS];
    const float *g_col[TB];
    if (acc) memset(acc, 0, (size_t)p->M * p->n * COLS * sizeof(float));
    for (int i = 0; p->grad_x && i < p->n; i++)
        for (int m = 0; m < p->M; m++)
            memcpy(fnc + ((int64_t)i * p->M + m) * COLS, p->fn + (int64_t)m * p->K + (int64_t)i * p->D + d0,
                   (size_t)len * sizeof(float));
    for (int64_t t0 = 0; t0 < p->T; t0 += TB) {
        int tb = (int)min64(TB, p->T - t0);
        prefetch_block(p, t0 + PREFETCH_BLOCKS * TB, d0, len);
        for (int b = 0; p->g_col && b < tb; b++) g_col[b] = load_f32(p->g_col, p->g_dt, (t0 + b) * p->D + d0, len, gbuf[b]);
        for (int i = 0; i < p->n; i++) {
            if (tb == TB && len == COLS) /* the common case, with constant trip counts */
                inputs_block(p, t0, TB, i, d0, COLS, p->g_col ? g_col : NULL, fnc, acc);
            else
                inputs_block(p, t0, tb, i, d0, len, p->g_col ? g_col : NULL, fnc, acc);
        }
    }
    store_fence();
}
HP_ISA_CLONES(void, inputs_chunk,
              (const InputsPass *p, int64_t d0, int64_t len, float *fnc, float *acc),
              (p, d0, len, fnc, acc))

/* The inputs pass: grad_x [T, n, D] (when given, in gx_dt) and grad_fn [M, K] (when given) from
 * gz [T, M], coef [T], pre [T, n] and g_col [T, D] (may be NULL). */
int hp_mega_mhc_pre_backward_inputs(const void *x, int x_dt, int64_t T, int n, int64_t D, const float *fn, int M,
                                    const float *gz, const float *coef, const float *pre, const void *g_col,
                                    int g_dt, void *grad_x, int gx_dt, float *grad_fn, int threads) {
    if (!valid_shape(T, n, D) || M < 1 || M > MAX_WEIGHTS) return MHC_BAD_ARGUMENT;
    InputsPass p = {x, g_col, x_dt, g_dt, gx_dt, n, M, T, D, (int64_t)n * D, fn, gz, coef, pre, grad_x, grad_fn};
    int64_t chunks = (D + COLS - 1) / COLS;
    int status = MHC_OK;
#pragma omp parallel num_threads(threads)
    {
        size_t bytes = (size_t)M * n * COLS * sizeof(float);
        float *acc = grad_fn ? malloc(bytes) : NULL, *fnc = grad_x ? malloc(bytes) : NULL;
        int ok = (!grad_fn || acc) && (!grad_x || fnc);
        if (!ok) {
#pragma omp atomic write
            status = MHC_NO_MEMORY;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!ok) continue;
            int64_t d0 = c * COLS, len = min64(COLS, D - d0);
            inputs_chunk(&p, d0, len, fnc, acc);
            for (int m = 0; acc && m < M; m++)
                for (int i = 0; i < n; i++)
                    memcpy(grad_fn + (int64_t)m * p.K + (int64_t)i * D + d0, acc + ((int64_t)m * n + i) * COLS,
                           (size_t)len * sizeof(float));
        }
        free(acc);
        free(fnc);
    }
    return status;
}

/* ---------------------------------------------------------------------------- post */

/* One token of mhc_post's forward: out_k = post_k block_out + sum_j comb_jk x_j. */
INLINE void post_body(const void *block_out, int bo_dt, const void *x, int x_dt, int64_t t, int n, int64_t D,
                      const float *post, const float *comb, void *out, int out_dt) {
    float bufs[MAX_STREAMS + 1][CHUNK], o[CHUNK], w[MAX_STREAMS + 1];
    const float *rows[MAX_STREAMS + 1];
    for (int64_t d = 0; d < D; d += CHUNK) {
        int64_t len = min64(CHUNK, D - d);
        rows[0] = load_f32(block_out, bo_dt, t * D + d, len, bufs[0]);
        for (int j = 0; j < n; j++) rows[1 + j] = load_f32(x, x_dt, (t * n + j) * D + d, len, bufs[1 + j]);
        for (int k = 0; k < n; k++) {
            w[0] = post[t * n + k];
            for (int j = 0; j < n; j++) w[1 + j] = comb[(t * n + j) * n + k];
            weighted_sum(rows, w, n + 1, len, o);
            store_f32(out, out_dt, (t * n + k) * D + d, len, o);
        }
    }
}

HP_ISA_BODY void post_token_body(const void *block_out, int bo_dt, const void *x, int x_dt, int64_t t, int n,
                                 int64_t D, const float *post, const float *comb, void *out, int out_dt) {
    if (n == 4)
        post_body(block_out, bo_dt, x, x_dt, t, 4, D, post, comb, out, out_dt);
    else
        post_body(block_out, bo_dt, x, x_dt, t, n, D, post, comb, out, out_dt);
    store_fence();
}
HP_ISA_CLONES(void, post_token,
              (const void *block_out, int bo_dt, const void *x, int x_dt, int64_t t, int n, int64_t D,
               const float *post, const float *comb, void *out, int out_dt),
              (block_out, bo_dt, x, x_dt, t, n, D, post, comb, out, out_dt))

/* out [T, n, D] (out_dt) = post_k block_out + sum_j comb_jk x_j, per token. */
int hp_mega_mhc_post_forward(const void *block_out, int bo_dt, const void *x, int x_dt, int64_t T, int n, int64_t D,
                             const float *post, const float *comb, void *out, int out_dt, int threads) {
    if (!valid_shape(T, n, D)) return MHC_BAD_ARGUMENT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) post_token(block_out, bo_dt, x, x_dt, t, n, D, post, comb, out, out_dt);
    return MHC_OK;
}

typedef struct {
    const void *g, *block_out, *x;
    int g_dt, bo_dt, x_dt, gbo_dt, gx_dt, n;
    int64_t D;
    const float *post, *comb;
    void *g_bo, *g_x;
    float *g_post, *g_comb;
} PostBackward;

/* One token of mhc_post's backward, each gradient only when asked for. */
INLINE void post_backward_body(const PostBackward *p, int64_t t, int n) {
    int64_t D = p->D;
    float gbufs[MAX_STREAMS][CHUNK], xbuf[CHUNK], bbuf[CHUNK], o[CHUNK], w[MAX_STREAMS];
    float acc_post[MAX_STREAMS][LANES], acc_comb[MAX_STREAMS * MAX_STREAMS][LANES];
    const float *grows[MAX_STREAMS];
    const float *pt = p->post + t * n, *ct = p->comb + t * n * n;
    memset(acc_post, 0, sizeof acc_post);
    memset(acc_comb, 0, sizeof acc_comb);
    for (int64_t d = 0; d < D; d += CHUNK) {
        int64_t len = min64(CHUNK, D - d);
        for (int k = 0; k < n; k++) grows[k] = load_f32(p->g, p->g_dt, (t * n + k) * D + d, len, gbufs[k]);
        if (p->g_bo) {
            weighted_sum(grows, pt, n, len, o);
            store_f32(p->g_bo, p->gbo_dt, t * D + d, len, o);
        }
        if (p->g_post) dot_rows(grows, load_f32(p->block_out, p->bo_dt, t * D + d, len, bbuf), n, len, acc_post[0]);
        for (int j = 0; j < n; j++) {
            if (p->g_x) {
                for (int k = 0; k < n; k++) w[k] = ct[j * n + k];
                weighted_sum(grows, w, n, len, o);
                store_f32(p->g_x, p->gx_dt, (t * n + j) * D + d, len, o);
            }
            if (p->g_comb)
                dot_rows(grows, load_f32(p->x, p->x_dt, (t * n + j) * D + d, len, xbuf), n, len, acc_comb[j * n]);
        }
    }
    for (int k = 0; p->g_post && k < n; k++) p->g_post[t * n + k] = lanes_total(acc_post[k]);
    for (int jk = 0; p->g_comb && jk < n * n; jk++) p->g_comb[t * n * n + jk] = lanes_total(acc_comb[jk]);
}

/* DeepSeek-V4's N = 4 gets its own copy, compiled with the loops over streams unrolled. */
HP_ISA_BODY void post_backward_token_body(const PostBackward *p, int64_t t) {
    if (p->n == 4)
        post_backward_body(p, t, 4);
    else
        post_backward_body(p, t, p->n);
    store_fence();
}
HP_ISA_CLONES(void, post_backward_token,
              (const PostBackward *p, int64_t t),
              (p, t))

/* From g = the gradient w.r.t. out [T, n, D]: g_bo [T, D], g_x [T, n, D], g_post [T, n] and
 * g_comb [T, n, n], each only when given (not NULL). */
int hp_mega_mhc_post_backward(const void *g, int g_dt, const void *block_out, int bo_dt, const void *x, int x_dt,
                              int64_t T, int n, int64_t D, const float *post, const float *comb, void *g_bo,
                              int gbo_dt, void *g_x, int gx_dt, float *g_post, float *g_comb, int threads) {
    if (!valid_shape(T, n, D)) return MHC_BAD_ARGUMENT;
    PostBackward p = {g, block_out, x, g_dt, bo_dt, x_dt, gbo_dt, gx_dt, n, D, post, comb, g_bo, g_x, g_post, g_comb};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) post_backward_token(&p, t);
    return MHC_OK;
}

int hp_mega_mhc_version(void) { return MHC_VERSION; }

/*
 * MegaGate: the fused MoE router (hyperparallel.kernels.mega_gate), forward and backward.
 *
 * Each token's row of router logits [E] is taken once, in L1, through everything the router's
 * torch ops do one after the other over the whole [T, E]: the scores (softmax, sigmoid or sqrt(softplus)), the choice (scores plus
 * the correction bias, restricted to the best groups), the top k, the weights (gathered,
 * renormalized, scaled), the per-expert loads and the per-expert sums of the auxiliary loss's
 * distribution. Backward recomputes the scores from the logits (nothing [T, E] is saved).
 *
 * Rows are split over OpenMP threads in fixed contiguous ranges; each thread keeps its own loads
 * and probability sums, added up in thread order afterwards, so that a result depends on the
 * thread count only (never on scheduling). Probability sums are accumulated in double: they are
 * sums over all tokens and should not lose digits as T grows.
 *
 * Math: the exponential and log1p are the vectorizable float32 functions of dvm_math.h (within
 * 1.5 ulp, branch-free), not libm's: libm's calls do not vectorize without -ffast-math, and a
 * scalar log1pf per element made the sqrt-softplus forward slower than PyTorch's vectorized ops.
 * No fused multiply-adds (DVM_HAVE_FMA is left undefined, and the build has -ffp-contract=off), so
 * every level's copy of the row loops rounds every element the same way; only the order of the
 * row sums (softmax's denominator) follows the vector width.
 */
/* What the DVM build gets from -fno-trapping-math (setup.py), for this file alone: FP operations
 * may be computed ahead of a select (both sides of `c ? a : b`, as dvm_math.h's functions are
 * written), which is what lets GCC vectorize the row loops. It changes no result. */
#pragma GCC optimize("no-trapping-math")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dvm_math.h"

/* The row loops are compiled once per level of [Note: one ISA choice] (HP_ISA_CLONES), for these
 * targets at AVX-512 and AVX2, baseline x86-64 at the generic level: a portable build that still
 * uses the widest vectors. */
#define HP_ISA_AVX512_TARGET "avx512f"
#define HP_ISA_AVX2_TARGET "avx2"
#include "hp_isa.h"

HP_ISA_LIBRARY(mega_gate)

enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1, SCORE_SQRTSOFTPLUS = 2 };
enum { MG_OK = 0, MG_BAD_HASH_INDEX = -1, MG_NO_MEMORY = -2 };

/* PyTorch's softplus threshold (beta 1): above it softplus(x) is x. */
#define SOFTPLUS_THRESHOLD 20.0f

static inline float sigmoid_score(float x) { return 1.0f / (1.0f + f_exp(-x)); }

static inline float softplus(float x) { return x > SOFTPLUS_THRESHOLD ? x : f_log1p(f_exp(x)); }

/* An element-wise score (sigmoid or sqrt-softplus) of one logit: the value row_scores gives. */
static inline float elementwise_score(int score, float x) {
    return score == SCORE_SIGMOID ? sigmoid_score(x) : sqrtf(softplus(x));
}

/* ------------------------------------------------------------------------- vectorized rows */

/* v = sqrt(v), IEEE-rounded as sqrtf. GCC keeps sqrtf scalar where it must set errno, and only
 * the command line can say it need not (-fno-math-errno; not a pragma): the vector instructions
 * are spelled out here, AVX-512 at that level, else SSE2 (every x86-64). */
#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"))) static void sqrt_row_avx512(float *v, int64_t n) {
    int64_t e = 0;
    for (; e + 16 <= n; e += 16) _mm512_storeu_ps(v + e, _mm512_sqrt_ps(_mm512_loadu_ps(v + e)));
    for (; e < n; e++) v[e] = sqrtf(v[e]);
}

static void sqrt_row_sse2(float *v, int64_t n) {
    int64_t e = 0;
    for (; e + 4 <= n; e += 4) _mm_storeu_ps(v + e, _mm_sqrt_ps(_mm_loadu_ps(v + e)));
    for (; e < n; e++) v[e] = sqrtf(v[e]);
}

static void sqrt_row(float *v, int64_t n) {
#ifdef HP_ISA_X86
    if (hp_isa_level() == HP_ISA_AVX512) {
        sqrt_row_avx512(v, n);
        return;
    }
#endif
    sqrt_row_sse2(v, n);
}
#else
static void sqrt_row(float *v, int64_t n) {
    for (int64_t e = 0; e < n; e++) v[e] = sqrtf(v[e]);
}
#endif

/* p = the scores of one row of logits x[E]. Softmax as PyTorch computes it: exp(x - max), times
 * the reciprocal of their sum. */
HP_ISA_BODY void row_scores_body(const float *restrict x, int64_t E, int score, float *restrict p) {
    if (score == SCORE_SOFTMAX) {
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t e = 0; e < E; e++) m = x[e] > m ? x[e] : m;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t e = 0; e < E; e++) {
            p[e] = f_exp(x[e] - m);
            s += p[e];
        }
        float r = 1.0f / s;
#pragma omp simd
        for (int64_t e = 0; e < E; e++) p[e] *= r;
    } else if (score == SCORE_SIGMOID) {
#pragma omp simd
        for (int64_t e = 0; e < E; e++) p[e] = sigmoid_score(x[e]);
    } else {
        /* Two loops and sqrt_row: GCC vectorizes no exp-into-log1p in one loop body. */
#pragma omp simd
        for (int64_t e = 0; e < E; e++) p[e] = f_exp(x[e]);
#pragma omp simd
        for (int64_t e = 0; e < E; e++) {
            float below = f_log1p(p[e]);
            p[e] = x[e] > SOFTPLUS_THRESHOLD ? x[e] : below;
        }
        sqrt_row(p, E);
    }
}
HP_ISA_CLONES(void, row_scores,
              (const float *restrict x, int64_t E, int score, float *restrict p),
              (x, E, score, p))

HP_ISA_BODY void add_bias_body(const float *restrict p, const float *restrict bias, int64_t E, float *restrict choice) {
#pragma omp simd
    for (int64_t e = 0; e < E; e++) choice[e] = p[e] + bias[e];
}
HP_ISA_CLONES(void, add_bias,
              (const float *restrict p, const float *restrict bias, int64_t E, float *restrict choice),
              (p, bias, E, choice))

HP_ISA_BODY float row_sum_body(const float *restrict v, int64_t E) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t e = 0; e < E; e++) s += v[e];
    return s;
}
HP_ISA_CLONES(float, row_sum,
              (const float *restrict v, int64_t E),
              (v, E))

/* acc += v (softmax) or acc += v / sum(v) (the others: a distribution over the experts). */
HP_ISA_BODY void accumulate_distribution_body(const float *restrict p, int64_t E, int normalize, double *restrict acc) {
    if (!normalize) {
#pragma omp simd
        for (int64_t e = 0; e < E; e++) acc[e] += (double)p[e];
        return;
    }
    float total = row_sum(p, E);
#pragma omp simd
    for (int64_t e = 0; e < E; e++) acc[e] += (double)(p[e] / total);
}
HP_ISA_CLONES(void, accumulate_distribution,
              (const float *restrict p, int64_t E, int normalize, double *restrict acc),
              (p, E, normalize, acc))

/* ------------------------------------------------------------------------------- selection */
/*
 * Two ways to the same top k, in torch.topk's order (descending, equal values by lower index):
 * - k rounds of a vectorized max and a vectorized lowest-index-of-the-max, the winner then set
 *   to -inf. No data-dependent branch: about twice as fast as insertion at E = 64..1024 (an
 *   insertion into a sorted list mispredicts on nearly every element it takes).
 * - insertion, for rows holding a NaN, which torch.topk ranks above every number (the rounds'
 *   max reduction has no defined NaN order).
 * The choice of the experts a row may take is never -inf where it matters: p + bias is finite,
 * and the groups leave at least k experts eligible (checked in Python).
 */

HP_ISA_BODY int has_nan_body(const float *restrict v, int64_t n) {
    int nan = 0;
#pragma omp simd reduction(| : nan)
    for (int64_t e = 0; e < n; e++) nan |= v[e] != v[e];
    return nan;
}
HP_ISA_CLONES(int, has_nan,
              (const float *restrict v, int64_t n),
              (v, n))

/* The k largest of c[0..n) by rounds; c's winners are left at -inf. c holds no NaN, so the
 * max is one of its values and the index search finds it. */
HP_ISA_BODY void top_k_rounds_body(float *restrict c, int n, int k, int64_t *restrict idx) {
    for (int j = 0; j < k; j++) {
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int e = 0; e < n; e++) m = c[e] > m ? c[e] : m;
        int first = n;
#pragma omp simd reduction(min : first)
        for (int e = 0; e < n; e++) {
            int candidate = c[e] == m ? e : n;
            first = candidate < first ? candidate : first;
        }
        idx[j] = first;
        c[first] = -INFINITY;
    }
}
HP_ISA_CLONES(void, top_k_rounds,
              (float *restrict c, int n, int k, int64_t *restrict idx),
              (c, n, k, idx))

/* Ordering of torch.topk: larger first, NaN above every number. */
static inline int ranks_above(float a, float b) { return a > b || (a != a && b == b); }

/* The k largest of v[0..n) by insertion into a sorted list (an element never passes an equal
 * one seen before it: the lower index stays first). */
static void top_k_insertion(const float *v, int64_t n, int k, float *val, int64_t *idx) {
    int count = 0;
    for (int64_t i = 0; i < n; i++) {
        float x = v[i];
        if (count == k && !ranks_above(x, val[k - 1])) continue;
        int pos = count < k ? count++ : k - 1;
        for (; pos > 0 && ranks_above(x, val[pos - 1]); pos--) {
            val[pos] = val[pos - 1];
            idx[pos] = idx[pos - 1];
        }
        val[pos] = x;
        idx[pos] = i;
    }
}

/* What torch.topk(v, 2)[0].sum() gives for a NaN-free v: the max plus the second largest (the
 * max again when it occurs twice). */
HP_ISA_BODY float top_two_sum_body(const float *restrict v, int64_t n) {
    float m = -INFINITY, below = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t e = 0; e < n; e++) m = v[e] > m ? v[e] : m;
    int at_max = 0;
#pragma omp simd reduction(+ : at_max) reduction(max : below)
    for (int64_t e = 0; e < n; e++) {
        at_max += v[e] == m;
        below = v[e] < m && v[e] > below ? v[e] : below;
    }
    return m + (at_max > 1 ? m : below);
}
HP_ISA_CLONES(float, top_two_sum,
              (const float *restrict v, int64_t n),
              (v, n))

/* Group-limited choice: every group of E / groups consecutive experts is scored by the sum of its
 * two best choice values, and the experts outside the top_groups best groups are set to -inf. */
static void restrict_to_groups(float *choice, int64_t E, int groups, int top_groups, int nan, float *group_score,
                               float *val, int64_t *idx, unsigned char *chosen) {
    int64_t per_group = E / groups;
    for (int g = 0; g < groups; g++) {
        if (nan) {
            top_k_insertion(choice + g * per_group, per_group, 2, val, idx);
            group_score[g] = val[0] + val[1];
        } else {
            group_score[g] = top_two_sum(choice + g * per_group, per_group);
        }
    }
    top_k_insertion(group_score, groups, top_groups, val, idx); /* a handful of groups */
    memset(chosen, 0, (size_t)groups);
    for (int j = 0; j < top_groups; j++) chosen[idx[j]] = 1;
    for (int g = 0; g < groups; g++)
        if (!chosen[g])
            for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) choice[e] = -INFINITY;
}

/* The experts of one row from its choice values (overwritten). */
static void choose_experts(float *choice, int64_t E, int groups, int top_groups, int k, float *group_score,
                           float *val, int64_t *scratch, unsigned char *chosen, int64_t *row_idx) {
    int nan = has_nan(choice, E);
    if (groups > 1) restrict_to_groups(choice, E, groups, top_groups, nan, group_score, val, scratch, chosen);
    if (nan)
        top_k_insertion(choice, E, k, val, row_idx);
    else
        top_k_rounds(choice, (int)E, k, row_idx);
}

/* weights = p[idx] / (their sum + eps) (when normalizing), times scale: PyTorch's op order. */
static void gather_weights(const float *p, const int64_t *idx, int k, int norm, float scale, float eps, float *w) {
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        w[j] = p[idx[j]];
        sum += w[j];
    }
    float denom = sum + eps;
    for (int j = 0; j < k; j++) w[j] = (norm ? w[j] / denom : w[j]) * scale;
}

/* ------------------------------------------------------------------------------- threading */

/* Threads worth starting: a few dozen rows each at least (a thread costs more than a row). */
static int thread_count(int64_t T, int threads) {
    int64_t useful = (T + 31) / 32;
    if (threads < 1) threads = 1;
    return (int)(useful < threads ? (useful < 1 ? 1 : useful) : threads);
}

static void row_range(int64_t T, int tid, int nt, int64_t *begin, int64_t *end) {
    *begin = T * tid / nt;
    *end = T * (tid + 1) / nt;
}

/* ---------------------------------------------------------------------------------- forward */

typedef struct {
    const float *logits, *bias;
    const int64_t *hash;
    int64_t T, E;
    int score, k, groups, top_groups, norm;
    float scale, eps;
    float *weights;
    int64_t *indices;
} ForwardArgs;

/* One thread's rows; its loads into counts[E], its distribution sums into acc[E] (or NULL). */
static int forward_rows(const ForwardArgs *a, int64_t begin, int64_t end, int64_t *counts, double *acc) {
    const int64_t E = a->E;
    const int k = a->k, groups = a->groups;
    int wide = k > groups ? k : groups;
    float *p = malloc(sizeof(float) * (size_t)(2 * E + groups + wide));
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)wide);
    unsigned char *chosen = malloc((size_t)groups);
    if (!p || !idx || !chosen) {
        free(p), free(idx), free(chosen);
        return MG_NO_MEMORY;
    }
    float *choice = p + E, *group_score = choice + E, *val = group_score + groups;
    int status = MG_OK;
    for (int64_t t = begin; t < end; t++) {
        const float *x = a->logits + t * E;
        int64_t *row_idx = a->indices + t * k;
        row_scores(x, E, a->score, p);
        if (a->hash) {
            for (int j = 0; j < k; j++) {
                int64_t e = a->hash[t * k + j];
                if (e < 0 || e >= E) {
                    status = MG_BAD_HASH_INDEX;
                    e = 0;
                }
                row_idx[j] = e;
            }
        } else {
            if (a->bias)
                add_bias(p, a->bias, E, choice);
            else
                memcpy(choice, p, sizeof(float) * (size_t)E);
            choose_experts(choice, E, groups, a->top_groups, k, group_score, val, idx, chosen, row_idx);
        }
        gather_weights(p, row_idx, k, a->norm, a->scale, a->eps, a->weights + t * k);
        for (int j = 0; j < k; j++) counts[row_idx[j]]++;
        if (acc) accumulate_distribution(p, E, a->score != SCORE_SOFTMAX, acc);
    }
    free(p), free(idx), free(chosen);
    return status;
}

/*
 * logits [T, E] fp32; bias [E] or NULL; hash [T, k] int64 or NULL (the experts, no selection).
 * Writes weights [T, k], indices [T, k], counts [E] and, when prob_sum is not NULL, prob_sum [E].
 * Returns 0, MG_BAD_HASH_INDEX (a hash index outside [0, E); it is routed to expert 0) or
 * MG_NO_MEMORY.
 */
int hp_mega_gate_forward(const float *logits, int64_t T, int64_t E, const float *bias, const int64_t *hash,
                         int score, int k, int groups, int top_groups, int norm, float scale, float eps,
                         float *weights, int64_t *indices, int64_t *counts, float *prob_sum, int threads) {
    ForwardArgs a = {logits, bias, hash, T, E, score, k, groups, top_groups, norm, scale, eps, weights, indices};
    int nt = thread_count(T, threads);
    int64_t *part_counts = calloc((size_t)(nt * E), sizeof(int64_t));
    double *part_acc = prob_sum ? calloc((size_t)(nt * E), sizeof(double)) : NULL;
    if (!part_counts || (prob_sum && !part_acc)) {
        free(part_counts), free(part_acc);
        return MG_NO_MEMORY;
    }
    int status = MG_OK, used = nt;
#pragma omp parallel num_threads(nt)
    {
        int tid = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t begin, end;
        row_range(T, tid, n, &begin, &end);
        int s = forward_rows(&a, begin, end, part_counts + tid * E, part_acc ? part_acc + tid * E : NULL);
#pragma omp critical
        {
            if (s != MG_OK && (status == MG_OK || s == MG_NO_MEMORY)) status = s;
        }
        if (tid == 0) used = n;
    }
    for (int64_t e = 0; e < E; e++) {
        int64_t c = 0;
        double s = 0.0;
        for (int i = 0; i < used; i++) {
            c += part_counts[i * E + e];
            if (part_acc) s += part_acc[i * E + e];
        }
        counts[e] = c;
        if (prob_sum) prob_sum[e] = (float)s;
    }
    free(part_counts), free(part_acc);
    return status;
}

/* --------------------------------------------------------------------------------- backward */

/* d score / d logit applied to g, as PyTorch's backward formulas compute it: sigmoid
 * g * (1 - y) * y; sqrt-softplus (g / (2 y)) then softplus' g * z / (z + 1), z = e^x. */
static inline float score_backward(int score, float g, float x, float y) {
    if (score == SCORE_SIGMOID) return g * (1.0f - y) * y;
    float h = g / (2.0f * y);
    if (x > SOFTPLUS_THRESHOLD) return h;
    float z = f_exp(x);
    return h * z / (z + 1.0f);
}

HP_ISA_BODY void elementwise_backward_body(const float *restrict x, const float *restrict p, const float *restrict g,
                                           int64_t E, int score, float *restrict dx) {
#pragma omp simd
    for (int64_t e = 0; e < E; e++) dx[e] = score_backward(score, g[e], x[e], p[e]);
}
HP_ISA_CLONES(void, elementwise_backward,
              (const float *restrict x, const float *restrict p, const float *restrict g, int64_t E,
               int score, float *restrict dx),
              (x, p, g, E, score, dx))

/* softmax: dx = (g - sum(g p)) p */
HP_ISA_BODY void softmax_backward_body(const float *restrict p, const float *restrict g, int64_t E,
                                       float *restrict dx) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t e = 0; e < E; e++) dot += g[e] * p[e];
#pragma omp simd
    for (int64_t e = 0; e < E; e++) dx[e] = (g[e] - dot) * p[e];
}
HP_ISA_CLONES(void, softmax_backward,
              (const float *restrict p, const float *restrict g, int64_t E, float *restrict dx),
              (p, g, E, dx))

/* g = the gradient w.r.t. the per-token distribution p / sum(p), taken back to p:
 * gs / P - sum(gs * (p / P) / P), P = sum(p) (division's backward, as PyTorch computes it). */
HP_ISA_BODY void distribution_backward_body(const float *restrict p, const float *restrict gs, int64_t E,
                                            float *restrict g) {
    float total = row_sum(p, E), through_total = 0.0f;
#pragma omp simd reduction(+ : through_total)
    for (int64_t e = 0; e < E; e++) through_total += -gs[e] * ((p[e] / total) / total);
#pragma omp simd
    for (int64_t e = 0; e < E; e++) g[e] = gs[e] / total + through_total;
}
HP_ISA_CLONES(void, distribution_backward,
              (const float *restrict p, const float *restrict gs, int64_t E, float *restrict g),
              (p, gs, E, g))

/* The gradient w.r.t. the k gathered scores w = p[idx] from the one w.r.t. the weights (gw, or
 * NULL for none): scale's, then (when normalizing) the division by sum(w) + eps. */
static void weights_backward(const float *p, const int64_t *idx, const float *gw, int k, int norm, float scale,
                             float eps, float *w, float *dw) {
    if (!gw) {
        memset(dw, 0, sizeof(float) * (size_t)k);
        return;
    }
    for (int j = 0; j < k; j++) dw[j] = gw[j] * scale;
    if (!norm) return;
    float sum = 0.0f, through_sum = 0.0f;
    for (int j = 0; j < k; j++) {
        w[j] = p[idx[j]];
        sum += w[j];
    }
    float denom = sum + eps;
    for (int j = 0; j < k; j++) through_sum += -dw[j] * ((w[j] / denom) / denom);
    for (int j = 0; j < k; j++) dw[j] = dw[j] / denom + through_sum;
}

typedef struct {
    const float *logits;
    const int64_t *indices;
    const float *grad_weights, *grad_prob_sum;
    int64_t T, E;
    int score, k, norm;
    float scale, eps;
    float *grad_logits;
} BackwardArgs;

/* A row whose only gradient comes from the weights of an element-wise score: it is nonzero at
 * the chosen experts only, each computed once (a hash table may repeat an expert). */
static void sparse_row(const BackwardArgs *a, const float *x, const int64_t *idx, const float *dw, float *p,
                       float *g, float *dx) {
    memset(dx, 0, sizeof(float) * (size_t)a->E);
    for (int j = 0; j < a->k; j++) g[idx[j]] = 0.0f;
    for (int j = 0; j < a->k; j++) g[idx[j]] += dw[j];
    for (int j = 0; j < a->k; j++) {
        int64_t e = idx[j];
        int seen = 0;
        for (int i = 0; i < j && !seen; i++) seen = idx[i] == e;
        if (!seen) dx[e] = score_backward(a->score, g[e], x[e], p[e]);
    }
}

static int backward_rows(const BackwardArgs *a, int64_t begin, int64_t end) {
    const int64_t E = a->E;
    const int k = a->k;
    float *p = malloc(sizeof(float) * (size_t)(2 * E + 2 * k));
    if (!p) return MG_NO_MEMORY;
    float *g = p + E, *w = g + E, *dw = w + k;
    int dense = a->score == SCORE_SOFTMAX || a->grad_prob_sum;
    for (int64_t t = begin; t < end; t++) {
        const float *x = a->logits + t * E;
        const int64_t *idx = a->indices + t * k;
        float *dx = a->grad_logits + t * E;
        if (dense) {
            row_scores(x, E, a->score, p);
        } else {  /* only the chosen experts' scores */
            for (int j = 0; j < k; j++) p[idx[j]] = elementwise_score(a->score, x[idx[j]]);
        }
        weights_backward(p, idx, a->grad_weights ? a->grad_weights + t * k : NULL, k, a->norm, a->scale, a->eps, w, dw);
        if (!dense) {
            sparse_row(a, x, idx, dw, p, g, dx);
            continue;
        }
        if (!a->grad_prob_sum)
            memset(g, 0, sizeof(float) * (size_t)E);
        else if (a->score == SCORE_SOFTMAX)
            memcpy(g, a->grad_prob_sum, sizeof(float) * (size_t)E);
        else
            distribution_backward(p, a->grad_prob_sum, E, g);
        for (int j = 0; j < k; j++) g[idx[j]] += dw[j];
        if (a->score == SCORE_SOFTMAX)
            softmax_backward(p, g, E, dx);
        else
            elementwise_backward(x, p, g, E, a->score, dx);
    }
    free(p);
    return MG_OK;
}

/*
 * grad_logits [T, E] from the gradients w.r.t. the weights [T, k] and w.r.t. prob_sum [E] (either
 * may be NULL: zero), given the forward's logits and indices. Returns 0 or MG_NO_MEMORY.
 */
int hp_mega_gate_backward(const float *logits, int64_t T, int64_t E, const int64_t *indices,
                          const float *grad_weights, const float *grad_prob_sum, int score, int k, int norm,
                          float scale, float eps, float *grad_logits, int threads) {
    BackwardArgs a = {logits, indices, grad_weights, grad_prob_sum, T, E, score, k, norm, scale, eps, grad_logits};
    int status = MG_OK;
#pragma omp parallel num_threads(thread_count(T, threads))
    {
        int64_t begin, end;
        row_range(T, omp_get_thread_num(), omp_get_num_threads(), &begin, &end);
        if (backward_rows(&a, begin, end) != MG_OK) {
#pragma omp atomic write
            status = MG_NO_MEMORY;
        }
    }
    return status;
}

/* Raised whenever a function's arguments or meaning change (hyperparallel/kernels/native.py VERSIONS). */
int hp_mega_gate_version(void) { return 1; }

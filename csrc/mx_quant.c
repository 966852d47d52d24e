/*
 * MXFP8 quantization and dequantization on the CPU: the exported entry points.
 *
 * Plain C (no PyTorch or Python headers); hyperparallel/mx/backends/cpu.py passes raw pointers
 * through ctypes. The semantics are those of hyperparallel/mx/reference.py, byte for byte:
 *   - blocks of 32 values along the quantized axis, a trailing partial block allowed;
 *   - scale exponent e: floor mode  e = floor(log2(amax)) - emax_elem   (OCP MX v1.0)
 *                       rceil mode  e = ceil(log2(amax / max_elem))     (exact, no fp32 division)
 *     clamped to [-127, 127]; scale byte = e + 127; a zero block gets byte 0;
 *   - a block holding a NaN or an Inf gets scale byte 0xFF and NaN elements (0x7F);
 *   - elements x * 2^-e rounded to nearest even, saturated to +-max_elem, sign kept.
 *
 * This file splits the work into tasks for OpenMP and hands each task to the tile kernels of
 * the level in force (hp_isa.h: AVX-512 intrinsics, or the portable C compiled for AVX2 or
 * baseline x86-64), the processor's best unless hp_mx_set_isa chose a lower one (tests run every
 * level on one machine).
 */
#include "mx_common.h"

/* Outputs at least this large are written with non-temporal stores (see mx_kernels). */
#define STREAM_MIN_BYTES ((int64_t)16 << 20)

HP_ISA_LIBRARY(mx)

/* Raised whenever a function's arguments or meaning change (hyperparallel/kernels/native.py
 * VERSIONS); 2: hp_mx_set_isa's levels are hp_isa.h's (0 generic, 1 AVX2, 2 AVX-512). */
int hp_mx_version(void) { return 2; }

/* The kernels of the level in force ([Note: one ISA choice]; hp_mx_set_isa, hp_mx_isa). */
static const mx_kernels *active(void) {
    return HP_ISA_PICK(&MX_GENERIC, &MX_AVX2, &MX_AVX512);
}

void hp_mx_quant_rows(const void *src, int dtype, int64_t rows, int64_t n, uint8_t *q, uint8_t *s,
                      int elem, int mode, int nthreads) {
    const mx_kernels *k = active();
    /* chunks of ~64 KiB of output so that small inputs stay on one thread */
    int64_t rows_per_task = n >= 65536 ? 1 : 65536 / (n > 0 ? n : 1);
    int64_t ntasks = (rows + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (ntasks > 1)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t r0 = t * rows_per_task;
        int64_t r1 = r0 + rows_per_task < rows ? r0 + rows_per_task : rows;
        k->quant_rows(src, dtype, r0, r1, n, q, s, elem, mode, rows * n >= STREAM_MIN_BYTES);
    }
}

/* Blocks are listed explicitly (start row, row count, scale row), which covers plain
 * column-wise quantization, leading batch dimensions and grouped (MoE) layouts alike. */
void hp_mx_quant_cols(const void *src, int dtype, int64_t width, int64_t nblocks,
                      const int64_t *blk_start, const int64_t *blk_len, const int64_t *blk_srow,
                      uint8_t *q, uint8_t *s, int elem, int mode, int nthreads) {
    const mx_kernels *k = active();
    int64_t nchunks = (width + COL_CHUNK - 1) / COL_CHUNK;
    int64_t ntasks = nblocks * nchunks;
    int stream = nblocks * BLOCK * width >= STREAM_MIN_BYTES;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (ntasks * COL_CHUNK * BLOCK > 65536)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t b = t / nchunks, c = t % nchunks;
        int64_t c0 = c * COL_CHUNK;
        int ncols = (int)(width - c0 < COL_CHUNK ? width - c0 : COL_CHUNK);
        int64_t next = 0; /* as in hp_mx_quant_dual */
        if (t + 1 < ntasks) {
            int64_t b_next = (t + 1) / nchunks, c0_next = ((t + 1) % nchunks) * COL_CHUNK;
            next = (blk_start[b_next] - blk_start[b]) * width + (c0_next - c0);
        }
        if (blk_len[b] > 0)
            k->quant_cols(src, dtype, width, blk_start[b], (int)blk_len[b], c0, ncols, q,
                          s + blk_srow[b] * width, elem, mode, stream, next);
    }
}

void hp_mx_quant_dual(const void *src, int dtype, int64_t M, int64_t K, uint8_t *qr, uint8_t *sr,
                      uint8_t *qc, uint8_t *sc, int elem, int mode, int nthreads) {
    const mx_kernels *k = active();
    int64_t nrb = (M + BLOCK - 1) / BLOCK;
    int64_t nchunks = (K + COL_CHUNK - 1) / COL_CHUNK;
    int64_t ntasks = nrb * nchunks;
    int stream = 2 * M * K >= STREAM_MIN_BYTES;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K > 65536)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t rb = t / nchunks, c0 = (t % nchunks) * COL_CHUNK;
        int64_t row0 = rb * BLOCK;
        int nrows = (int)(M - row0 < BLOCK ? M - row0 : BLOCK);
        int ncols = (int)(K - c0 < COL_CHUNK ? K - c0 : COL_CHUNK);
        /* static scheduling hands each thread a run of consecutive tasks: t + 1 comes next */
        int64_t next = 0;
        if (t + 1 < ntasks) {
            int64_t nrb_next = (t + 1) / nchunks, c0_next = ((t + 1) % nchunks) * COL_CHUNK;
            next = (nrb_next - rb) * BLOCK * K + (c0_next - c0);
        }
        k->quant_dual(src, dtype, K, row0, nrows, c0, ncols, qr, sr, qc, sc, elem, mode, stream, next);
    }
}

void hp_mx_dequant_rows(const uint8_t *q, const uint8_t *s, int64_t rows, int64_t n, int elem,
                        void *out, int out_dtype, int nthreads) {
    const mx_kernels *k = active();
    int64_t rows_per_task = n >= 65536 ? 1 : 65536 / (n > 0 ? n : 1);
    int64_t ntasks = (rows + rows_per_task - 1) / rows_per_task;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (ntasks > 1)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t r0 = t * rows_per_task;
        int64_t r1 = r0 + rows_per_task < rows ? r0 + rows_per_task : rows;
        k->dequant_rows(q, s, r0, r1, n, elem, out, out_dtype);
    }
}

void hp_mx_dequant_cols(const uint8_t *q, const uint8_t *s, int64_t width, int64_t nblocks,
                        const int64_t *blk_start, const int64_t *blk_len, const int64_t *blk_srow,
                        int elem, void *out, int out_dtype, int nthreads) {
    const mx_kernels *k = active();
    int64_t nchunks = (width + COL_CHUNK - 1) / COL_CHUNK;
    int64_t ntasks = nblocks * nchunks;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (ntasks * COL_CHUNK * BLOCK > 65536)
    for (int64_t t = 0; t < ntasks; t++) {
        int64_t b = t / nchunks, c = t % nchunks;
        int64_t c0 = c * COL_CHUNK;
        int ncols = (int)(width - c0 < COL_CHUNK ? width - c0 : COL_CHUNK);
        if (blk_len[b] > 0)
            k->dequant_cols(q, s + blk_srow[b] * width, width, blk_start[b], (int)blk_len[b], c0,
                              ncols, elem, out, out_dtype);
    }
}

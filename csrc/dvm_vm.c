/*
 * DVM: runs a bytecode program (hyperparallel/fusion/bytecode.py) over a rows x cols space.
 *
 * Plain C (no Python or PyTorch headers); hyperparallel/fusion/vm.py passes raw pointers through
 * ctypes. One call: check the program against its tensors (nothing runs when anything is off),
 * fuse a few pairs of instructions into one pass (see fuse(): same roundings), give FULL
 * registers buffers by liveness (a register whose last use is an instruction lends its buffer
 * to that instruction's result), pick the tile shape, and hand runs of consecutive
 * tiles to OpenMP threads as they come for them. The tile shape depends only on the program and
 * the shape, never on the thread count, so results are bitwise the same for any number of
 * threads (and no element's value depends on the tile shape either).
 *
 * Tiles: a FULL register of a tile holds 512 to 4096 floats, so many that the tile's FULL
 * buffers and the inputs it reads in place take about 12 KiB (hp_dvm_tile_elems can fix it);
 * without a row reduction a tile is a block of columns of one or several rows, with one it spans
 * whole rows (at least one row, so up to DVM_MAX_REDUCE_COLS columns). A program with no ROW
 * register and no reduction over tensors that are all row-major over the whole space (or
 * broadcast scalars) runs as one long row.
 *
 * Memory: an fp32 input whose tile rows are contiguous is read in place (no copy into a register
 * buffer) unless an output overlaps it; a weight (an input broadcast over rows) stays loaded
 * while the tile's columns do; inputs larger than the last-level cache are prefetched a tile ahead;
 * outputs of 16 MiB and more are written with non-temporal stores, unless their memory is fresh
 * from the allocator.
 */
#define _DEFAULT_SOURCE /* mincore */
#include <stdlib.h>
#include <string.h>

#include <omp.h>
#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "dvm_vm.h"
#define DVM_VF_INFO
#include "generated/dvm_vf_table.h"

#define CHUNKS_PER_PART 4 /* a thread's part of the tiles, in chunks (more: each costs a run_tiles' set-up) */
#define PARALLEL_MIN_ELEMS 32768 /* below this, one thread: a parallel region costs microseconds */
#define STREAM_MIN_BYTES ((int64_t)16 << 20) /* outputs at least this large skip the caches */
/* Software prefetching of the next tile pays only when the inputs come from memory: on data the
 * caches hold it spends issue slots for nothing (a 0.25M-element fp32 product took 82 us with
 * it, 56 us without; at 16M elements 5.6 ms with it, 6.4 ms without). */
#define PREFETCH_MIN_BYTES ((int64_t)32 << 20)

/* Tiles: by default sized so that a tile's FULL register buffers and in-place inputs take about
 * L1_TILE_BYTES (of a 32-48 KiB L1 data cache: room is left for the rest), within limits. */
#define L1_TILE_BYTES (12 << 10)
#define MIN_TILE_ELEMS 512
#define MAX_TILE_ELEMS 4096
#define REDUCE_TILE_ELEMS 2048

static int64_t tile_elems_setting = 0; /* 0: from L1_TILE_BYTES */
static int tune_flags = 0;
static _Thread_local int last_error_instr = -1;

HP_ISA_LIBRARY(dvm)

/* Raised whenever a function's arguments or meaning change (hyperparallel/kernels/native.py
 * VERSIONS); 2: hp_dvm_set_isa's levels are hp_isa.h's (0 generic, 1 AVX2, 2 AVX-512). */
int hp_dvm_version(void) { return 3; }

/* The VF table this library was built with: its size and digest (hyperparallel/fusion/vf_spec.py;
 * the Python side uses VFs only when its table's digest is this one). */
int hp_dvm_vf_count(void) { return DVM_VF_COUNT; }
const char *hp_dvm_vf_digest(void) { return DVM_VF_DIGEST; }

/* The interpreter of the level in force ([Note: one ISA choice]; hp_dvm_set_isa: 0 the portable
 * one, 1 AVX2, 2 AVX-512, each where the processor has it; for tests and benchmarks). */
static const dvm_isa *active(void) {
    return HP_ISA_PICK(&DVM_GENERIC, &DVM_AVX2, &DVM_AVX512);
}

/* Floats per FULL register of a tile: elems > 0 fixes it (rounded to a multiple of 16), elems < 0
 * goes back to the default (sized for L1 from the program's buffers), 0 leaves it. Returns the
 * setting in force (0: the default). For benchmarks; results never depend on it. */
int64_t hp_dvm_tile_elems(int64_t elems) {
    if (elems > 0) tile_elems_setting = elems < 16 ? 16 : (elems + 15) / 16 * 16;
    if (elems < 0) tile_elems_setting = 0;
    return tile_elems_setting;
}

int64_t hp_dvm_max_reduce_cols(void) { return DVM_MAX_REDUCE_COLS; }

/* Turns techniques off, for benchmarks and tests: 1 prefetching, 2 non-temporal stores, 4
 * in-place loads, 8 kept weights, 16 fused instruction pairs, 32 results computed in outputs,
 * 64 VFs walking rows at a tensor's own pitch, 128 a thread's own part of the tiles (all tiles
 * handed out in turn instead). < 0 leaves them. Returns the flags that were in
 * force. */
int hp_dvm_tune(int flags) {
    int old = tune_flags;
    if (flags >= 0) tune_flags = flags;
    return old;
}

/* The instruction at which the last failing hp_dvm_run of this thread stopped (-1: none). */
int hp_dvm_error_instr(void) { return last_error_instr; }

const char *hp_dvm_strerror(int code) {
    switch (code) {
    case DVM_OK: return "ok";
    case DVM_E_OPCODE: return "unknown opcode";
    case DVM_E_REGISTER: return "register index out of range";
    case DVM_E_KIND: return "register kinds do not fit the operation";
    case DVM_E_UNDEFINED: return "register read before it is written";
    case DVM_E_INDEX: return "input, output or immediate index out of range";
    case DVM_E_DTYPE: return "unknown dtype code";
    case DVM_E_STRIDE: return "tensor strides do not fit the register kind (or an output element would be written twice)";
    case DVM_E_COLS: return "row reduction over more columns than the VM's row buffer holds";
    case DVM_E_SHAPE: return "negative size or count";
    case DVM_E_NOMEM: return "out of memory";
    case DVM_E_VF: return "a VF the library's table does not have, or arguments that do not fit it";
    default: return "unknown error";
    }
}

static int is_unary(int op) { return (op >= OP_NEG && op <= OP_COPY); }
static int is_binary(int op) { return op >= OP_ADD && op <= OP_NE; }
static int is_reduction(int op) { return op >= OP_RSUM && op <= OP_RMIN; }
static int widest(int a, int b) { return a < b ? a : b; }

/* The registers a decoded instruction reads (into regs, DVM_VF_MAX_ARGS of them) and writes. */
static int operands(const dvm_ins *I, int32_t *regs) {
    if (I->op == OP_VF) {
        for (int i = 0; i < I->n_vf_in; i++) regs[i] = I->vf_regs[I->n_vf_out + i];
        return I->n_vf_in;
    }
    int op = I->op, n = op == OP_LOAD || op == OP_CONST || op == OP_NOP ? 0
                        : op == OP_STORE || is_unary(op) || is_reduction(op) || op == OP_ROT_HALF ? 1
                        : is_binary(op) || op == OP_SUM_MUL || op == OP_UNARY_MUL ? 2 : 3;
    regs[0] = I->a, regs[1] = I->b, regs[2] = I->c;
    return n;
}

static int written(const dvm_ins *I, int32_t *regs) {
    if (I->op == OP_VF) {
        for (int j = 0; j < I->n_vf_out; j++) regs[j] = I->vf_regs[j];
        return I->n_vf_out;
    }
    regs[0] = I->d;
    return I->op == OP_STORE || I->op == OP_NOP ? 0 : 1;
}

/* Decodes the VF at code word w (instruction k) and its ARG instructions into I and ins[k + 1 ..]
 * (NOPs); returns the number of ARG instructions, or -1 when they do not fit the table. */
static int decode_vf(const int32_t *w, int k, int n_instr, const int32_t *kinds, int n_regs, dvm_ins *ins) {
    dvm_ins *I = &ins[k];
    int v = w[1], n_args = w[2], n_words = (n_args + 3) / 4;
    if (v < 0 || v >= DVM_VF_COUNT) return -1;
    const dvm_vf_info *f = &VF_INFO[v];
    if (n_args != f->n_out + f->n_in || k + n_words >= n_instr) return -1;
    I->idx = v;
    I->n_vf_out = f->n_out;
    I->n_vf_in = f->n_in;
    for (int m = 0; m < n_words; m++) {
        const int32_t *a = w + 5 * (m + 1);
        if (a[0] != OP_ARG) return -1;
        for (int i = 0; i < 4; i++) {
            int j = 4 * m + i;
            if (j < n_args) {
                if (a[1 + i] < 0 || a[1 + i] >= n_regs) return -1;
                I->vf_regs[j] = a[1 + i];
                I->vf_kinds[j] = (int8_t)kinds[a[1 + i]];
            } else if (a[1 + i] != 0) {
                return -1;
            }
        }
        memset(&ins[k + 1 + m], 0, sizeof *I);
        ins[k + 1 + m].op = OP_NOP;
    }
    for (int j = 0; j < n_args; j++) {
        int want_full = j < f->n_out || f->kinds[j - f->n_out] == 'F';
        if (want_full != (I->vf_kinds[j] == KIND_FULL)) return -1;
        for (int i = 0; i < j && j < f->n_out; i++)
            if (I->vf_regs[i] == I->vf_regs[j]) return -1; /* an output twice */
    }
    return n_words;
}

/* Per thread, kept between calls: OpenMP reuses its threads, so steady state allocates nothing. */
static _Thread_local float *tl_scratch = 0;
static _Thread_local size_t tl_capacity = 0;

static float *thread_scratch(size_t floats) {
    if (floats < 16) floats = 16;
    if (floats > tl_capacity) {
        free(tl_scratch);
        size_t bytes = (floats * 4 + 63) / 64 * 64;
        tl_scratch = aligned_alloc(64, bytes);
        tl_capacity = tl_scratch ? floats : 0;
    }
    return tl_scratch;
}

/* Whether two rows of the space share t's elements (a row level of size > 1 with stride 0). */
static int repeats_rows(const dvm_tensor *t, int64_t rows) {
    int64_t n_outer = rows / (t->n_inner * t->n_mid);
    return (t->n_inner > 1 && t->rs == 0) || (t->n_mid > 1 && t->s_mid == 0) || (n_outer > 1 && t->s_outer == 0);
}

/* Checks the program against the tensors and decodes it into ins[]; first / end / writes_of:
 * per register, its first write, the last instruction touching it, its number of writes. */
static int check(const int32_t *code, int n_instr, int n_imms, const int32_t *kinds, int n_regs,
                 const dvm_tensor *in, int n_inputs, const dvm_tensor *out, int n_outputs, int64_t rows,
                 int64_t cols, dvm_ins *ins, int32_t *first, int32_t *end, int32_t *writes_of,
                 int *has_reduction) {
    for (int r = 0; r < n_regs; r++) {
        if (kinds[r] < KIND_FULL || kinds[r] > KIND_SCALAR) return DVM_E_KIND;
        first[r] = -1;
        end[r] = -1;
        writes_of[r] = 0;
    }
    *has_reduction = 0;
    for (int k = 0; k < n_instr; k++) {
        const int32_t *w = code + 5 * k;
        int op = w[0];
        dvm_ins *I = &ins[k];
        memset(I, 0, sizeof *I);
        I->op = op;
        I->kd = I->ka = I->kb = I->kc = KIND_SCALAR;
        last_error_instr = k;
        int reads[3], n_reads = 0, writes = 1;
        if (op == OP_VF) {
            int n_words = decode_vf(w, k, n_instr, kinds, n_regs, ins);
            if (n_words < 0) return DVM_E_VF;
            for (int i = 0; i < I->n_vf_in; i++) {
                int r = I->vf_regs[I->n_vf_out + i];
                if (first[r] < 0) return DVM_E_UNDEFINED;
                end[r] = k;
            }
            for (int j = 0; j < I->n_vf_out; j++) {
                int r = I->vf_regs[j];
                if (first[r] < 0) first[r] = k;
                end[r] = k;
                writes_of[r]++;
            }
            I->kd = KIND_FULL;
            k += n_words;
            continue;
        }
        if (op == OP_LOAD || op == OP_CONST) {
            I->idx = w[2];
        } else if (op == OP_STORE) {
            I->idx = w[2 + 1];
            reads[n_reads++] = w[2];
            writes = 0;
        } else if (is_unary(op) || is_reduction(op) || op == OP_ROT_HALF) {
            reads[n_reads++] = w[2];
        } else if (is_binary(op)) {
            reads[n_reads++] = w[2];
            reads[n_reads++] = w[3];
        } else if (op == OP_WHERE) {
            reads[n_reads++] = w[2];
            reads[n_reads++] = w[3];
            reads[n_reads++] = w[4];
        } else {
            return DVM_E_OPCODE;
        }
        for (int i = 0; i < n_reads; i++) {
            int r = reads[i];
            if (r < 0 || r >= n_regs) return DVM_E_REGISTER;
            if (first[r] < 0) return DVM_E_UNDEFINED;
            end[r] = k;
        }
        int8_t kr[3] = {KIND_SCALAR, KIND_SCALAR, KIND_SCALAR};
        for (int i = 0; i < n_reads; i++) kr[i] = (int8_t)kinds[reads[i]];
        I->ka = kr[0];
        I->kb = kr[1];
        I->kc = kr[2];
        I->a = n_reads > 0 ? reads[0] : 0;
        I->b = n_reads > 1 ? reads[1] : 0;
        I->c = n_reads > 2 ? reads[2] : 0;
        if (writes) {
            int dst = w[1];
            if (dst < 0 || dst >= n_regs) return DVM_E_REGISTER;
            if (first[dst] < 0) first[dst] = k;
            end[dst] = k;
            writes_of[dst]++;
            I->kd = (int8_t)kinds[dst];
            I->d = dst;
        }
        int kd = I->kd;
        switch (op) {
        case OP_LOAD: {
            if (I->idx < 0 || I->idx >= n_inputs) return DVM_E_INDEX;
            const dvm_tensor *t = &in[I->idx];
            if (kd == KIND_ROW && t->cs != 0) return DVM_E_STRIDE;
            if (kd == KIND_SCALAR && (t->cs != 0 || t->rs != 0 || t->s_mid != 0 || t->s_outer != 0))
                return DVM_E_STRIDE;
            break;
        }
        case OP_CONST:
            if (I->idx < 0 || I->idx >= n_imms) return DVM_E_INDEX;
            break;
        case OP_STORE: {
            if (I->idx < 0 || I->idx >= n_outputs) return DVM_E_INDEX;
            const dvm_tensor *t = &out[I->idx];
            /* distinct values may not meet in one element (size-1 dimensions have stride 0) */
            if (I->ka == KIND_FULL && ((t->cs == 0 && cols > 1) || repeats_rows(t, rows))) return DVM_E_STRIDE;
            if (I->ka == KIND_ROW && repeats_rows(t, rows)) return DVM_E_STRIDE;
            break;
        }
        case OP_COPY:
            if (I->ka < kd) return DVM_E_KIND; /* may widen, never narrow */
            break;
        case OP_ROT_HALF:
            if (kd != KIND_FULL || I->ka != KIND_FULL) return DVM_E_KIND;
            if (I->d == I->a) return DVM_E_REGISTER; /* it reads other columns than it writes */
            if (cols % 2) return DVM_E_SHAPE;
            *has_reduction = 1; /* whole rows in a tile */
            break;
        case OP_RSUM:
        case OP_RMAX:
        case OP_RMIN:
            /* a ROW or SCALAR operand is a value repeated along the row: its sum is cols times
             * it, its max and min itself */
            if (kd != KIND_ROW) return DVM_E_KIND;
            if (I->ka == KIND_FULL) *has_reduction = 1;
            break;
        default: {
            int kw = I->ka;
            if (n_reads > 1) kw = widest(kw, I->kb);
            if (n_reads > 2) kw = widest(kw, I->kc);
            if (kd != kw) return DVM_E_KIND;
        }
        }
    }
    last_error_instr = -1;
    return DVM_OK;
}

/* FULL registers share buffers by liveness, except `dedicated` ones (kept weights), which own
 * theirs; ROW and SCALAR registers get their own. Sets each register's slot (its
 * buffer's index among those of its sort) and counts them: n_slots[kind], n_slots[3] dedicated. */
static void assign_slots(const dvm_ins *ins, int n_instr, const int32_t *kinds, int n_regs, const int32_t *end,
                         const int8_t *dedicated, int64_t *slot, int32_t *free_slots, int *n_slots) {
    int n_free = 0, n_full = 0, n_row = 0, n_scalar = 0, n_dedicated = 0;
    for (int r = 0; r < n_regs; r++) slot[r] = -1;
    for (int k = 0; k < n_instr; k++) {
        int32_t regs[DVM_VF_MAX_ARGS], dsts[DVM_VF_MAX_OUTPUTS];
        int n_reads = operands(&ins[k], regs), n_dsts = written(&ins[k], dsts);
        for (int i = 0; i < n_reads; i++) {
            int r = regs[i], dup = 0; /* the same register twice among the operands, or written here */
            for (int j = 0; j < i; j++) dup |= regs[j] == r;
            for (int j = 0; j < n_dsts; j++) dup |= dsts[j] == r;
            dup |= ins[k].op == OP_ROT_HALF; /* reads other columns than it writes: never in place */
            if (kinds[r] == KIND_FULL && end[r] == k && !dup && slot[r] >= 0 && !dedicated[r])
                free_slots[n_free++] = (int32_t)slot[r];
        }
        for (int j = 0; j < n_dsts; j++) {
            int dst = dsts[j];
            if (slot[dst] < 0) {
                if (kinds[dst] == KIND_FULL && dedicated[dst]) slot[dst] = n_dedicated++;
                else if (kinds[dst] == KIND_FULL) slot[dst] = n_free ? free_slots[--n_free] : n_full++;
                else if (kinds[dst] == KIND_ROW) slot[dst] = n_row++;
                else slot[dst] = n_scalar++;
            }
        }
        for (int j = 0; j < n_dsts; j++)
            if (kinds[dsts[j]] == KIND_FULL && end[dsts[j]] == k && !dedicated[dsts[j]])
                free_slots[n_free++] = (int32_t)slot[dsts[j]];
        if (ins[k].op == OP_ROT_HALF && end[regs[0]] == k && regs[0] != dsts[0] && slot[regs[0]] >= 0 &&
            !dedicated[regs[0]]) /* its operand's buffer is free once it has been read */
            free_slots[n_free++] = (int32_t)slot[regs[0]];
    }
    n_slots[KIND_FULL] = n_full;
    n_slots[KIND_ROW] = n_row;
    n_slots[KIND_SCALAR] = n_scalar;
    n_slots[3] = n_dedicated;
}

/* Pairs of instructions whose middle value nothing else reads, run as one pass (no buffer for
 * the middle value, one pass less over the tile), with the same roundings:
 *   t = a * b; d = t * c (or c * t), t FULL        -> MUL_MUL d, a, b, c
 *   t = a * b; d = RSUM t, a and b FULL            -> SUM_MUL d, a, b
 *   t = u(a); d = t * b (or b * t), t and a FULL    -> UNARY_MUL d, a, b (u: not SIN, COS; a COPY that
 *                                                      widens a ROW or SCALAR a to FULL stays as it is)
 * reads_of: per register, the instructions that read it. */
static void fuse(dvm_ins *ins, int n_instr, const int32_t *reads_of) {
    for (int k = 0; k + 1 < n_instr; k++) {
        dvm_ins *I = &ins[k], *J = &ins[k + 1];
        if (I->kd != KIND_FULL || I->op == OP_STORE || reads_of[I->d] != 1) continue;
        int t = I->d;
        if (is_unary(I->op) && I->op != OP_SIN && I->op != OP_COS && I->ka == KIND_FULL && J->op == OP_MUL &&
            J->kd == KIND_FULL && (J->a == t) != (J->b == t)) {
            int b = J->a == t ? J->b : J->a, kb = J->a == t ? J->kb : J->ka;
            J->op = OP_UNARY_MUL;
            J->idx = I->op;
            J->a = I->a, J->ka = I->ka, J->b = b, J->kb = (int8_t)kb;
            I->op = OP_NOP;
            continue;
        }
        if (I->op != OP_MUL) continue;
        if (J->op == OP_MUL && J->kd == KIND_FULL && (J->a == t) != (J->b == t)) {
            int c = J->a == t ? J->b : J->a, kc = J->a == t ? J->kb : J->ka;
            J->op = OP_MUL_MUL;
            J->a = I->a, J->ka = I->ka, J->b = I->b, J->kb = I->kb, J->c = c, J->kc = (int8_t)kc;
            I->op = OP_NOP;
        } else if (J->op == OP_RSUM && J->a == t && I->ka == KIND_FULL && I->kb == KIND_FULL) {
            J->op = OP_SUM_MUL;
            J->a = I->a, J->b = I->b, J->kb = KIND_FULL;
            I->op = OP_NOP;
        }
    }
}

/* The registers' offsets in the thread scratch (shared FULL buffers, dedicated ones, ROW ones,
 * scalars); returns the size of the buffers in floats. */
static size_t lay_out(const int32_t *kinds, int n_regs, const int8_t *dedicated, const int64_t *slot,
                      const int *n_slots, int64_t full_stride, int64_t row_stride, int64_t *reg_off) {
    int64_t dedicated_base = n_slots[KIND_FULL] * full_stride;
    int64_t row_base = dedicated_base + n_slots[3] * full_stride;
    int64_t scalar_base = row_base + n_slots[KIND_ROW] * row_stride;
    for (int r = 0; r < n_regs; r++) {
        int64_t s = slot[r] < 0 ? 0 : slot[r]; /* never written: never read either */
        reg_off[r] = kinds[r] == KIND_FULL ? (dedicated[r] ? dedicated_base : 0) + s * full_stride
                     : kinds[r] == KIND_ROW ? row_base + s * row_stride : scalar_base + s;
    }
    return (size_t)(scalar_base + n_slots[KIND_SCALAR]);
}

/* Whether the pages of [p, p + bytes) hold memory already (checked at both ends). A buffer fresh
 * from the allocator gets its pages zeroed, into the cache, by the kernel at the first write;
 * non-temporal stores would then write each line twice, plain stores only once. */
static int resident(const char *p, int64_t bytes) {
#ifdef __linux__
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return 1;
    unsigned char in_core = 0;
    const char *ends[2] = {p, p + bytes - 1};
    for (int i = 0; i < 2; i++) {
        void *start = (void *)((uintptr_t)ends[i] & ~(uintptr_t)(page - 1));
        if (mincore(start, (size_t)page, &in_core) != 0 || !(in_core & 1)) return 0;
    }
#else
    (void)p;
    (void)bytes;
#endif
    return 1;
}

/* bytes from a tensor's first to one past its last element over the space (strides are >= 0) */
static int64_t extent(const dvm_tensor *t, int64_t rows, int64_t cols) {
    int es = dvm_esize(t->dtype);
    return (dvm_row(t, rows - 1) + (t->linear ? 0 : (t->n_inner - 1) * t->rs + (t->n_mid - 1) * t->s_mid) +
            (cols - 1) * t->cs + 1) * es;
}

/* Whether t's memory over the space meets any of others'. */
static int overlaps(const dvm_tensor *t, const dvm_tensor *others, int n, int64_t rows, int64_t cols) {
    uintptr_t lo = (uintptr_t)t->ptr, hi = lo + (uintptr_t)extent(t, rows, cols);
    for (int j = 0; j < n; j++) {
        uintptr_t olo = (uintptr_t)others[j].ptr, ohi = olo + (uintptr_t)extent(&others[j], rows, cols);
        if (olo < hi && lo < ohi) return 1;
    }
    return 0;
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int valid_dtype(int d) { return d == DT_F32 || d == DT_BF16 || d == DT_F16; }

/* Runs the program over rows x cols. Rows may nest up to three deep (dvm_tensor): rows =
 * n_outer * n_mid * n_inner, and each tensor has 4 strides (outer, middle and inner row strides,
 * column stride). */
int hp_dvm_run(const int32_t *code, int n_instr, const double *imms, int n_imms, const int32_t *reg_kinds,
               int n_regs, int n_inputs, void *const *in_ptrs, const int32_t *in_dtypes, const int64_t *in_strides,
               int n_outputs, void *const *out_ptrs, const int32_t *out_dtypes, const int64_t *out_strides,
               int64_t rows, int64_t cols, int64_t n_mid, int64_t n_inner, int n_threads) {
    last_error_instr = -1;
    if (n_instr < 0 || n_imms < 0 || n_regs < 0 || n_inputs < 0 || n_outputs < 0 || rows < 0 || cols < 0 ||
        n_mid < 1 || n_inner < 1 || (rows > 0 && rows % (n_mid * n_inner) != 0))
        return DVM_E_SHAPE;
    int64_t n_outer = rows > 0 ? rows / (n_mid * n_inner) : 1;
    size_t n_tensors = (size_t)n_inputs + (size_t)n_outputs;
    size_t bytes = (size_t)n_instr * sizeof(dvm_ins) + n_tensors * sizeof(dvm_tensor) +
                   (size_t)n_regs * (2 * sizeof(int64_t) + 5 * sizeof(int32_t) + 1);
    char *mem = malloc(bytes ? bytes : 1);
    if (!mem) return DVM_E_NOMEM;
    dvm_ins *ins = (dvm_ins *)mem;
    dvm_tensor *in = (dvm_tensor *)(ins + n_instr), *out = in + n_inputs;
    int64_t *slot = (int64_t *)(out + n_outputs), *reg_off = slot + n_regs;
    int32_t *first = (int32_t *)(reg_off + n_regs), *end = first + n_regs, *writes_of = end + n_regs;
    int32_t *free_slots = writes_of + n_regs;

    int err = DVM_OK;
    for (int i = 0; i < n_inputs + n_outputs && !err; i++) {
        int is_in = i < n_inputs, j = is_in ? i : i - n_inputs;
        dvm_tensor *t = is_in ? &in[j] : &out[j];
        t->ptr = (char *)(is_in ? in_ptrs[j] : out_ptrs[j]);
        t->dtype = is_in ? in_dtypes[j] : out_dtypes[j];
        const int64_t *st = is_in ? in_strides + 4 * j : out_strides + 4 * j;
        /* the stride of a size-1 dimension is never used */
        t->s_outer = n_outer == 1 ? 0 : st[0];
        t->s_mid = n_mid == 1 ? 0 : st[1];
        t->rs = n_inner == 1 ? 0 : st[2];
        t->cs = cols == 1 ? 0 : st[3];
        if (t->s_outer < 0 || t->s_mid < 0 || t->rs < 0 || t->cs < 0) err = DVM_E_STRIDE;
        t->n_inner = n_inner;
        t->n_mid = n_mid;
        if (n_inner == 1 && n_mid == 1) t->rs = t->s_outer; /* one level: the outer one */
        else if (n_inner == 1) t->rs = t->s_mid, t->s_mid = t->s_outer, t->n_inner = n_mid, t->n_mid = 1;
        t->linear = (t->n_mid == 1 || t->s_mid == t->rs * t->n_inner) &&
                    (rows / (t->n_inner * t->n_mid) == 1 || t->s_outer == t->rs * t->n_inner * t->n_mid);
        t->stream = 0;
        if (!valid_dtype(t->dtype) && !(is_in && t->dtype == DT_BOOL)) err = DVM_E_DTYPE; /* bool: inputs only */
    }
    int has_reduction = 0;
    if (!err)
        err = check(code, n_instr, n_imms, reg_kinds, n_regs, in, n_inputs, out, n_outputs, rows, cols, ins, first,
                    end, writes_of, &has_reduction);
    if (!err && has_reduction && cols > DVM_MAX_REDUCE_COLS) err = DVM_E_COLS;
    if (err || rows == 0 || cols == 0) {
        free(mem);
        return err;
    }

    /* one long row when every tensor is row-major over the whole space (or a broadcast scalar)
     * and no register holds per-row values */
    int flat = !has_reduction && rows > 1;
    for (int r = 0; r < n_regs && flat; r++) flat = reg_kinds[r] != KIND_ROW;
    for (size_t i = 0; i < n_tensors && flat; i++) {
        const dvm_tensor *t = &in[i]; /* in and out are consecutive */
        flat = t->linear && ((t->rs == cols && (t->cs == 1 || cols == 1)) || (t->rs == 0 && t->cs == 0));
    }
    if (flat) {
        for (size_t i = 0; i < n_tensors; i++) {
            in[i].cs = in[i].rs == 0 ? 0 : 1;
            in[i].rs = in[i].s_mid = in[i].s_outer = 0;
            in[i].n_inner = in[i].n_mid = 1;
        }
        cols *= rows;
        rows = 1;
    }

    /* Outputs too large for the caches are streamed. An fp32 LOAD register written by nothing
     * else may read its contiguous input in place, unless an output overlaps that input. */
    for (int j = 0; j < n_outputs; j++) {
        int64_t bytes = rows * cols * dvm_esize(out[j].dtype);
        out[j].stream = !(tune_flags & 2) && out[j].cs == 1 && bytes >= STREAM_MIN_BYTES &&
                        resident(out[j].ptr, extent(&out[j], rows, cols));
    }
    /* reads per register; fused pairs; the last instruction touching each register */
    int32_t *reads_of = first; /* first[] is done with */
    memset(reads_of, 0, (size_t)n_regs * sizeof(int32_t));
    for (int k = 0; k < n_instr; k++) {
        int32_t regs[DVM_VF_MAX_ARGS];
        int n = operands(&ins[k], regs);
        for (int i = 0; i < n; i++) reads_of[regs[i]]++;
    }
    if (!(tune_flags & 16)) fuse(ins, n_instr, reads_of);
    for (int r = 0; r < n_regs; r++) end[r] = -1;
    for (int k = 0; k < n_instr; k++) {
        int32_t regs[DVM_VF_MAX_ARGS], dsts[DVM_VF_MAX_OUTPUTS];
        int n = operands(&ins[k], regs), n_dsts = written(&ins[k], dsts);
        for (int i = 0; i < n; i++) end[regs[i]] = k;
        for (int j = 0; j < n_dsts; j++) end[dsts[j]] = k;
    }

    /* A FULL register loaded from a row-broadcast input (a weight) and written by nothing else
     * keeps its values from tile to tile while the columns stay, in a buffer of its own. */
    int32_t *vf_reads = free_slots + n_regs; /* per register: the VF instructions that read it */
    int8_t *kept_reg = (int8_t *)(vf_reads + n_regs);
    memset(kept_reg, 0, (size_t)n_regs);
    memset(vf_reads, 0, (size_t)n_regs * sizeof(int32_t));
    for (int k = 0; k < n_instr; k++) {
        int32_t regs[DVM_VF_MAX_ARGS];
        int n = ins[k].op == OP_VF ? operands(&ins[k], regs) : 0;
        for (int i = 0; i < n; i++) vf_reads[regs[i]]++;
    }
    for (int k = 0; k < n_instr; k++) {
        dvm_ins *I = &ins[k];
        if (I->op != OP_LOAD || I->kd != KIND_FULL || writes_of[I->d] != 1) continue;
        const dvm_tensor *t = &in[I->idx];
        if (overlaps(t, out, n_outputs, rows, cols)) continue;
        I->in_place = t->dtype == DT_F32 && (t->cs == 1 || cols == 1) && !(tune_flags & 4);
        I->keep = kept_reg[I->d] = t->rs == 0 && t->linear && rows > 1 && !(tune_flags & 8);
        I->pitched = I->in_place && !I->keep && t->linear && t->rs != 0 && reads_of[I->d] > 0 &&
                     vf_reads[I->d] == reads_of[I->d] && !(tune_flags & 64);
    }

    /* A FULL value that only a STORE reads, bound for an fp32 output whose tile rows are
     * contiguous, is computed straight into the output's memory: no register buffer, no copying
     * pass. Not into an output that overlaps an input (a later LOAD would see it early) or one
     * written with non-temporal stores. */
    for (int k = 0; k < n_instr && !(tune_flags & 32); k++) {
        dvm_ins *S = &ins[k];
        if (S->op != OP_STORE || S->ka != KIND_FULL) continue;
        const dvm_tensor *t = &out[S->idx];
        int r = S->a, producer = -1;
        if (writes_of[r] != 1 || reads_of[r] != 1 || t->dtype != DT_F32 || !(t->cs == 1 || cols == 1) || !t->linear ||
            t->stream)
            continue;
        int out_of_vf = -1; /* which of the producer's outputs, for a VF */
        for (int j = k - 1; j >= 0 && producer < 0; j--) {
            int32_t dsts[DVM_VF_MAX_OUTPUTS];
            int n_dsts = written(&ins[j], dsts);
            for (int m = 0; m < n_dsts; m++)
                if (dsts[m] == r) producer = j, out_of_vf = m;
        }
        if (producer < 0 || ins[producer].op == OP_LOAD || ins[producer].op == OP_CONST) continue;
        if (overlaps(t, in, n_inputs, rows, cols)) continue;
        /* (a VF computes into the output at its own row stride, so every tile: 64 turns that off) */
        if (ins[producer].op == OP_VF && (tune_flags & 64)) continue;
        if (ins[producer].op == OP_VF) ins[producer].vf_direct[out_of_vf] = S->idx + 1;
        else ins[producer].direct = S->idx + 1;
        S->direct = ins[producer].op == OP_VF ? 2 : 1;
    }

    int n_slots[4];
    assign_slots(ins, n_instr, reg_kinds, n_regs, end, kept_reg, slot, free_slots, n_slots);
    /* A tile's FULL buffers, and the inputs it reads in place, stay within L1_TILE_BYTES. */
    int64_t target = tile_elems_setting;
    if (target <= 0) {
        int64_t streams = n_slots[KIND_FULL] + n_slots[3];
        for (int k = 0; k < n_instr; k++) streams += ins[k].in_place || ins[k].pitched;
        target = L1_TILE_BYTES / (4 * (streams > 0 ? streams : 1));
        /* A tile that reduces rows runs its per-row work (the ROW instructions, the reductions'
         * ends) for few rows at a time: tiles that small cost more in dispatch than they save in
         * L1 (RMSNorm, 2048 x 256 fp32: 91 us at 512 elements, 73 at 1024, 67 at 2048, 76 at
         * 4096), so such tiles hold at least REDUCE_TILE_ELEMS elements. */
        int64_t least = has_reduction ? REDUCE_TILE_ELEMS : MIN_TILE_ELEMS;
        target = target < least ? least : target > MAX_TILE_ELEMS ? MAX_TILE_ELEMS : target;
    }

    dvm_plan plan;
    int64_t tile_rows, tile_cols;
    if (has_reduction) {
        tile_cols = cols;
        tile_rows = target / cols;
    } else {
        int64_t n_col_tiles = cdiv(cols, target);
        tile_cols = cdiv(cdiv(cols, n_col_tiles), 16) * 16;
        if (tile_cols > cols) tile_cols = cols;
        tile_rows = target / tile_cols;
    }
    if (tile_rows < 1) tile_rows = 1;
    if (tile_rows > rows) tile_rows = rows;

    for (int k = 0; k < n_instr; k++)
        if (ins[k].op == OP_LOAD) ins[k].readers = reads_of[ins[k].d];
    plan.ins = ins;
    plan.n_instr = n_instr;
    plan.n_regs = n_regs;
    int64_t input_bytes = 0;
    for (int i = 0; i < n_inputs; i++) input_bytes += extent(&in[i], rows, cols);
    plan.prefetch = !(tune_flags & 1) && input_bytes >= PREFETCH_MIN_BYTES;
    plan.reg_off = reg_off;
    plan.imms = imms;
    plan.in = in;
    plan.out = out;
    plan.rows = rows;
    plan.cols = cols;
    plan.tile_rows = tile_rows;
    plan.tile_cols = tile_cols;
    plan.n_col_tiles = cdiv(cols, tile_cols);
    plan.n_tiles = cdiv(rows, tile_rows) * plan.n_col_tiles;
    int64_t full_stride = cdiv(tile_rows * tile_cols, 16) * 16, row_stride = cdiv(tile_rows, 16) * 16;
    size_t buffers = lay_out(reg_kinds, n_regs, kept_reg, slot, n_slots, full_stride, row_stride, reg_off);
    plan.scratch_floats = (buffers + 1) / 2 * 2 + 2 * (size_t)n_regs * 5; /* + pointers, kept tiles, pitches */

    const dvm_isa *isa = active();
    int threads = n_threads > 0 ? n_threads : omp_get_max_threads();
    if (rows * cols < PARALLEL_MIN_ELEMS) threads = 1;
    if (threads > plan.n_tiles) threads = (int)plan.n_tiles;
    if (threads <= 1) {
        float *s = thread_scratch(plan.scratch_floats);
        if (s) isa->run_tiles(&plan, 0, plan.n_tiles, s);
        else err = DVM_E_NOMEM;
    } else {
        /* Tiles are shared out as ATen's parallel_for shares a range: thread i takes the i-th of
         * `threads` equal contiguous parts, a chunk at a time, so the rows a core wrote in the op
         * before (or in this op's last call) are the ones it reads, from its own L2 (RMSNorm,
         * 2048 x 256 fp32, compiled: a median 75 us a call, 85-102 with chunks handed out in
         * turn). A thread done with its part takes the next chunks of the others' parts: page
         * faults of a fresh output or a noisy machine that slow one thread do not hold the call
         * up. Chunks are claimed with an atomic counter per part, each on its own cache line. */
        int64_t chunk = plan.n_tiles / ((int64_t)threads * CHUNKS_PER_PART);
        if (chunk < 1) chunk = 1;
        int64_t n_chunks = cdiv(plan.n_tiles, chunk);
        int64_t *next = aligned_alloc(64, (size_t)threads * 64); /* part p's next chunk: next[8 * p] */
        if (!next) {
            free(mem);
            return DVM_E_NOMEM;
        }
        for (int part = 0; part < threads; part++) next[8 * part] = n_chunks * part / threads;
        int in_turn = (tune_flags & 128) != 0, failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
        {
            float *s = thread_scratch(plan.scratch_floats);
            if (!s) failed = 1;
            int me = omp_get_thread_num();
            for (int k = 0; k < threads && s; k++) {
                int part = in_turn ? 0 : (me + k) % threads; /* (128: all chunks from one counter, in turn) */
                int64_t end = in_turn ? n_chunks : n_chunks * (part + 1) / threads;
                for (;;) {
                    int64_t c = __atomic_fetch_add(&next[8 * part], 1, __ATOMIC_RELAXED);
                    if (c >= end) break;
                    int64_t t0 = c * chunk, t1 = t0 + chunk < plan.n_tiles ? t0 + chunk : plan.n_tiles;
                    isa->run_tiles(&plan, t0, t1, s);
                }
                if (in_turn) break;
            }
        }
        free(next);
        if (failed) err = DVM_E_NOMEM;
    }
    free(mem);
    return err;
}

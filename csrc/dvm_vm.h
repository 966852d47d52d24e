/*
 * DVM: the interpreter of hyperparallel/fusion/bytecode.py programs (the contract lives there).
 *
 * dvm_vm.c checks a program and its tensors, plans registers and tiles (a dvm_plan) and splits
 * the tiles over OpenMP threads; dvm_kernels.h runs tiles, compiled once per instruction set
 * (dvm_generic.c, dvm_avx2.c, dvm_avx512.c), one table per level of [Note: one ISA choice]
 * (hp_isa.h).
 */
#ifndef HP_DVM_VM_H
#define HP_DVM_VM_H
#include <stddef.h>
#include <stdint.h>

#include "hp_isa.h"

enum {
    OP_LOAD = 0, OP_CONST = 1, OP_STORE = 2,
    OP_NEG = 10, OP_ABS, OP_EXP, OP_LOG, OP_SQRT, OP_RSQRT, OP_RECIP, OP_TANH, OP_SIGMOID, OP_RELU,
    OP_ERF, OP_SILU, OP_GELU_ERF, OP_GELU_TANH, OP_SIN, OP_COS, OP_LOG1P, OP_EXPM1, OP_ROUND_BF16,
    OP_ROUND_F16, OP_COPY, /* = 30 */
    OP_ADD = 40, OP_SUB, OP_MUL, OP_DIV, OP_MAX, OP_MIN, OP_POW, OP_GT, OP_GE, OP_LT, OP_LE, OP_EQ,
    OP_NE, /* = 52 */
    OP_WHERE = 60,
    OP_RSUM = 70, OP_RMAX, OP_RMIN,
    /* a precompiled vector function (VF) of the table (hyperparallel/fusion/vf_table.txt): d = its
     * index, a = its argument count (outputs, then inputs); the arguments follow as ARG
     * instructions of four registers each (unused words 0) */
    OP_VF = 80, OP_ARG = 81,
    /* rotary's rotate_half along the row (cols even, h = cols / 2): d[j] = -a[j + h] for j < h,
     * a[j - h] for j >= h; a tile holds whole rows, as for a reduction */
    OP_ROT_HALF = 90,
    /* the VM's own, from pairs of instructions (see fuse() in dvm_vm.c), never in bytecode */
    OP_NOP = 100,
    OP_MUL_MUL = 101, /* d = (a * b) * c */
    OP_SUM_MUL = 102, /* d (ROW) = row sums of a * b */
    OP_UNARY_MUL = 103, /* d = u(a) * b, u the unary opcode in idx */
};

/* A VF's arguments: at most 4 outputs and 12 inputs (hyperparallel/fusion/vf_spec.py). */
#define DVM_VF_MAX_OUTPUTS 4
#define DVM_VF_MAX_ARGS 16

/* A VF: n elements of its FULL outputs o[] from its inputs x[] (a FULL input: n values; a U
 * input: one value, x[i][0]). An output may share memory with an input element for element. */
typedef void (*dvm_vf_fn)(int64_t n, float *const *o, const float *const *x);

typedef struct {
    int n_out, n_in;
    const char *kinds; /* per input: 'F' (per element) or 'U' (a ROW or SCALAR register) */
} dvm_vf_info;

enum { KIND_FULL = 0, KIND_ROW = 1, KIND_SCALAR = 2 }; /* a smaller number is a wider kind */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_BOOL = 3 }; /* bool: inputs only (0 / 1) */

/* Error codes of hp_dvm_run (hp_dvm_strerror names them). */
enum {
    DVM_OK = 0,
    DVM_E_OPCODE = 1,    /* unknown opcode */
    DVM_E_REGISTER = 2,  /* register index out of range */
    DVM_E_KIND = 3,      /* bad register kind, or kinds that do not fit the operation */
    DVM_E_UNDEFINED = 4, /* a register read before any instruction wrote it */
    DVM_E_INDEX = 5,     /* input, output or immediate index out of range */
    DVM_E_DTYPE = 6,     /* unknown dtype code */
    DVM_E_STRIDE = 7,    /* strides that do not fit the register kind, or an output element
                            that the store would write more than once */
    DVM_E_COLS = 8,      /* a row reduction over more than DVM_MAX_REDUCE_COLS columns */
    DVM_E_SHAPE = 9,     /* negative rows, cols or counts */
    DVM_E_NOMEM = 10,    /* out of memory for the register tiles */
    DVM_E_VF = 11,       /* a VF the library's table does not have, or arguments that do not fit it */
};

/* A tile holds whole rows when the program reduces rows, so a row must fit a register buffer
 * (a few of these per thread: 4 MiB each at the limit). */
#define DVM_MAX_REDUCE_COLS ((int64_t)1 << 20)

typedef struct {
    int32_t op;
    int8_t kd, ka, kb, kc; /* kinds of dst and operands (unused: KIND_SCALAR) */
    int32_t idx;           /* LOAD: input, STORE: output, CONST: immediate */
    int32_t d, a, b, c;    /* registers */
    int32_t in_place;      /* LOAD: the register may point into the (fp32, contiguous) input
                              instead of a copy, when the tile's rows are contiguous there */
    int32_t keep;          /* LOAD of a row-broadcast input (a weight): the register keeps its
                              own buffer, reloaded only when the tile's columns change */
    int32_t readers;       /* LOAD: the instructions that read the register */
    int32_t pitched;       /* LOAD read in place and only by VFs: where the tile's rows are not
                              contiguous in the input, the register points at its first row and
                              the VFs walk the rows at the input's own row stride (no copy) */
    int32_t direct;        /* the producer of a value only a STORE reads: 1 + the output it may
                              compute into (tiles whose rows are contiguous there); STORE: 1 if
                              its value was computed in place so, 2 if a VF computed it there
                              whatever the tile (at the output's own row stride) */
    /* VF: its outputs' and inputs' registers, their kinds, and per output its `direct` */
    int32_t n_vf_out, n_vf_in;
    int32_t vf_regs[DVM_VF_MAX_ARGS];
    int8_t vf_kinds[DVM_VF_MAX_ARGS];
    int32_t vf_direct[DVM_VF_MAX_OUTPUTS];
} dvm_ins;

/* A tensor over the rows x cols space. Rows may be nested up to three deep: row r is
 * (r / (n_mid * n_inner), r / n_inner % n_mid, r % n_inner), at s_outer, s_mid and rs elements
 * apart, so a tensor broadcast over a middle dimension (rotary's cos [1, 1, S, D] in a space of
 * [B, H, S, D]) or a transposed one is walked as it lies, with no copy. `linear`: the three
 * strides are one (s_mid = rs * n_inner, s_outer = s_mid * n_mid), row r at r * rs. */
typedef struct {
    char *ptr;
    int dtype;
    int64_t rs, cs;          /* element strides; a stride of a size-1 dimension is 0 */
    int64_t s_mid, s_outer;  /* the outer row levels' strides */
    int64_t n_inner, n_mid;  /* the space's inner row levels' sizes (the same for every tensor) */
    int linear;
    int stream; /* output: written with non-temporal stores (too large to stay in cache) */
} dvm_tensor;

/* Bytes per element of a dtype. */
static inline int dvm_esize(int dtype) { return dtype == DT_F32 ? 4 : dtype == DT_BOOL ? 1 : 2; }

/* Element offset of row r of t. */
static inline int64_t dvm_row(const dvm_tensor *t, int64_t r) {
    if (t->linear) return r * t->rs;
    int64_t q = r / t->n_inner, q2 = q / t->n_mid;
    return (r - q * t->n_inner) * t->rs + (q - q2 * t->n_mid) * t->s_mid + q2 * t->s_outer;
}

typedef struct {
    const dvm_ins *ins;
    int n_instr, n_regs;
    const int64_t *reg_off; /* per register: its buffer's offset in the thread scratch (floats) */
    const double *imms;
    const dvm_tensor *in, *out;
    int64_t rows, cols;
    int64_t tile_rows, tile_cols, n_col_tiles, n_tiles;
    size_t scratch_floats; /* per thread: register buffers, a table of n_regs pointers, and
                              what each kept register holds (column, columns, rows) */
    int prefetch;          /* prefetch the next tile's inputs */
} dvm_plan;

typedef struct {
    const char *name;
    /* runs tiles [t0, t1) of the plan with one thread's scratch (64-byte aligned) */
    void (*run_tiles)(const dvm_plan *p, int64_t t0, int64_t t1, float *scratch);
} dvm_isa;

extern const dvm_isa DVM_GENERIC;
#ifdef HP_ISA_X86
extern const dvm_isa DVM_AVX2;
extern const dvm_isa DVM_AVX512;
#endif

#endif

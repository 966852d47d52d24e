/*
 * [Note: one ISA choice] The instruction-set levels every native library of hyperparallel runs
 * at, and the one place that decides which copy of its code runs.
 *
 *   HP_ISA_GENERIC  baseline x86-64 (SSE2), and every other processor
 *   HP_ISA_AVX2     x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE
 *   HP_ISA_AVX512   x86-64-v4: the above and AVX-512 F, BW, VL, DQ, CD
 *
 * hp_isa_detect() is the best level the processor has; a library starts there when it is loaded,
 * and its exported hp_<lib>_set_isa(level) (HP_ISA_LIBRARY below; in Python,
 * hyperparallel.kernels.use_isa, which sets every library) runs it at a lower one, so that tests
 * hold every level to the reference and benchmarks measure each on one machine.
 *
 * How a library compiles its code for a level is its own (each keeps the target strings its
 * kernels were tuned with, within the level's features): tables of kernels compiled once per level
 * (mx_quant.c, dvm_vm.c), or per-level copies of its row loops (HP_ISA_CLONES: mega_gate.c,
 * mega_mhc.c, mx_generic.c). Which copy runs is decided only here, never by the loader's ifunc
 * resolution (target_clones), so that the choice can be changed at run time. A level may change a
 * result's rounding only where a library says so (MegaMHC's baseline copy has no FMA).
 */
#ifndef HP_ISA_H
#define HP_ISA_H

enum { HP_ISA_GENERIC = 0, HP_ISA_AVX2 = 1, HP_ISA_AVX512 = 2 };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(HP_NO_AVX512)
#define HP_ISA_X86 1
#endif

static inline const char *hp_isa_name(int level) {
    return level == HP_ISA_AVX512 ? "avx512" : level == HP_ISA_AVX2 ? "avx2" : "generic";
}

/* The best level this processor has. */
static inline int hp_isa_detect(void) {
#ifdef HP_ISA_X86
    __builtin_cpu_init();
#if defined(__clang__) || __GNUC__ < 12
    /* no ISA-level names in __builtin_cpu_supports: the features every library's code needs */
    int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    if (v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        return HP_ISA_AVX512;
    if (v3) return HP_ISA_AVX2;
#else
    if (__builtin_cpu_supports("x86-64-v4")) return HP_ISA_AVX512;
    if (__builtin_cpu_supports("x86-64-v3")) return HP_ISA_AVX2;
#endif
#endif
    return HP_ISA_GENERIC;
}

/* A library's level: its state, set from hp_isa_detect() when the library is loaded, read by
 * hp_isa_level(), and its two exports, hp_<lib>_set_isa(level) (0 generic, 1 avx2, 2 avx512; a
 * level above the processor's best gives the best; returns the name of the level in force) and
 * hp_<lib>_isa(). Expanded once per library, in the file of its entry points. */
#define HP_ISA_LIBRARY(lib)                                                                    \
    static int hp_isa_level_ = HP_ISA_GENERIC;                                                 \
    __attribute__((constructor)) static void hp_isa_init_(void) { hp_isa_level_ = hp_isa_detect(); } \
    static inline int hp_isa_level(void) { return hp_isa_level_; }                             \
    const char *hp_##lib##_set_isa(int level) {                                                \
        int best = hp_isa_detect();                                                            \
        hp_isa_level_ = level <= HP_ISA_GENERIC ? HP_ISA_GENERIC : level < best ? level : best; \
        return hp_isa_name(hp_isa_level_);                                                     \
    }                                                                                          \
    const char *hp_##lib##_isa(void) { return hp_isa_name(hp_isa_level_); }

/* The one of three things (kernel tables, functions) that belongs to the library's level:
 * HP_ISA_PICK(generic, avx2, avx512); only `generic` where the x86 levels are not compiled. */
#ifdef HP_ISA_X86
#define HP_ISA_PICK(generic, avx2, avx512) \
    (hp_isa_level() == HP_ISA_AVX512 ? (avx512) : hp_isa_level() == HP_ISA_AVX2 ? (avx2) : (generic))
#else
#define HP_ISA_PICK(generic, avx2, avx512) (generic)
#endif

/* Per-level copies of a function: NAME_body (HP_ISA_BODY, always inlined) compiled once for each
 * level as NAME_avx512, NAME_avx2 and NAME_generic, and NAME, which calls the copy of the
 * library's level (hp_isa_level(): HP_ISA_LIBRARY must come first). PARAMS and ARGS are the
 * parenthesized parameter and argument lists. The targets are HP_ISA_AVX512_TARGET and
 * HP_ISA_AVX2_TARGET, x86-64-v4 and -v3 unless the library defines its own before including this
 * header. */
#define HP_ISA_BODY static inline __attribute__((always_inline))
#ifndef HP_ISA_AVX512_TARGET
#define HP_ISA_AVX512_TARGET "arch=x86-64-v4"
#endif
#ifndef HP_ISA_AVX2_TARGET
#define HP_ISA_AVX2_TARGET "arch=x86-64-v3"
#endif

/* A copy is never inlined into, nor specialized for, its callers, as the clones of GCC's
 * target_clones are not: each level's copy is the code it would be as a clone. */
#if defined(__clang__)
#define HP_ISA_COPY __attribute__((noinline))
#else
#define HP_ISA_COPY __attribute__((noipa))
#endif

#ifdef HP_ISA_X86
#define HP_ISA_CLONES(ret, name, params, args)                                                 \
    HP_ISA_COPY __attribute__((target(HP_ISA_AVX512_TARGET))) static ret name##_avx512 params { \
        return name##_body args;                                                               \
    }                                                                                          \
    HP_ISA_COPY __attribute__((target(HP_ISA_AVX2_TARGET))) static ret name##_avx2 params {    \
        return name##_body args;                                                               \
    }                                                                                          \
    HP_ISA_COPY static ret name##_generic params { return name##_body args; }                  \
    static inline ret name params { return HP_ISA_PICK(name##_generic, name##_avx2, name##_avx512) args; }
/* The same with only the AVX2 and generic copies, for a library whose AVX-512 level has kernels
 * of its own (mx_generic.c): NAME_avx2 and NAME_generic. */
#define HP_ISA_CLONES_AVX2(ret, name, params, args)                                            \
    HP_ISA_COPY __attribute__((target(HP_ISA_AVX2_TARGET))) static ret name##_avx2 params {    \
        return name##_body args;                                                               \
    }                                                                                          \
    HP_ISA_COPY static ret name##_generic params { return name##_body args; }
#else
#define HP_ISA_CLONES(ret, name, params, args) \
    static inline ret name params { return name##_body args; }
#define HP_ISA_CLONES_AVX2(ret, name, params, args) \
    HP_ISA_COPY static ret name##_generic params { return name##_body args; }
#endif

#endif

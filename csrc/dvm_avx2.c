/* The DVM tile interpreter for x86-64 processors with AVX2, FMA and F16C (x86-64-v3); chosen at
 * run time by dvm_vm.c. See dvm_kernels.h. */
#include "dvm_vm.h"
#ifdef HP_ISA_X86
#pragma GCC target("avx2,fma,f16c")
#define DVM_ISA_TABLE DVM_AVX2
#define DVM_ISA_NAME "avx2"
#define DVM_HAVE_FMA 1
#define DVM_USE_AVX2 1
#include "dvm_kernels.h"
#endif

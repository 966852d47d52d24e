/* The DVM tile interpreter for x86-64 processors with AVX-512 F/BW/VL/DQ (and FMA, F16C); chosen
 * at run time by dvm_vm.c. 512-bit vectors are asked for explicitly: GCC's default tuning
 * prefers 256-bit ones. See dvm_kernels.h. */
#include "dvm_vm.h"
#ifdef HP_ISA_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define DVM_ISA_TABLE DVM_AVX512
#define DVM_ISA_NAME "avx512"
#define DVM_HAVE_FMA 1
#define DVM_USE_AVX512 1
#include "dvm_kernels.h"
#endif

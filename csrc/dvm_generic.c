/* The DVM tile interpreter for any processor (baseline x86-64: SSE2; other architectures: what
 * the compiler targets by default). See dvm_kernels.h. */
#define DVM_ISA_TABLE DVM_GENERIC
#define DVM_ISA_NAME "generic"
#include "dvm_kernels.h"

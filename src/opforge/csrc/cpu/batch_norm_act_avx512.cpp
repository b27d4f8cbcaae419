// The batch norm + activation engine's CPU loops built for AVX512.
#define OPFORGE_ISA_AVX512
#include <opforge/cpu_isa_begin.h>

#include "cpu/batch_norm_act_kernels.h"

// The batch norm + activation engine's CPU loops built for AVX2.
#define OPFORGE_ISA_AVX2
#include <opforge/cpu_isa_begin.h>

#include "cpu/batch_norm_act_kernels.h"

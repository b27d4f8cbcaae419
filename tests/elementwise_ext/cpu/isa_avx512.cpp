// The test ops' CPU loops built for AVX512.
#define OPFORGE_ISA_AVX512
#include <opforge/cpu_isa_begin.h>

#include "cpu/kernels.h"

// The test ops' CPU loops built for AVX2.
#define OPFORGE_ISA_AVX2
#include <opforge/cpu_isa_begin.h>

#include "cpu/kernels.h"

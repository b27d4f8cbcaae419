// The NMS sweep loop built for AVX2.
#define OPFORGE_ISA_AVX2
#include <opforge/cpu_isa_begin.h>

#include "cpu/nms_kernels.h"

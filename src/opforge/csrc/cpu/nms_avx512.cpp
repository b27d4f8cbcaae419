// The NMS sweep loop built for AVX-512.
#define OPFORGE_ISA_AVX512
#include <opforge/cpu_isa_begin.h>

#include "cpu/nms_kernels.h"

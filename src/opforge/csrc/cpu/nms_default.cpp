// The NMS sweep loop built for the baseline ISA.
#include <opforge/cpu_isa_begin.h>

#include "cpu/nms_kernels.h"

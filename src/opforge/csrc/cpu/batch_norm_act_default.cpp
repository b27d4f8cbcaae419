// The batch norm + activation engine's CPU loops built for DEFAULT.
#include <opforge/cpu_isa_begin.h>

#include "cpu/batch_norm_act_kernels.h"

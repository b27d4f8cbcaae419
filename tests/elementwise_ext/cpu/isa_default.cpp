// The test ops' CPU loops built for DEFAULT.
#include <opforge/cpu_isa_begin.h>

#include "cpu/kernels.h"

// The add family's CPU loops built for DEFAULT.
#include <opforge/cpu_isa_begin.h>

#include "cpu/add_kernels.h"

// The conv family's CPU loops built for AVX2.
#define OPFORGE_ISA_AVX2
#include <opforge/cpu_isa_begin.h>

#include "cpu/conv_kernels.h"
#include "cpu/conv_dw_dgrad_kernels.h"
#include "cpu/conv_dw_grad_kernels.h"
#include "cpu/plane_transpose_kernels.h"

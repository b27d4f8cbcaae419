// The arguments the host entry (batch_norm_act_cpu.cpp) hands to the CPU
// batch norm + activation loops (batch_norm_act_kernels.h, one build per ISA).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "activation.h"

namespace opforge::batch_norm {

// Rows of the (4, C) float32 stats table: per channel mean, 1 / std, and
// scale, shift with batch_norm(y) = y * scale + shift (ATen's CPU form).
enum CpuStat : int { kCpuMean, kCpuInvstd, kCpuScale, kCpuShift, kCpuStats };

// y seen as N planes of C x HW (NCHW) or as N * HW rows of C values (channels_last).
struct CpuLayout {
  int64_t N, C, HW;
  bool channels_last;
  int64_t numel() const { return N * C * HW; }
};

struct CpuForwardArgs {
  CpuLayout layout;
  c10::ScalarType dtype, param_dtype;  // y's; weight's, bias's and the running statistics'
  const void* y;
  void* out;
  const void *weight, *bias;         // null: 1 and 0
  void *running_mean, *running_var;  // null: not updated
  double momentum, eps;
  Activation act;
  float* stats;  // (kCpuStats, C), written
};

struct CpuBackwardArgs {
  CpuLayout layout;
  c10::ScalarType dtype, param_dtype;
  const void *grad, *y;           // grad laid out as y
  void* dy;                       // null: not asked for
  void *grad_weight, *grad_bias;  // null: not asked for
  const float* stats;             // the forward's table
  Activation act;
};

}  // namespace opforge::batch_norm

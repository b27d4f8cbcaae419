// Plain parameters of the conv family's CPU loops (no ISA-dependent types).
#pragma once

#include <cstdint>

namespace opforge::conv {

struct DwParams {
  int64_t N, C, H, W, K, Ho, Wo, stride, pad, mult;
  bool relu;
  const void* x;  // (N, C, H, W) contiguous, or (N, H, W, C) for the NHWC loop
  const void* w;  // (K, 1, 3, 3) contiguous
  const void* b;  // (K) or nullptr
  void* out;      // (N, K, Ho, Wo) contiguous, or (N, Ho, Wo, K)
};

}  // namespace opforge::conv

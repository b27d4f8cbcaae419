// Plain parameters of the conv family's CPU loops (no ISA-dependent types).
#pragma once

#include <cstdint>

#include "activation.h"

namespace opforge::conv {

struct DwParams {
  int64_t N, C, H, W, K, Ho, Wo, stride, pad, mult;
  Activation act;  // fused into the write (None for the backward's grad x)
  const void* x;   // (N, C, H, W) contiguous, or (N, H, W, C) for the NHWC loop
  const void* w;   // (K, 1, 3, 3) contiguous
  const void* b;   // (K) or nullptr
  void* out;       // (N, K, Ho, Wo) contiguous, or (N, Ho, Wo, K)
  // The backward's grad x runs this loop on grad_out: with `mask` (the
  // forward's ReLU result, x's shape and layout) an input value counts only
  // where mask > 0 (or is NaN), as relu's backward passes it.
  const void* mask = nullptr;
};

// The depthwise backward loops (multiplier 1, stride 1 or 2): the weight /
// bias sums (conv_dw_wgrad_*) and the stride-2 grad x (conv_dw_dgrad_*_s2);
// outputs a loop does not write may be null.
struct DwBackwardParams {
  int64_t N, C, H, W, Ho, Wo, pad, stride;
  const void* g;     // grad_out (N, C, Ho, Wo) contiguous, or (N, Ho, Wo, C)
  const void* mask;  // the ReLU's result, g's shape and layout, or nullptr: g counts where mask > 0 (or NaN)
  const void* x;     // (N, C, H, W) contiguous, or (N, H, W, C)
  const void* w;     // (C, 1, 3, 3) contiguous
  void* gx;          // x's shape and layout, or nullptr
  void* gw;          // (C, 1, 3, 3), or nullptr
  void* gb;          // (C), or nullptr
};

}  // namespace opforge::conv

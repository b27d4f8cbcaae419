// y = act(y + bias[channel]) in place on CUDA: one pass over a convolution
// engine's output, for the paths whose engine fuses neither (cuda/conv.cu).
// The activation is opforge's own (activation.h), computed in opmath.
#pragma once

#include <ATen/core/Tensor.h>

#include "activation.h"
#include "conv.h"

namespace opforge::conv {

// y (N, K, Ho, Wo), NCHW or (nhwc) channels_last memory; bias (K) or undefined.
void bias_act_cuda(at::Tensor& y, const at::Tensor& bias, Activation act, bool nhwc, const Geometry& g);

}  // namespace opforge::conv

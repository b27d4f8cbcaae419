// The dense conv backward's first pass on CUDA (cuda/conv_bias_grad.cu),
// called by cuda/conv.cu.
#pragma once

#include <ATen/core/Tensor.h>

namespace opforge::conv {

// From one read of grad_out (N, K, Ho, Wo) and, when defined, the fused
// ReLU's result (same shape), both contiguous in the format `nhwc` names:
//  * masked (defined only with result): grad_out where result > 0 or is
//    NaN, 0 where result <= 0 (torch's threshold_backward), in that format;
//  * grad_bias (K): the per-channel sums of the masked gradient over N, Ho
//    and Wo, accumulated in opmath and added in a fixed order
//    (deterministic).
// The caller holds the device guard; grad_out is not empty.
void masked_grad_bias_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& masked,
                           const at::Tensor& grad_bias, bool nhwc);

}  // namespace opforge::conv

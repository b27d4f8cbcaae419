// Depthwise 3x3 CUDA convolution (cuda/conv_depthwise/), called by cuda/conv.cu.
// All tensors are contiguous in x's memory format (NCHW or NHWC); weight is
// (K, 1, 3, 3) contiguous; the caller holds the device guard.
#pragma once

#include <ATen/core/Tensor.h>

#include "conv.h"

namespace opforge::conv {

void depthwise_forward_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Activation act,
                            at::Tensor& out, const Geometry& g, bool nhwc);

// The backward: grad_x (x's shape and format), grad_w (K, 1, 3, 3) and
// grad_b (K), each computed when defined; grad_out (and result, when relu was
// fused: the mask result > 0) in x's format.
void depthwise_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                             const at::Tensor& w, at::Tensor& grad_x, at::Tensor& grad_w, at::Tensor& grad_b,
                             const Geometry& g, bool nhwc);

// Where the backward is cuDNN's (the masked gradient and bias sums from one
// pass, then ATen's convolution backward, as the dense path does) rather than
// these kernels: stride 2 from 2^21 input elements (NCHW) or 2^22 (NHWC),
// where the gather of grad x and the split weight sums lose to cuDNN.
bool depthwise_backward_prefers_cudnn(const Geometry& g, bool nhwc);

}  // namespace opforge::conv

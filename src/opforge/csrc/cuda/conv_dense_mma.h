// Dense 3x3 convolution forward on tensor cores (implicit GEMM) with the
// bias + ReLU epilogue fused. See conv_dense_mma.cu for the design.
#pragma once
#include <ATen/core/Tensor.h>
namespace opforge::conv {
// out = act(conv3x3(x, w) + bias) for groups == 1 on CUDA; x (N,C,H,W) contiguous or channels_last,
// w (K,C,3,3), bias (K) or undefined; stride 1|2, padding 0|1; relu fused. Returns false if this
// kernel does not handle the case (dtype/shape/alignment), so the caller falls back.
bool conv3x3_dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                               int64_t padding, bool relu, at::Tensor& out);
}  // namespace opforge::conv

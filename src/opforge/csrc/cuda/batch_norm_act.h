// Training-mode batch norm + activation over a channels_last (rows, C)
// tensor on CUDA: conv2d_batch_norm's own engine (batch_norm_act.cu). Few
// launches and no zero-filled scratch, so each call costs little host time.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "activation.h"

namespace opforge::batch_norm {

// Whether the engine takes y: CUDA, float32 / float16 / bfloat16, 4-d
// channels_last contiguous, non-empty, more than one row; weight, bias and
// running statistics (each may be undefined) float of one dtype.
bool cuda_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& running_mean);

// act(batch_norm(y)) with the batch's statistics; updates running_mean and
// running_var (when defined) with momentum, the variance unbiased. Returns
// (out, save_mean, save_invstd), the statistics float32 (C,).
std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_forward(const at::Tensor& y, const at::Tensor& weight,
                                                            const at::Tensor& bias, const at::Tensor& running_mean,
                                                            const at::Tensor& running_var, double momentum, double eps,
                                                            Activation act);

// Gradients of act(batch_norm(y)) for y, weight, bias from grad (any
// strides) and the forward's statistics; the pre-activation is recomputed
// from y. Entries not asked for by mask are undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(const at::Tensor& grad, const at::Tensor& y,
                                                             const at::Tensor& weight, const at::Tensor& bias,
                                                             const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                                             Activation act, std::array<bool, 3> mask);

}  // namespace opforge::batch_norm

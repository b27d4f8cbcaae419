// Training-mode batch norm + activation over a channels_last tensor on CUDA:
// conv2d_batch_norm's own engine (batch_norm_act.cu). Three launches each
// way and no zero-filled scratch, so a call costs little host time; the
// activation and its derivative (and a residual added before the
// activation) run inside the batch norm's passes.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>

#include "activation.h"

namespace opforge::batch_norm {

// Whether the engine takes y: a real (not fake, not symbolic) CUDA tensor,
// float32 / float16 / bfloat16, 4-d channels_last contiguous, more than one
// value per channel; weight, bias and running statistics (each may be
// undefined) contiguous, of one dtype, y's or float32.
bool cuda_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& running_mean);

// act(batch_norm(y) + residual) with the batch's statistics (residual, when
// defined, laid out as y, of y's dtype); updates running_mean and
// running_var (when defined) with momentum, the variance unbiased. Returns
// (out, stats): stats is float32 (4, C): mean, 1 / std, and the scale and
// shift with batch_norm(y) = y * scale + shift, which the backward reads.
std::tuple<at::Tensor, at::Tensor> cuda_forward(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                                                const at::Tensor& running_mean, const at::Tensor& running_var,
                                                double momentum, double eps, Activation act,
                                                const at::Tensor& residual);

// Gradients of act(batch_norm(y) + residual) for y, weight, bias and (with
// residual_grad and an activation) the residual, from grad (any strides) and
// the forward's stats; the pre-activation is recomputed from y and the
// residual. Entries not asked for are undefined; without an activation the
// residual's gradient is grad, left to the caller.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cuda_backward(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& stats, Activation act, std::array<bool, 3> mask, const at::Tensor& residual, bool residual_grad);

}  // namespace opforge::batch_norm

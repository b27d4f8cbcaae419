// Training-mode batch norm + activation over a CPU tensor, NCHW or
// channels_last: conv2d_batch_norm's own CPU engine (batch_norm_act_cpu.cpp),
// the contract of the CUDA one (cuda/batch_norm_act.h). Few allocations and
// no threads for small work, so a batch-1 call costs little host time; the
// activation and its derivative run inside the batch norm's passes.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>

#include "activation.h"

namespace opforge::batch_norm {

// Whether the engine takes y: a real (not fake, not symbolic) CPU tensor,
// float32 / float16 / bfloat16, 4-d, contiguous NCHW or channels_last, more
// than one value per channel; weight, bias and running statistics (each may
// be undefined) contiguous 1-d, of one dtype, y's or float32.
bool cpu_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& running_mean);

// act(batch_norm(y)) with the batch's statistics, in y's memory format;
// updates running_mean and running_var (when defined) with momentum, the
// variance unbiased. Returns (out, stats): stats is float32 (4, C): mean,
// 1 / std, and the scale and shift with batch_norm(y) = y * scale + shift.
std::tuple<at::Tensor, at::Tensor> cpu_forward(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                                               const at::Tensor& running_mean, const at::Tensor& running_var,
                                               double momentum, double eps, Activation act);

// Gradients of act(batch_norm(y)) for y, weight and bias from grad (any
// strides) and the forward's stats; the pre-activation is recomputed from y.
// Entries mask does not ask for are undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_backward(const at::Tensor& grad, const at::Tensor& y,
                                                            const at::Tensor& weight, const at::Tensor& bias,
                                                            const at::Tensor& stats, Activation act,
                                                            std::array<bool, 3> mask);

}  // namespace opforge::batch_norm

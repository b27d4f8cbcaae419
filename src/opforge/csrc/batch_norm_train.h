// Training-mode batch norm + activation over a tensor y, on the engine that
// takes it: opforge's own (cuda/batch_norm_act.cu for channels_last CUDA
// tensors, cpu/batch_norm_act_cpu.cpp for float / half CPU tensors) or
// ATen's batch norm with the activation in place; a residual, when given, is
// added before the activation (the CUDA engine in its output pass, else in
// place on ATen's output). Shared by conv2d_batch_norm (y: its conv's
// output) and batch_norm_act (y: its input).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <tuple>

#include "activation.h"

namespace opforge::batch_norm {

// impl_index of opforge's own engine, CUDA or CPU by y's device (ATen's are 0 native, 1 cuDNN, 2 MIOpen).
constexpr int64_t kOwnEngine = -1;

// What the forward makes that the backward reads.
struct Normalized {
  at::Tensor out;        // act(bn(y))
  at::Tensor pre_act;    // bn(y), where ATen ran and the activation's derivative needs it (hardswish, silu)
  at::Tensor save_mean;  // ATen's batch statistics, as its backward takes them
  at::Tensor save_invstd;
  at::Tensor reserve;  // ATen's reserve, or the own engine's (4, C) stats table
  int64_t impl_index = 0;
};

// A per-channel tensor t of op, when given: (K,) floating point, on x's
// device; `channels` says what K counts, for the message.
void check_channel_tensor(const char* op, const at::Tensor& x, const char* x_name, const at::Tensor& t,
                          const char* name, const c10::SymInt& K, const char* channels);

// Running mean and variance given together (or neither); num_batches_tracked,
// when given, one element on x's device.
void check_running_stats(const char* op, const at::Tensor& x, const at::Tensor& running_mean,
                         const at::Tensor& running_var, const at::Tensor& num_batches_tracked);

// A residual of op, when given: y's shape, dtype and device (the message
// calls y `what`).
void check_residual(const char* op, const char* what, const at::Tensor& y, const at::Tensor& residual);

// act(batch_norm(y) + residual) with the batch's statistics (residual: a
// tensor of y's shape and dtype, or undefined): running statistics (when
// defined) updated with momentum, num_batches_tracked (when defined, with
// them) incremented. ValueError from `op` where a channel has one value
// (`what` names y in the message). keep_pre_act: a graph is recorded, so on
// ATen's path the pre-activation is kept where the derivative reads it;
// otherwise the activation runs in place.
Normalized normalize(const char* op, const char* what, const at::Tensor& y, const at::Tensor& weight,
                     const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                     const at::Tensor& num_batches_tracked, double momentum, double eps, Activation act,
                     bool keep_pre_act, const at::Tensor& residual = {});

// Gradients for y, weight and bias of normalize's output, on the engine its
// forward ran (`kept`: the forward's out for relu / relu6, its pre_act for
// hardswish / silu, undefined on the own engine; `residual`: the forward's).
// Entries mask does not ask for are undefined. grad_residual, when given,
// receives the residual's gradient (the gradient through the activation).
std::tuple<at::Tensor, at::Tensor, at::Tensor> normalize_backward(
    const at::Tensor& grad_out, Activation act, const at::Tensor& kept, const at::Tensor& y, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, const at::Tensor& reserve, int64_t engine, double eps, std::array<bool, 3> mask,
    const at::Tensor& residual = {}, at::Tensor* grad_residual = nullptr);

}  // namespace opforge::batch_norm

// conv2d_batch_norm: a training-mode Conv2d -> BatchNorm2d -> activation as
// one op, with one autograd node, removing the host work of three module
// calls and three autograd nodes. The convolution is ATen's. The batch norm
// and the activation run on opforge's own engine where it takes the conv
// output: a channels_last CUDA tensor (cuda/batch_norm_act.cu: three
// launches each way) or a float / half / bfloat16 CPU tensor, NCHW or
// channels_last (cpu/batch_norm_act_cpu.cpp); the activation and its
// derivative run inside the batch norm's passes, values within a rounding of
// the modules'. Everywhere else (float64, NCHW on CUDA, fake tensors) the op
// runs the kernels torch's modules run (ATen's batch norm with the
// running-statistics update, the activation in place), so values, gradients
// and running statistics equal theirs. Schema, checks, kernel and autograd
// live here.
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <opforge/autograd.h>
#include <opforge/checks.h>

#include "activation.h"
#include "batch_norm_train.h"

namespace {

using opforge::Activation;
using opforge::autograd::Context;
using opforge::autograd::Tensors;

constexpr const char* kOp = "opforge.conv2d_batch_norm";
using opforge::batch_norm::kOwnEngine;

using Optional = std::optional<at::Tensor>;

bool defined(const Optional& t) { return t.has_value() && t->defined(); }
at::Tensor value_or_undefined(const Optional& t) { return defined(t) ? *t : at::Tensor(); }

// A per-channel tensor, when given: (K,) floating point, on x's device.
void check_channel_tensor(const at::Tensor& x, const at::Tensor& t, const char* name, const c10::SymInt& K) {
  opforge::batch_norm::check_channel_tensor(kOp, x, "x", t, name, K, "the conv's output channels");
}

// What ATen's convolution and batch norm do not say in the op's own terms:
// x 4-d, the weight 4-d of x's dtype and device, every per-channel tensor
// (K,), running mean and variance given together, more than one value per
// channel (as nn.BatchNorm2d requires in training).
void check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& bn_weight,
                const at::Tensor& bn_bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                const at::Tensor& num_batches_tracked, c10::IntArrayRef stride, c10::IntArrayRef padding,
                c10::IntArrayRef dilation, int64_t groups) {
  opforge::check_float_tensor(x, kOp, "x");
  opforge::check_float_tensor(w, kOp, "weight");
  opforge::check_dim(x, 4, kOp, "x");
  opforge::check_dim(w, 4, kOp, "weight");
  opforge::check_same_device(x, "x", w, "weight", kOp);
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type(), kOp, ": x and weight must have the same dtype, got x ",
                   opforge::dtype_name(x.scalar_type()), " and weight ", opforge::dtype_name(w.scalar_type()));
  const c10::SymInt K = w.sym_size(0);
  if (bias.defined()) {
    check_channel_tensor(x, bias, "bias", K);
    TORCH_CHECK_TYPE(bias.scalar_type() == x.scalar_type(), kOp, ": bias must have x's dtype ",
                     opforge::dtype_name(x.scalar_type()), ", got ", opforge::dtype_name(bias.scalar_type()));
  }
  check_channel_tensor(x, bn_weight, "bn_weight", K);
  check_channel_tensor(x, bn_bias, "bn_bias", K);
  check_channel_tensor(x, running_mean, "running_mean", K);
  check_channel_tensor(x, running_var, "running_var", K);
  opforge::batch_norm::check_running_stats(kOp, x, running_mean, running_var, num_batches_tracked);
  const std::pair<const char*, c10::IntArrayRef> pairs[] = {
      {"stride", stride}, {"padding", padding}, {"dilation", dilation}};
  for (const auto& [name, v] : pairs) {
    TORCH_CHECK_VALUE(v.size() == 1 || v.size() == 2, kOp, ": ", name, " must be an int or a pair, got ",
                      opforge::shape(v));
  }
  TORCH_CHECK_VALUE(groups >= 1, kOp, ": groups must be positive, got ", opforge::num(groups));
}

std::vector<int64_t> pair(c10::IntArrayRef v) { return {v[0], v.size() == 2 ? v[1] : v[0]}; }

// Everything the forward makes that the backward reads: the batch norm's
// (batch_norm_train.h), and the conv output it normalized.
struct ForwardResult : opforge::batch_norm::Normalized {
  at::Tensor conv_out;  // conv(x): the batch norm's input
};

// The forward, on opforge's own engine where it takes the conv output, else on ATen's
// kernels. keep_pre_act: keep bn(conv(x)) apart from
// the output (a graph is recorded and the activation's derivative reads it);
// otherwise the activation runs in place on the batch norm's output.
ForwardResult run_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& bn_weight,
                          const at::Tensor& bn_bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                          const at::Tensor& num_batches_tracked, c10::IntArrayRef stride, c10::IntArrayRef padding,
                          c10::IntArrayRef dilation, int64_t groups, double momentum, double eps, Activation act,
                          bool keep_pre_act, const at::Tensor& residual) {
  check_args(x, w, bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, stride, padding, dilation,
             groups);
  ForwardResult r;
  r.conv_out = at::convolution(x, w, bias, pair(stride), pair(padding), pair(dilation), false, {0, 0}, groups);
  opforge::batch_norm::check_residual(kOp, "the conv output", r.conv_out, residual);
  static_cast<opforge::batch_norm::Normalized&>(r) =
      opforge::batch_norm::normalize(kOp, "a conv output", r.conv_out, bn_weight, bn_bias, running_mean, running_var,
                                     num_batches_tracked, momentum, eps, act, keep_pre_act, residual);
  return r;
}

// The kernel below autograd (every backend, meta tensors too): the output only.
at::Tensor conv2d_batch_norm_kernel(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                    const std::optional<at::Tensor>& bn_weight,
                                    const std::optional<at::Tensor>& bn_bias,
                                    const std::optional<at::Tensor>& running_mean,
                                    const std::optional<at::Tensor>& running_var,
                                    const std::optional<at::Tensor>& num_batches_tracked, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                                    double momentum, double eps, std::optional<std::string_view> activation,
                                    const std::optional<at::Tensor>& residual) {
  const Activation act = opforge::parse_activation(kOp, activation);
  return run_forward(x, w, value_or_undefined(bias), value_or_undefined(bn_weight), value_or_undefined(bn_bias),
                     value_or_undefined(running_mean), value_or_undefined(running_var),
                     value_or_undefined(num_batches_tracked), stride, padding, dilation, groups, momentum, eps, act,
                     /*keep_pre_act=*/false, value_or_undefined(residual))
      .out;
}

// The op's arguments in order (backward returns one gradient per argument).
enum Input : int { kX, kW, kBias, kBnWeight, kBnBias, kRunningMean, kRunningVar, kNumBatches, kResidual = 15, kInputs };

struct ConvBatchNormFunction : torch::autograd::Function<ConvBatchNormFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const at::Tensor& w, const Optional& bias_arg,
                            const Optional& bn_weight_arg, const Optional& bn_bias_arg,
                            const Optional& running_mean_arg, const Optional& running_var_arg,
                            const Optional& num_batches_tracked_arg, c10::IntArrayRef stride, c10::IntArrayRef padding,
                            c10::IntArrayRef dilation, int64_t groups, double momentum, double eps,
                            std::optional<std::string_view> activation, const Optional& residual_arg) {
    const Activation act = opforge::parse_activation(kOp, activation);
    const at::Tensor residual = value_or_undefined(residual_arg);
    const at::Tensor bias = value_or_undefined(bias_arg), bn_weight = value_or_undefined(bn_weight_arg);
    const at::Tensor running_mean = value_or_undefined(running_mean_arg);
    const at::Tensor running_var = value_or_undefined(running_var_arg);
    ForwardResult r;
    {
      // Below autograd: this node alone records the graph.
      at::AutoDispatchBelowAutograd below;
      r = run_forward(x, w, bias, bn_weight, value_or_undefined(bn_bias_arg), running_mean, running_var,
                      value_or_undefined(num_batches_tracked_arg), stride, padding, dilation, groups, momentum, eps,
                      act, /*keep_pre_act=*/true, residual);
    }
    // needs_input_grad counts the tensors given: an absent optional one shifts those after it.
    int64_t given = 0;
    const std::pair<int, const Optional*> optionals[] = {{kBias, &bias_arg},
                                                         {kBnWeight, &bn_weight_arg},
                                                         {kBnBias, &bn_bias_arg},
                                                         {kRunningMean, &running_mean_arg},
                                                         {kRunningVar, &running_var_arg},
                                                         {kNumBatches, &num_batches_tracked_arg},
                                                         {kResidual, &residual_arg}};
    for (const auto& [index, optional] : optionals) {
      if (defined(*optional)) given |= int64_t{1} << index;
    }
    ctx->saved_data["geometry"] = std::vector<int64_t>{stride[0],   stride.size() == 2 ? stride[1] : stride[0],
                                                       padding[0],  padding.size() == 2 ? padding[1] : padding[0],
                                                       dilation[0], dilation.size() == 2 ? dilation[1] : dilation[0],
                                                       groups,      r.impl_index,
                                                       given};
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = static_cast<int64_t>(act);
    const bool from_output = opforge::derivative_from_output(act);
    // The own engine recomputes the pre-activation from conv_out: it keeps neither.
    const at::Tensor kept = r.impl_index == kOwnEngine ? at::Tensor() : (from_output ? r.out : r.pre_act);
    // The residual is read again only where the own engine recomputes an activation's input; saved
    // elsewhere it would outlive the add (and reject an in-place change the modules allow).
    const at::Tensor kept_residual = r.impl_index == kOwnEngine && act != Activation::None ? residual : at::Tensor();
    ctx->save_for_backward({x, w, r.conv_out, bn_weight, running_mean, running_var, r.save_mean, r.save_invstd,
                            r.reserve, kept, value_or_undefined(bn_bias_arg), kept_residual});
    return r.out;
  }

  static Tensors backward(Context* ctx, Tensors grads) {
    Tensors out(kInputs);
    if (!grads[0].defined()) return out;
    const std::vector<int64_t> g = ctx->saved_data["geometry"].toIntVector();
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto act = static_cast<Activation>(ctx->saved_data["act"].toInt());
    const Tensors s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1], &conv_out = s[2], &bn_weight = s[3], &running_mean = s[4],
                     &running_var = s[5], &save_mean = s[6], &save_invstd = s[7], &reserve = s[8], &kept = s[9],
                     &bn_bias = s[10], &residual = s[11];
    const int64_t given = g[8] | (int64_t{1} << kX) | (int64_t{1} << kW);
    auto needs = [&](int input) {
      if (!(given & (int64_t{1} << input))) return false;
      return ctx->needs_input_grad(__builtin_popcountll(given & ((int64_t{1} << input) - 1)));
    };
    const bool has_bias = given & (int64_t{1} << kBias);
    const std::array<bool, 3> conv_mask{needs(kX), needs(kW), needs(kBias)};
    const bool conv_needed = conv_mask[0] || conv_mask[1] || conv_mask[2];
    const std::array<bool, 3> bn_mask{conv_needed, needs(kBnWeight), needs(kBnBias)};
    const bool residual_needed = needs(kResidual);
    if (!(bn_mask[0] || bn_mask[1] || bn_mask[2] || residual_needed)) return out;
    at::Tensor g_residual;
    auto [g_conv, g_bn_w, g_bn_b] = opforge::batch_norm::normalize_backward(
        grads[0], act, kept, conv_out, bn_weight, bn_bias, running_mean, running_var, save_mean, save_invstd, reserve,
        g[7], eps, bn_mask, residual, residual_needed ? &g_residual : nullptr);
    if (residual_needed) out[kResidual] = std::move(g_residual);
    if (bn_mask[1]) out[kBnWeight] = std::move(g_bn_w);
    if (bn_mask[2]) out[kBnBias] = std::move(g_bn_b);
    if (!conv_needed) return out;
    const std::vector<c10::SymInt> bias_sizes{w.sym_size(0)};
    const std::vector<c10::SymInt> stride{g[0], g[1]}, padding{g[2], g[3]}, dilation{g[4], g[5]}, zeros{0, 0};
    auto [g_x, g_w, g_b] = at::convolution_backward_symint(
        g_conv, x, w, has_bias ? at::OptionalSymIntArrayRef(bias_sizes) : at::OptionalSymIntArrayRef(), stride, padding,
        dilation, false, zeros, g[6], conv_mask);
    if (conv_mask[0]) out[kX] = std::move(g_x);
    if (conv_mask[1]) out[kW] = std::move(g_w);
    if (conv_mask[2]) out[kBias] = std::move(g_b);
    return out;
  }
};

// Without a graph to record, straight to the kernel below autograd.
at::Tensor conv2d_batch_norm_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& bn_weight,
                                      const std::optional<at::Tensor>& bn_bias,
                                      const std::optional<at::Tensor>& running_mean,
                                      const std::optional<at::Tensor>& running_var,
                                      const std::optional<at::Tensor>& num_batches_tracked, c10::IntArrayRef stride,
                                      c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                                      double momentum, double eps, std::optional<std::string_view> activation,
                                      const std::optional<at::Tensor>& residual) {
  if (!opforge::autograd::records_graph(x, w, bias, bn_weight, bn_bias, residual)) {
    at::AutoDispatchBelowAutograd below;
    return conv2d_batch_norm_kernel(x, w, bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                                    stride, padding, dilation, groups, momentum, eps, activation, residual);
  }
  return ConvBatchNormFunction::apply(x, w, bias, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked,
                                      stride, padding, dilation, groups, momentum, eps, activation, residual);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(batch_norm(conv2d(x, weight, bias), training=True) + residual):
  // nn.Conv2d -> nn.BatchNorm2d (training mode) [-> + residual, a residual
  // block's shortcut] -> activation (None, "relu", "relu6", "hardswish",
  // "silu"). Updates running_mean and running_var with `momentum` and adds 1
  // to num_batches_tracked, as nn.BatchNorm2d does; without running
  // statistics it normalizes by the batch's alone.
  m.def(
      "conv2d_batch_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, int[2] stride=1, "
      "int[2] padding=0, int[2] dilation=1, int groups=1, float momentum=0.1, float eps=1e-05, "
      "str? activation=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) { m.impl("conv2d_batch_norm", &conv2d_batch_norm_kernel); }

TORCH_LIBRARY_IMPL(opforge, Autograd, m) { m.impl("conv2d_batch_norm", &conv2d_batch_norm_autograd); }

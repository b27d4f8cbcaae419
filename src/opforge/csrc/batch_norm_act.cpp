// batch_norm_act: a training-mode BatchNorm2d -> activation as one op with
// one autograd node, on opforge's own batch norm engines where they take the
// input (batch_norm_train.h), else ATen's kernels. What follows a conv that
// is not ATen's (opforge's own conv2d_3x3 / conv2d_1x1): conv2d_batch_norm
// fuses ATen's conv instead. Schema, checks, kernel and autograd live here.
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include <opforge/autograd.h>
#include <opforge/checks.h>

#include "activation.h"
#include "batch_norm_train.h"

namespace {

using opforge::Activation;
using opforge::autograd::Context;
using opforge::autograd::Tensors;
using opforge::batch_norm::kOwnEngine;
using Optional = std::optional<at::Tensor>;

constexpr const char* kOp = "opforge.batch_norm_act";

at::Tensor value_or_undefined(const Optional& t) { return t.has_value() ? *t : at::Tensor(); }

// x 4-d floating point; every per-channel tensor (C,) on x's device; running
// mean and variance given together; num_batches_tracked one element.
void check_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean,
                const at::Tensor& running_var, const at::Tensor& num_batches_tracked) {
  opforge::check_float_tensor(x, kOp, "x");
  opforge::check_dim(x, 4, kOp, "x");
  const c10::SymInt C = x.sym_size(1);
  const std::pair<const char*, const at::Tensor*> channel_tensors[] = {
      {"weight", &weight}, {"bias", &bias}, {"running_mean", &running_mean}, {"running_var", &running_var}};
  for (const auto& [name, t] : channel_tensors) {
    opforge::batch_norm::check_channel_tensor(kOp, x, "x", *t, name, C, "x's channels");
  }
  opforge::batch_norm::check_running_stats(kOp, x, running_mean, running_var, num_batches_tracked);
}

opforge::batch_norm::Normalized run_forward(const at::Tensor& x, const Optional& weight, const Optional& bias,
                                            const Optional& running_mean, const Optional& running_var,
                                            const Optional& num_batches_tracked, double momentum, double eps,
                                            Activation act, bool keep_pre_act) {
  const at::Tensor w = value_or_undefined(weight), b = value_or_undefined(bias);
  const at::Tensor mean = value_or_undefined(running_mean), var = value_or_undefined(running_var);
  const at::Tensor tracked = value_or_undefined(num_batches_tracked);
  check_args(x, w, b, mean, var, tracked);
  return opforge::batch_norm::normalize(kOp, "an input", x, w, b, mean, var, tracked, momentum, eps, act, keep_pre_act);
}

// The kernel below autograd (every backend, meta tensors too): the output only.
at::Tensor batch_norm_act_kernel(const at::Tensor& x, const Optional& weight, const Optional& bias,
                                 const Optional& running_mean, const Optional& running_var,
                                 const Optional& num_batches_tracked, double momentum, double eps,
                                 std::optional<std::string_view> activation) {
  const Activation act = opforge::parse_activation(kOp, activation);
  return run_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, act,
                     /*keep_pre_act=*/false)
      .out;
}

struct BatchNormActFunction : torch::autograd::Function<BatchNormActFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const Optional& weight, const Optional& bias,
                            const Optional& running_mean, const Optional& running_var,
                            const Optional& num_batches_tracked, double momentum, double eps,
                            std::optional<std::string_view> activation) {
    const Activation act = opforge::parse_activation(kOp, activation);
    opforge::batch_norm::Normalized r;
    {
      // Below autograd: this node alone records the graph.
      at::AutoDispatchBelowAutograd below;
      r = run_forward(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, act,
                      /*keep_pre_act=*/true);
    }
    // needs_input_grad counts the tensors given: an absent weight shifts the bias's index.
    ctx->saved_data["given"] = std::vector<int64_t>{1, weight.has_value(), bias.has_value()};
    ctx->saved_data["engine"] = r.impl_index;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["act"] = static_cast<int64_t>(act);
    // The own engine recomputes the pre-activation from x: it keeps neither.
    const at::Tensor kept =
        r.impl_index == kOwnEngine ? at::Tensor() : (opforge::derivative_from_output(act) ? r.out : r.pre_act);
    ctx->save_for_backward({x, value_or_undefined(weight), value_or_undefined(bias), value_or_undefined(running_mean),
                            value_or_undefined(running_var), r.save_mean, r.save_invstd, r.reserve, kept});
    return r.out;
  }

  static Tensors backward(Context* ctx, Tensors grads) {
    Tensors out(9);
    if (!grads[0].defined()) return out;
    const std::vector<int64_t> given = ctx->saved_data["given"].toIntVector();
    std::array<bool, 3> mask{};
    int64_t index = 0;  // the input's position among the tensors given
    for (int i = 0; i < 3; ++i) {
      if (given[i]) mask[i] = ctx->needs_input_grad(index++);
    }
    if (!(mask[0] || mask[1] || mask[2])) return out;
    const Tensors s = ctx->get_saved_variables();
    const auto act = static_cast<Activation>(ctx->saved_data["act"].toInt());
    auto [g_x, g_w, g_b] = opforge::batch_norm::normalize_backward(grads[0], act, s[8], s[0], s[1], s[2], s[3], s[4],
                                                                   s[5], s[6], s[7], ctx->saved_data["engine"].toInt(),
                                                                   ctx->saved_data["eps"].toDouble(), mask);
    if (mask[0]) out[0] = std::move(g_x);
    if (mask[1]) out[1] = std::move(g_w);
    if (mask[2]) out[2] = std::move(g_b);
    return out;
  }
};

// Without a graph to record, straight to the kernel below autograd.
at::Tensor batch_norm_act_autograd(const at::Tensor& x, const Optional& weight, const Optional& bias,
                                   const Optional& running_mean, const Optional& running_var,
                                   const Optional& num_batches_tracked, double momentum, double eps,
                                   std::optional<std::string_view> activation) {
  if (!opforge::autograd::records_graph(x, weight, bias)) {
    at::AutoDispatchBelowAutograd below;
    return batch_norm_act_kernel(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                                 activation);
  }
  return BatchNormActFunction::apply(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps,
                                     activation);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(batch_norm(x, training=True)): nn.BatchNorm2d (training mode) ->
  // activation (None, "relu", "relu6", "hardswish", "silu"). Updates
  // running_mean and running_var with `momentum` and adds 1 to
  // num_batches_tracked, as nn.BatchNorm2d does; without running statistics
  // it normalizes by the batch's alone.
  m.def(
      "batch_norm_act(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "Tensor(c!)? num_batches_tracked, float momentum=0.1, float eps=1e-05, str? activation=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) { m.impl("batch_norm_act", &batch_norm_act_kernel); }

TORCH_LIBRARY_IMPL(opforge, Autograd, m) { m.impl("batch_norm_act", &batch_norm_act_autograd); }

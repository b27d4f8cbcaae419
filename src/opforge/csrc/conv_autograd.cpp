// The conv family's autograd: conv2d_3x3's gradients through the backward
// op _conv2d_3x3_backward (an op of its own, so opcheck and torch.compile see
// it), whose own Autograd kernel refuses double backward with a clear error
// when the gradients of gradients are asked for. Schemas: conv.cpp.
#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

#include <opforge/autograd.h>
#include <opforge/ops.h>

#include "activation_aten.h"
#include "conv.h"

namespace {

using opforge::autograd::Context;
using opforge::autograd::Tensors;

// Saves x and weight (both gradients need them), what the activation's
// derivative reads (the output for relu and relu6; for hardswish and silu the
// pre-activation, so these run as the convolution and then torch's
// activation when a graph is recorded), and stride, padding, groups and
// whether a bias was given.
struct Conv2d3x3Function : torch::autograd::Function<Conv2d3x3Function> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
                            int64_t groups, std::optional<std::string_view> activation) {
    const opforge::Activation act = opforge::parse_activation(opforge::conv::kOp, activation);
    at::Tensor out, saved;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      if (act == opforge::Activation::Hardswish || act == opforge::Activation::Silu) {
        saved = opforge::conv2d_3x3(x, w, bias, stride, padding, groups, std::nullopt);
        out = opforge::activation_aten(saved, act);
      } else {
        out = opforge::conv2d_3x3(x, w, bias, stride, padding, groups, activation);
        if (act != opforge::Activation::None) saved = out;
      }
    }
    // The op has checked the arguments: stride and padding are equal pairs (or one int).
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["p"] = std::vector<int64_t>{stride[0], padding[0], groups, has_bias};
    ctx->saved_data["act"] = std::string(activation.value_or("relu"));
    ctx->save_for_backward({x, w, saved});
    return out;
  }

  static Tensors backward(Context* ctx, Tensors grads) {
    const std::vector<int64_t> p = ctx->saved_data["p"].toIntVector();
    const bool has_bias = p[3] != 0;
    // needs_input_grad counts the tensor inputs only: bias is the third when given.
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    Tensors out(7);
    if (!(mask[0] || mask[1] || mask[2])) return out;
    const Tensors saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> result =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::optional<at::Tensor>();
    const std::string act = ctx->saved_data["act"].toStringRef();
    auto [gx, gw, gb] =
        opforge::_conv2d_3x3_backward(grads[0], result, saved[0], saved[1], p[0], p[1], p[2], mask, act);
    if (mask[0]) out[0] = std::move(gx);
    if (mask[1]) out[1] = std::move(gw);
    if (mask[2]) out[2] = std::move(gb);
    return out;
  }
};

// The backward op's gradients are not implemented: recording its node makes
// a later double backward raise NotImplementedError with this message, while
// first derivatives (create_graph=True included) work.
struct Conv2d3x3BackwardFunction : torch::autograd::Function<Conv2d3x3BackwardFunction> {
  static Tensors forward(Context* /*ctx*/, const at::Tensor& grad_out, const std::optional<at::Tensor>& result,
                         const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding, int64_t groups,
                         std::array<bool, 3> mask, std::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [gx, gw, gb] =
        opforge::_conv2d_3x3_backward(grad_out, result, x, w, stride, padding, groups, mask, activation);
    return {gx, gw, gb};
  }

  static Tensors backward(Context* /*ctx*/, Tensors /*grads*/) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, opforge::conv::kOp,
                                ": double backward (gradients of gradients) is not supported; use "
                                "torch.nn.functional.conv2d where second derivatives are needed");
  }
};

// Without a graph to record, straight to the kernel below autograd.
at::Tensor conv2d_3x3_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               c10::IntArrayRef stride, c10::IntArrayRef padding, int64_t groups,
                               std::optional<std::string_view> activation) {
  if (!opforge::autograd::records_graph(x, w, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::conv2d_3x3(x, w, bias, stride, padding, groups, activation);
  }
  return Conv2d3x3Function::apply(x, w, bias, stride, padding, groups, activation);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_3x3_backward_autograd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& result, const at::Tensor& x, const at::Tensor& w,
    int64_t stride, int64_t padding, int64_t groups, std::array<bool, 3> mask, std::string_view activation) {
  if (!opforge::autograd::records_graph(grad_out, result, x, w)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_conv2d_3x3_backward(grad_out, result, x, w, stride, padding, groups, mask, activation);
  }
  Tensors g = Conv2d3x3BackwardFunction::apply(grad_out, result, x, w, stride, padding, groups, mask, activation);
  return {g[0], g[1], g[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_autograd);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_autograd);
}

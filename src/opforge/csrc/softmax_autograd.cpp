// Autograd of the softmax family: a torch::autograd::Function per op,
// registered for the Autograd key. The forwards' backward passes are the
// family's backward ops (one fused pass each); the backward ops' own
// derivatives (second derivatives of the forwards) are composed of ATen ops,
// as they are rarely hot. Without a graph to record, each Autograd kernel
// calls the op below autograd directly.
#include <ATen/TensorOperators.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <opforge/autograd.h>
#include <opforge/ops.h>

#include <optional>

namespace {

using opforge::autograd::Context;
using opforge::autograd::Tensors;

using SoftmaxOp = at::Tensor (*)(const at::Tensor&, int64_t, std::optional<at::ScalarType>);
using BackwardOp = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t);

// `t` in `dtype` (no op where it already is).
at::Tensor as_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// ------------------------------------------------------------------ forwards

// softmax / log_softmax: the output gradient in y's dtype through the
// backward op, the result in x's dtype (they differ under dtype=).
template <SoftmaxOp Forward, BackwardOp Backward>
struct SoftmaxFunction : torch::autograd::Function<SoftmaxFunction<Forward, Backward>> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, int64_t dim, std::optional<at::ScalarType> dtype) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      y = Forward(x, dim, dtype);
    }
    ctx->saved_data["dim"] = dim;
    if (x.scalar_type() != y.scalar_type()) ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->save_for_backward({y});
    return y;
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const at::Tensor y = ctx->get_saved_variables()[0];
    at::Tensor gx = Backward(as_dtype(grads[0], y.scalar_type()), y, ctx->saved_data["dim"].toInt());
    auto it = ctx->saved_data.find("x_dtype");
    if (it != ctx->saved_data.end()) gx = gx.to(it->second.toScalarType());
    return {gx, at::Tensor(), at::Tensor()};
  }
};

using SoftmaxFn = SoftmaxFunction<&opforge::softmax, &opforge::_softmax_backward>;
using LogSoftmaxFn = SoftmaxFunction<&opforge::log_softmax, &opforge::_log_softmax_backward>;

// softmax(x * scale + mask): x's gradient is scale times softmax's backward;
// an additive mask's is the unscaled one, summed to the mask's shape.
struct ScaledMaskedFunction : torch::autograd::Function<ScaledMaskedFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                            bool causal) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      y = opforge::scaled_masked_softmax(x, mask, scale, causal);
    }
    ctx->saved_data["scale"] = scale;
    // A mask that requires grad is additive (bool tensors cannot), so of y's dtype.
    if (opforge::autograd::requires_grad(mask)) {
      ctx->saved_data["mask_grad"] = true;
      opforge::autograd::save_input_meta(ctx, "mask", *mask, y);
    }
    ctx->save_for_backward({y});
    return y;
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const at::Tensor y = ctx->get_saved_variables()[0];
    const at::Tensor g = as_dtype(grads[0], y.scalar_type());
    at::Tensor gx, gmask;
    if (ctx->needs_input_grad(0))
      gx = opforge::_scaled_masked_softmax_backward(g, y, ctx->saved_data["scale"].toDouble());
    // Input 1 (the mask) is an edge of the graph only where a mask was given.
    if (ctx->saved_data.count("mask_grad") && ctx->needs_input_grad(1)) {
      gmask = opforge::autograd::to_input(ctx, "mask", opforge::_scaled_masked_softmax_backward(g, y, 1.0));
    }
    return {gx, gmask, at::Tensor(), at::Tensor()};
  }
};

// ------------------------------------------------------------ backward ops

// With u the incoming gradient of the backward op's result:
//   softmax:     r = y * (g - sum(g * y))
//                d/dg = softmax_backward(u, y);  d/dy = u * (g - sum(g * y)) - g * sum(u * y)
//   log_softmax: r = g - exp(y) * sum(g)
//                d/dg = u - sum(u * exp(y));     d/dy = -u * exp(y) * sum(g)
// Sums run over the op's dim, kept for broadcasting.

at::Tensor softmax_backward_grad_y(const at::Tensor& u, const at::Tensor& g, const at::Tensor& y, int64_t dim) {
  return u * (g - (g * y).sum(dim, /*keepdim=*/true)) - g * (u * y).sum(dim, /*keepdim=*/true);
}

struct SoftmaxBackwardFunction : torch::autograd::Function<SoftmaxBackwardFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
    ctx->saved_data["dim"] = dim;
    ctx->save_for_backward({grad, output});
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_softmax_backward(grad, output, dim);
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const Tensors saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &y = saved[1], &u = grads[0];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    return {ctx->needs_input_grad(0) ? opforge::_softmax_backward(u, y, dim) : at::Tensor(),
            ctx->needs_input_grad(1) ? softmax_backward_grad_y(u, g, y, dim) : at::Tensor(), at::Tensor()};
  }
};

struct LogSoftmaxBackwardFunction : torch::autograd::Function<LogSoftmaxBackwardFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
    ctx->saved_data["dim"] = dim;
    ctx->save_for_backward({grad, output});
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_log_softmax_backward(grad, output, dim);
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const Tensors saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &y = saved[1], &u = grads[0];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const at::Tensor e = at::exp(y);
    return {ctx->needs_input_grad(0) ? u - (u * e).sum(dim, /*keepdim=*/true) : at::Tensor(),
            ctx->needs_input_grad(1) ? -u * e * g.sum(dim, /*keepdim=*/true) : at::Tensor(), at::Tensor()};
  }
};

// scale times softmax's: d/dg the op itself, d/dy scale times softmax's.
struct ScaledMaskedBackwardFunction : torch::autograd::Function<ScaledMaskedBackwardFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& grad, const at::Tensor& output, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->save_for_backward({grad, output});
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_scaled_masked_softmax_backward(grad, output, scale);
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const Tensors saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &y = saved[1], &u = grads[0];
    const double scale = ctx->saved_data["scale"].toDouble();
    return {ctx->needs_input_grad(0) ? opforge::_scaled_masked_softmax_backward(u, y, scale) : at::Tensor(),
            ctx->needs_input_grad(1) ? softmax_backward_grad_y(u, g, y, -1) * scale : at::Tensor(), at::Tensor()};
  }
};

// ------------------------------------------------------- Autograd kernels

// Without a graph to record, straight to the kernel below autograd.
template <typename Function, SoftmaxOp Op>
at::Tensor softmax_autograd(const at::Tensor& x, int64_t dim, std::optional<at::ScalarType> dtype) {
  if (!opforge::autograd::records_graph(x)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return Op(x, dim, dtype);
  }
  return Function::apply(x, dim, dtype);
}

at::Tensor scaled_masked_softmax_autograd(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                          bool causal) {
  if (!opforge::autograd::records_graph(x, mask)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::scaled_masked_softmax(x, mask, scale, causal);
  }
  return ScaledMaskedFunction::apply(x, mask, scale, causal);
}

template <typename Function, BackwardOp Op>
at::Tensor backward_autograd(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  if (!opforge::autograd::records_graph(grad, output)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return Op(grad, output, dim);
  }
  return Function::apply(grad, output, dim);
}

at::Tensor scaled_masked_softmax_backward_autograd(const at::Tensor& grad, const at::Tensor& output, double scale) {
  if (!opforge::autograd::records_graph(grad, output)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_scaled_masked_softmax_backward(grad, output, scale);
  }
  return ScaledMaskedBackwardFunction::apply(grad, output, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("softmax", &softmax_autograd<SoftmaxFn, &opforge::softmax>);
  m.impl("log_softmax", &softmax_autograd<LogSoftmaxFn, &opforge::log_softmax>);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_autograd);
  m.impl("_softmax_backward", &backward_autograd<SoftmaxBackwardFunction, &opforge::_softmax_backward>);
  m.impl("_log_softmax_backward", &backward_autograd<LogSoftmaxBackwardFunction, &opforge::_log_softmax_backward>);
  m.impl("_scaled_masked_softmax_backward", &scaled_masked_softmax_backward_autograd);
}

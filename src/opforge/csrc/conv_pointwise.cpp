// conv2d_1x1's home: its schema, shape function, CPU kernel and autograd. The argument contract is
// conv_pointwise.h; the CUDA kernel is cuda/conv_pointwise_cuda.cpp.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include <opforge/autograd.h>
#include <opforge/ops.h>

#include "activation_aten.h"
#include "conv_pointwise.h"

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(conv1x1(x, weight) + bias): F.conv2d with a (K, C, 1, 1) weight,
  // groups 1, no padding, then the activation, the bias and the activation
  // applied before the output's single store where the engine fuses them.
  // flexible_layout: as conv2d_3x3 (conv.cpp), any strides are taken.
  m.def("conv2d_1x1(Tensor x, Tensor weight, Tensor? bias=None, int[2] stride=1, str? activation=None) -> Tensor",
        {at::Tag::flexible_layout});
}

namespace {

using opforge::autograd::Context;
using opforge::autograd::Tensors;
using opforge::conv::kPointwiseOp;

// Whether the convolution runs as one GEMM, (N*Ho*Wo, C) x (C, K): where x's pixels are rows of C
// contiguous channels (channels_last, or a 1x1 image) read at stride 1, few of them (at most
// kGemmMaxRows), and the layer reduces channels (C >= K). On such batch-1 layers of torchvision's
// models the GEMM (MKL's) measured 1.69x ATen's 1x1 convolution (geometric mean, 4 of 82 slower;
// docs/ops/conv_1x1.md); on larger images and on layers that widen the channels it loses about as
// often as it wins.
constexpr int64_t kGemmMaxRows = 1024;

bool gemm_takes(const opforge::conv::ForwardOperands& o, const opforge::conv::Geometry& g) {
  const bool one_pixel = g.H == 1 && g.W == 1;
  const int64_t rows = g.N * g.Ho * g.Wo;
  return (o.nhwc || one_pixel) && (g.stride == 1 || one_pixel) && rows >= 2 && rows <= kGemmMaxRows && g.C >= g.K;
}

// The GEMM path: y's (N, Ho, Wo, K) storage is the product's rows, so y comes out channels_last
// (for a 1x1 image, contiguous in both formats) with no copy.
at::Tensor forward_gemm(const opforge::conv::ForwardOperands& o, const opforge::conv::Geometry& g) {
  const at::Tensor rows = o.x.permute({0, 2, 3, 1}).reshape({g.N * g.Ho * g.Wo, g.C});
  const at::Tensor w = o.w.view({g.K, g.C}).t();
  const at::Tensor y = o.bias.defined() ? at::addmm(o.bias, rows, w) : at::mm(rows, w);
  return y.view({g.N, g.Ho, g.Wo, g.K}).permute({0, 3, 1, 2});
}

// act(conv1x1(x, w) + bias) by one GEMM (gemm_takes) or ATen's convolution (oneDNN) with the bias,
// then the activation as one in-place pass; operands 4-d, output in o.fmt. Half types are computed
// in float32 and rounded once (oneDNN rounds partial sums).
at::Tensor forward_cpu(const opforge::conv::ForwardOperands& o, const opforge::conv::Geometry& g,
                       opforge::Activation act) {
  const auto dtype = o.x.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    const opforge::conv::ForwardOperands f{o.fmt, o.nhwc, o.x.to(at::kFloat), o.w.to(at::kFloat),
                                           o.bias.defined() ? o.bias.to(at::kFloat) : o.bias};
    return forward_cpu(f, g, act).to(dtype);
  }
  if (g.C == 0 || g.N == 0) {
    // ATen's convolution refuses channel-less input; F.conv2d's rule gives an empty (N, 0, Ho, Wo).
    return opforge::conv::empty_output(g, o);
  }
  at::Tensor y;
  if (gemm_takes(o, g)) {
    y = forward_gemm(o, g);
  } else {
    const auto bias = o.bias.defined() ? std::optional<at::Tensor>(o.bias) : std::nullopt;
    y = at::convolution(o.x, o.w, bias, {g.stride, g.stride}, {0, 0}, {1, 1}, false, {0, 0}, 1);
  }
  if (!y.is_contiguous(o.fmt)) y = y.contiguous(o.fmt);
  opforge::conv::activation_inplace(y, act);
  return y;
}

at::Tensor conv2d_1x1_meta(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_pointwise_args(kPointwiseOp, x, w, bias, stride, activation, act);
  return at::empty_symint(opforge::conv::out_sizes(s), x.options().memory_format(opforge::conv::out_format(x)));
}

at::Tensor conv2d_1x1_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                          c10::IntArrayRef stride, std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_pointwise_args(kPointwiseOp, x, w, bias, stride, activation, act);
  const auto g = opforge::conv::geometry(s);
  const auto o = opforge::conv::forward_operands(x, w, bias, s.unbatched);
  return opforge::conv::unbatch(forward_cpu(o, g, act), s.unbatched);
}

// Saves x and weight, what the activation's derivative reads (the output
// for relu and relu6; the pre-activation for hardswish and silu, which then
// run as the convolution and torch's activation while a graph is recorded),
// the stride and whether a bias was given. The backward is ATen's
// (convolution_backward after the activation's derivative), so it is itself
// differentiable.
struct Conv2d1x1Function : torch::autograd::Function<Conv2d1x1Function> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                            std::optional<std::string_view> activation) {
    const opforge::Activation act = opforge::parse_activation(kPointwiseOp, activation);
    at::Tensor out, saved;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      if (act == opforge::Activation::Hardswish || act == opforge::Activation::Silu) {
        saved = opforge::conv2d_1x1(x, w, bias, stride, std::nullopt);
        out = opforge::activation_aten(saved, act);
      } else {
        out = opforge::conv2d_1x1(x, w, bias, stride, activation);
        if (act != opforge::Activation::None) saved = out;
      }
    }
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["p"] = std::vector<int64_t>{stride[0], has_bias};
    ctx->saved_data["act"] = std::string(activation.value_or("relu"));
    ctx->save_for_backward({x, w, saved});
    return out;
  }

  static Tensors backward(Context* ctx, Tensors grads) {
    const std::vector<int64_t> p = ctx->saved_data["p"].toIntVector();
    const bool has_bias = p[1] != 0;
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    Tensors out(5);
    if (!(mask[0] || mask[1] || mask[2])) return out;
    const Tensors saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const std::optional<at::Tensor> result =
        saved[2].defined() ? std::optional<at::Tensor>(saved[2]) : std::optional<at::Tensor>();
    const auto [grad, relu_result] =
        opforge::conv::grad_through_activation(grads[0], result, ctx->saved_data["act"].toStringRef());
    const bool unbatched = x.dim() == 3;
    auto [gx, gw, gb] = opforge::conv::backward_via_aten(opforge::conv::batched(grad, unbatched),
                                                         opforge::conv::batched(relu_result, unbatched),
                                                         opforge::conv::batched(x, unbatched), w, p[0], 0, 1, mask);
    if (mask[0]) out[0] = opforge::conv::unbatch(gx, unbatched);
    if (mask[1]) out[1] = std::move(gw);
    if (mask[2]) out[2] = std::move(gb);
    return out;
  }
};

// Without a graph to record, straight to the kernel below autograd.
at::Tensor conv2d_1x1_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               c10::IntArrayRef stride, std::optional<std::string_view> activation) {
  if (!opforge::autograd::records_graph(x, w, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::conv2d_1x1(x, w, bias, stride, activation);
  }
  return Conv2d1x1Function::apply(x, w, bias, stride, activation);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) { m.impl("conv2d_1x1", &conv2d_1x1_meta); }
TORCH_LIBRARY_IMPL(opforge, CPU, m) { m.impl("conv2d_1x1", &conv2d_1x1_cpu); }
TORCH_LIBRARY_IMPL(opforge, Autograd, m) { m.impl("conv2d_1x1", &conv2d_1x1_autograd); }

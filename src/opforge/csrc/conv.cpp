// The conv family's home: its schemas, shape functions, the padding-string
// overload, and the device-neutral part of its kernels (the ReLU mask and the
// backward through ATen, which the CPU and CUDA entries, cpu/conv_cpu.cpp
// and cuda/conv.cu, both fall back to). Autograd: conv_autograd.cpp; the one
// argument check: conv.h check_conv_args.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include <opforge/ops.h>

#include "activation_aten.h"
#include "conv.h"
#include "cuda/conv_dense_mma.h"

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(conv3x3(x, weight) + bias) with the bias and ReLU fused into the
  // convolution's write; groups is 1 (dense) or C (depthwise). F.conv2d's
  // arguments: stride and padding an int or an equal pair, x batched or not.
  // flexible_layout: any strides are taken (NCHW and channels_last natively), so torch.compile may
  // hand over its own layout (inductor keeps CPU conv outputs channels_last) instead of a copy.
  m.def(
      "conv2d_3x3(Tensor x, Tensor weight, Tensor? bias=None, int[2] stride=1, int[2] padding=0, int groups=1, "
      "str? activation=None) -> Tensor",
      {at::Tag::flexible_layout});
  // padding "same" (1: stride 1 only, as in F.conv2d) or "valid" (0).
  m.def(
      "conv2d_3x3.padding(Tensor x, Tensor weight, Tensor? bias=None, int[2] stride=1, str padding=\"valid\", "
      "int groups=1, str? activation=None) -> Tensor",
      {at::Tag::flexible_layout});
  // Gradients of conv2d_3x3. With an activation fused, `result` is what its
  // derivative reads: the forward's output for relu and relu6, the
  // pre-activation conv3x3(x, w) + bias for hardswish and silu; `activation`
  // names it. result None: no activation. Entries of output_mask that are
  // False come back as empty (0,) tensors.
  m.def(
      "_conv2d_3x3_backward(Tensor grad_out, Tensor? result, Tensor x, Tensor weight, int stride, int padding, "
      "int groups, bool[3] output_mask, str activation=\"relu\") -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_FRAGMENT(opforge_bench, m) {
  // relu?(conv3x3(x, w) + bias) by the CUDA implicit-GEMM tensor-core kernel
  // alone (cuda/conv_dense_mma.cu, groups 1). Raises when that kernel
  // declines the case instead of falling back. CUDA only.
  m.def("conv_dense_mma(Tensor x, Tensor w, Tensor? bias, int stride, int padding, bool relu) -> Tensor");
}

namespace opforge::conv {

// result <= 0 ? 0 : grad_out, element for element the add family's
// ReluBackward (opforge._add_relu_backward) computes, without a trip
// through the dispatcher by name.
at::Tensor relu_masked_grad(const at::Tensor& grad_out, const at::Tensor& result) {
  return at::threshold_backward(grad_out, result, 0);
}

void activation_inplace(at::Tensor& t, Activation act) { activation_inplace_aten(t, act); }

std::pair<at::Tensor, std::optional<at::Tensor>> grad_through_activation(const at::Tensor& grad_out,
                                                                         const std::optional<at::Tensor>& result,
                                                                         std::string_view activation) {
  if (!result.has_value() || !result->defined()) return {grad_out, std::nullopt};
  const Activation act = parse_activation(kBwdOp, activation);
  // The kernels apply a ReLU's mask themselves as they read grad_out.
  if (act == Activation::Relu) return {grad_out, result};
  return {activation_backward(grad_out, act, *result), std::nullopt};
}

// The backward through ATen's convolution_backward on the (masked) gradient;
// used by the CPU, by CUDA for the dense case without a bias gradient, and
// by conv2d_1x1's autograd on both. Sizes are read as SymInts, so that it
// traces under torch.compile's dynamic shapes too.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_via_aten(const at::Tensor& grad_out,
                                                                 const std::optional<at::Tensor>& result,
                                                                 const at::Tensor& x, const at::Tensor& w,
                                                                 int64_t stride, int64_t pad, int64_t groups,
                                                                 std::array<bool, 3> mask) {
  const at::Tensor g_m = (result.has_value() && result->defined()) ? relu_masked_grad(grad_out, *result) : grad_out;
  auto empty = [&] { return at::empty({0}, x.options()); };
  if (!(mask[0] || mask[1] || mask[2])) return {empty(), empty(), empty()};
  at::Tensor gx, gw, gb;
  const auto dtype = x.scalar_type();
  const bool work = x.sym_numel() > 0 && g_m.sym_numel() > 0;
  if (x.is_cpu() && (dtype == at::kHalf || dtype == at::kBFloat16) && work) {
    // oneDNN's half-precision CPU backward rounds partial sums; compute in
    // float32 and round once, as the forward does.
    auto r = backward_via_aten(g_m.to(at::kFloat), std::nullopt, x.to(at::kFloat), w.to(at::kFloat), stride, pad,
                               groups, mask);
    return {std::get<0>(r).to(dtype), std::get<1>(r).to(dtype), std::get<2>(r).to(dtype)};
  }
  if (!work) {
    gx = at::zeros_like(x);
    gw = at::zeros_like(w);
    gb = at::zeros_symint({w.sym_size(0)}, x.options());
  } else {
    const std::vector<c10::SymInt> bias_sizes{w.sym_size(0)};
    const std::vector<c10::SymInt> strides{stride, stride}, pads{pad, pad}, ones{1, 1}, zeros{0, 0};
    std::tie(gx, gw, gb) = at::convolution_backward_symint(g_m, x, w, at::OptionalSymIntArrayRef(bias_sizes), strides,
                                                           pads, ones, false, zeros, groups, mask);
  }
  // Layouts as the shape function states: grad x in x's format, grad weight in weight_grad_format.
  return {mask[0] ? gx.contiguous(out_format(x)) : empty(), mask[1] ? gw.contiguous(weight_grad_format(w)) : empty(),
          mask[2] ? gb.contiguous() : empty()};
}

}  // namespace opforge::conv

namespace {

using opforge::conv::kBwdOp;
using opforge::conv::kOp;

// ------------------------------------------------------------ shape functions

// (N, K_out, Ho, Wo) in x's memory format, as the kernels allocate it; an
// unbatched x gives (K_out, Ho, Wo), contiguous.
at::Tensor conv2d_3x3_meta(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, int64_t groups,
                           std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_forward_args(kOp, x, w, bias, stride, padding, groups, activation, act);
  return at::empty_symint(opforge::conv::out_sizes(s), x.options().memory_format(opforge::conv::out_format(x)));
}

// grad x in x's format, grad weight in weight_grad_format, grad bias (K,); entries
// masked out are (0,) tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_3x3_backward_meta(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& result, const at::Tensor& x, const at::Tensor& w,
    int64_t stride, int64_t padding, int64_t groups, std::array<bool, 3> mask, std::string_view activation) {
  const auto s = opforge::conv::check_conv_args(kBwdOp, x, w, std::nullopt, stride, padding, groups);
  opforge::parse_activation(kBwdOp, activation);
  opforge::conv::check_backward_args(kBwdOp, grad_out, result, x, s);
  auto empty = [&] { return at::empty({0}, x.options()); };
  return {mask[0] ? at::empty_symint(x.sym_sizes(), x.options().memory_format(opforge::conv::out_format(x))) : empty(),
          mask[1] ? at::empty_symint(w.sym_sizes(), w.options().memory_format(opforge::conv::weight_grad_format(w)))
                  : empty(),
          mask[2] ? at::empty_symint({s.K}, x.options()) : empty()};
}

// --------------------------------------------------------- padding strings

// "same" / "valid" as the padding they mean for a 3x3 kernel, then the int
// overload (its autograd and shape function, under torch.compile too).
at::Tensor conv2d_3x3_padding(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                              c10::IntArrayRef stride, std::string_view padding, int64_t groups,
                              std::optional<std::string_view> activation) {
  const int64_t p = opforge::conv::padding_from_string(kOp, padding, opforge::conv::check_pair(kOp, "stride", stride));
  return opforge::conv2d_3x3(x, w, bias, stride, std::array<int64_t, 2>{p, p}, groups, activation);
}

// ------------------------------------------------------- benchmark entry

// The tensor-core kernel's entry allocates (N, K, Ho, Wo) in x's suggested
// memory format (cuda/conv_dense_mma.cu).
at::Tensor conv_dense_mma_meta(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               int64_t stride, int64_t padding, bool /*relu*/) {
  return at::empty_symint(opforge::conv::check_dense_mma_args(x, w, bias, stride, padding),
                          x.options().memory_format(opforge::conv::out_format(x)));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeImplicitAutograd, m) { m.impl("conv2d_3x3.padding", &conv2d_3x3_padding); }

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_meta);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge_bench, Meta, m) { m.impl("conv_dense_mma", &conv_dense_mma_meta); }

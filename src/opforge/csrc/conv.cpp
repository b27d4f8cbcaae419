// The conv family's home: its schemas, and the device-neutral part of its
// kernels (the ReLU mask and the backward through ATen, which the CPU and
// CUDA entries, cpu/conv_cpu.cpp and cuda/conv.cu, both fall back to).
// Python wrapper, fake kernels and autograd: ops/conv.py.
#include <ATen/Functions.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "conv.h"

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(conv3x3(x, weight) + bias) with the bias and ReLU fused into the
  // convolution's write; groups is 1 (dense) or C (depthwise).
  m.def("conv2d_3x3(Tensor x, Tensor weight, Tensor? bias, int stride, int padding, int groups, bool relu) -> Tensor");
  // Gradients of conv2d_3x3. `result` is the forward's output when relu was
  // fused (the mask result > 0 is applied to grad_out inside), None otherwise.
  // Entries of output_mask that are False come back as empty (0,) tensors.
  m.def(
      "_conv2d_3x3_backward(Tensor grad_out, Tensor? result, Tensor x, Tensor weight, int stride, int padding, "
      "int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
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

// The backward through ATen's convolution_backward on the (masked) gradient;
// used by the CPU, and by CUDA for the dense case without a bias gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_via_aten(const at::Tensor& grad_out,
                                                                 const c10::optional<at::Tensor>& result,
                                                                 const at::Tensor& x, const at::Tensor& w,
                                                                 const Geometry& g, std::array<bool, 3> mask) {
  const at::Tensor g_m = (result.has_value() && result->defined()) ? relu_masked_grad(grad_out, *result) : grad_out;
  auto empty = [&] { return at::empty({0}, x.options()); };
  if (!(mask[0] || mask[1] || mask[2])) return {empty(), empty(), empty()};
  at::Tensor gx, gw, gb;
  const auto dtype = x.scalar_type();
  if (x.is_cpu() && (dtype == at::kHalf || dtype == at::kBFloat16) && x.numel() > 0 && g_m.numel() > 0) {
    // oneDNN's half-precision CPU backward rounds partial sums; compute in
    // float32 and round once, as the forward does.
    auto r = backward_via_aten(g_m.to(at::kFloat), c10::nullopt, x.to(at::kFloat), w.to(at::kFloat), g, mask);
    return {std::get<0>(r).to(dtype), std::get<1>(r).to(dtype), std::get<2>(r).to(dtype)};
  }
  if (x.numel() == 0 || g_m.numel() == 0) {
    gx = at::zeros_like(x);
    gw = at::zeros_like(w);
    gb = at::zeros({g.K}, x.options());
  } else {
    std::vector<int64_t> bias_sizes{g.K};
    std::tie(gx, gw, gb) =
        at::convolution_backward(g_m, x, w, at::OptionalIntArrayRef(bias_sizes), {g.stride, g.stride}, {g.pad, g.pad},
                                 {1, 1}, false, {0, 0}, g.groups, mask);
  }
  // Layouts as the fake kernel states: grad x in x's format, grad weight contiguous.
  return {mask[0] ? gx.contiguous(out_format(x)) : empty(), mask[1] ? gw.contiguous() : empty(),
          mask[2] ? gb.contiguous() : empty()};
}

}  // namespace opforge::conv

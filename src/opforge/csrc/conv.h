// The conv family's device-neutral part, shared by its CPU and CUDA entries:
// argument checks (same words as ops/conv.py), output geometry, operand
// layouts, and the ATen backward both backends fall back to (conv.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <array>
#include <tuple>
#include <vector>

#include <opforge/checks.h>

namespace opforge::conv {

struct Geometry {
  int64_t N, C, H, W, K, Ho, Wo, stride, pad, groups, mult;
  bool depthwise;
};

inline Geometry check_conv_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                                const c10::optional<at::Tensor>& bias, int64_t stride, int64_t padding,
                                int64_t groups) {
  check_float_tensor(x, op, "x");
  check_float_tensor(w, op, "weight");
  check_dim(x, 4, op, "x");
  check_dim(w, 4, op, "weight");
  TORCH_CHECK_VALUE(w.size(2) == 3 && w.size(3) == 3, op,
                    ": weight must have a 3x3 kernel (shape (K, C/groups, 3, 3)), got shape ", w.sizes());
  check_same_device(x, "x", w, "weight", op);
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type(), op, ": x and weight must have the same dtype, got x ",
                   x.scalar_type(), " and weight ", w.scalar_type());
  TORCH_CHECK_VALUE(stride == 1 || stride == 2, op, ": stride must be 1 or 2, got ", stride);
  TORCH_CHECK_VALUE(padding == 0 || padding == 1, op, ": padding must be 0 or 1, got ", padding);
  const int64_t C = x.size(1), K = w.size(0);
  TORCH_CHECK_VALUE(groups == 1 || (groups == C && C > 0), op, ": groups must be 1 or the number of input channels (",
                    C, "), got ", groups);
  Geometry g{};
  g.N = x.size(0);
  g.C = C;
  g.H = x.size(2);
  g.W = x.size(3);
  g.K = K;
  g.stride = stride;
  g.pad = padding;
  g.groups = groups;
  g.depthwise = groups == C && C > 1;
  TORCH_CHECK_VALUE(w.size(1) * groups == C, op, ": weight must have C/groups = ", C / groups,
                    " input channels (dim 1) for x with ", C, " channels and groups=", groups, ", got weight shape ",
                    w.sizes());
  TORCH_CHECK_VALUE(K >= 1 && K % groups == 0, op, ": weight's output channels (", K,
                    ") must be a positive multiple of groups (", groups, ")");
  g.mult = K / groups;
  if (bias.has_value() && bias->defined()) {
    check_float_tensor(*bias, op, "bias");
    check_same_device(x, "x", *bias, "bias", op);
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ", x.scalar_type(),
                     ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == K, op, ": bias must have shape [", K, "], got ",
                      bias->sizes());
  }
  TORCH_CHECK_VALUE(g.H + 2 * padding >= 3 && g.W + 2 * padding >= 3, op, ": x's spatial size (", g.H, ", ", g.W,
                    ") with padding ", padding, " is smaller than the 3x3 kernel");
  g.Ho = (g.H + 2 * padding - 3) / stride + 1;
  g.Wo = (g.W + 2 * padding - 3) / stride + 1;
  return g;
}

// The output follows x's memory format (channels_last stays channels_last).
inline at::MemoryFormat out_format(const at::Tensor& x) {
  return x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? at::MemoryFormat::ChannelsLast
                                                                     : at::MemoryFormat::Contiguous;
}

// The forward's operands as every backend's kernels read them: x in the
// output's memory format, weight contiguous, bias contiguous (undefined when
// absent).
struct ForwardOperands {
  at::MemoryFormat fmt;
  bool nhwc;
  at::Tensor x, w, bias;
};

inline ForwardOperands forward_operands(const at::Tensor& x, const at::Tensor& w,
                                        const c10::optional<at::Tensor>& bias) {
  const auto fmt = out_format(x);
  return {fmt, fmt == at::MemoryFormat::ChannelsLast, x.contiguous(fmt), w.contiguous(),
          (bias.has_value() && bias->defined()) ? bias->contiguous() : at::Tensor()};
}

// Channels of the output: K, but none for an x without channels, as
// F.conv2d's empty-input rule gives ((N, 0, Ho, Wo), whatever the bias).
inline int64_t out_channels(const Geometry& g) { return g.C == 0 ? 0 : g.K; }

inline at::Tensor empty_output(const Geometry& g, const ForwardOperands& o) {
  return at::empty({g.N, out_channels(g), g.Ho, g.Wo}, o.x.options().memory_format(o.fmt));
}

// The direct backward kernels' operands: x, grad_out and the fused ReLU's
// result (undefined without one) in the output's memory format, weight
// contiguous.
struct BackwardOperands {
  at::MemoryFormat fmt;
  bool nhwc;
  at::Tensor x, w, grad_out, result;
};

inline BackwardOperands backward_operands(const at::Tensor& grad_out, const c10::optional<at::Tensor>& result,
                                          const at::Tensor& x, const at::Tensor& w) {
  const auto fmt = out_format(x);
  return {fmt,
          fmt == at::MemoryFormat::ChannelsLast,
          x.contiguous(fmt),
          w.contiguous(),
          grad_out.contiguous(fmt),
          (result.has_value() && result->defined()) ? result->contiguous(fmt) : at::Tensor()};
}

inline void check_backward_args(const char* op, const at::Tensor& grad_out, const c10::optional<at::Tensor>& result,
                                const at::Tensor& x, const Geometry& g) {
  check_float_tensor(grad_out, op, "grad_out");
  check_same_device(x, "x", grad_out, "grad_out", op);
  TORCH_CHECK_TYPE(grad_out.scalar_type() == x.scalar_type(), op, ": grad_out must have x's dtype ", x.scalar_type(),
                   ", got ", grad_out.scalar_type());
  const std::vector<int64_t> expect{g.N, out_channels(g), g.Ho, g.Wo};
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(expect), op, ": grad_out must have shape ",
                    at::IntArrayRef(expect), ", got ", grad_out.sizes());
  if (result.has_value() && result->defined()) {
    check_float_tensor(*result, op, "result");
    check_same_device(x, "x", *result, "result", op);
    TORCH_CHECK_VALUE(result->sizes() == grad_out.sizes(), op, ": result must have grad_out's shape ", grad_out.sizes(),
                      ", got ", result->sizes());
    TORCH_CHECK_TYPE(result->scalar_type() == x.scalar_type(), op, ": result must have x's dtype ", x.scalar_type(),
                     ", got ", result->scalar_type());
  }
}

// grad_out * (result > 0) as torch's ReLU backward computes it
// (threshold_backward: a NaN result passes the gradient), any device.
at::Tensor relu_masked_grad(const at::Tensor& grad_out, const at::Tensor& result);
// The backward through ATen's convolution_backward on the (masked) gradient:
// every CPU case, and the dense CUDA case (cuDNN). Masked-out entries are (0,) tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_via_aten(const at::Tensor& grad_out,
                                                                 const c10::optional<at::Tensor>& result,
                                                                 const at::Tensor& x, const at::Tensor& w,
                                                                 const Geometry& g, std::array<bool, 3> mask);

}  // namespace opforge::conv

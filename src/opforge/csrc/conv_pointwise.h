// conv2d_1x1, the conv family's pointwise op: its argument contract, shared
// by its shape function and its CPU and CUDA kernels (conv_pointwise.cpp,
// cuda/conv_pointwise_cuda.cpp). It reuses the 3x3 op's Shape/Geometry
// (padding 0, groups 1) and helpers (conv.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string_view>

#include "conv.h"

namespace opforge::conv {

inline constexpr const char* kPointwiseOp = "opforge.conv2d_1x1";

// Float x (N, C, H, W) or (C, H, W) and weight (K, C, 1, 1) of one dtype and
// device, stride >= 1 (an int or an equal pair), a bias (K,) of x's dtype, a
// non-empty image (as F.conv2d requires). The activation comes back in act.
inline Shape check_pointwise_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                                  const std::optional<at::Tensor>& bias, c10::IntArrayRef stride_pair,
                                  std::optional<std::string_view> activation, Activation& act) {
  const int64_t stride = check_pair(op, "stride", stride_pair);
  Shape s = check_x_and_weight(op, x, w, 1, "(K, C, 1, 1)", stride, 0, 1);
  TORCH_CHECK_VALUE(stride >= 1, op, ": stride must be at least 1, got ", num(stride));
  act = parse_activation(op, activation);
  const auto ws = w.sym_sizes();
  TORCH_CHECK(ws[1] == s.C, op, ": weight must have ", num(s.C), " input channels (dim 1) for x with ", num(s.C),
              " channels (groups is 1), got weight shape ", shape(ws));
  TORCH_CHECK(s.K >= 1, op, ": weight must have at least one output channel, got shape ", shape(ws));
  check_bias(op, x, bias, s.K);
  TORCH_CHECK(s.H >= 1 && s.W >= 1, op, ": x's spatial size (", num(s.H), ", ", num(s.W),
              ") is smaller than the 1x1 kernel");
  s.Ho = (s.H - 1) / stride + 1;
  s.Wo = (s.W - 1) / stride + 1;
  return s;
}

}  // namespace opforge::conv

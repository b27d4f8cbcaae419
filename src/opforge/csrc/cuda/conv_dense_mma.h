// Dense 3x3 and 1x1 convolution forward on tensor cores (implicit GEMM) with
// the bias + activation epilogue fused. See conv_dense_mma_kernel.cuh for the design.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <vector>

#include <opforge/checks.h>

#include "activation.h"

namespace opforge::conv {

// out = act(conv3x3(x, w) + bias) for groups == 1 on CUDA; x (N,C,H,W) contiguous or channels_last,
// w (K,C,3,3), bias (K) or undefined; stride 1|2, padding 0|1; act fused. Returns false if this
// kernel does not handle the case (dtype/shape/alignment), so the caller falls back.
bool conv3x3_dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                               int64_t padding, Activation act, at::Tensor& out);

// out = act(conv1x1(x, w) + bias) for groups == 1 on CUDA; x as above, w (K,C,1,1), stride 1|2,
// no padding. Returns false where this kernel does not handle the case.
bool conv1x1_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                         Activation act, at::Tensor& out);

// The argument checks of the benchmark entry opforge_bench.conv_dense_mma,
// shared by its CUDA kernel and its shape function (sizes may be symbolic);
// returns the output's sizes (N, K, Ho, Wo).
inline std::vector<c10::SymInt> check_dense_mma_args(const at::Tensor& x, const at::Tensor& w,
                                                     const std::optional<at::Tensor>& bias, int64_t stride,
                                                     int64_t padding) {
  constexpr const char* op = "opforge_bench.conv_dense_mma";
  check_float_tensor(x, op, "x");
  check_float_tensor(w, op, "w");
  check_dim(x, 4, op, "x");
  check_dim(w, 4, op, "w");
  check_same_device(x, "x", w, "w", op);
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), op, ": w must have x's dtype ", dtype_name(x.scalar_type()),
                   ", got ", dtype_name(w.scalar_type()));
  const auto xs = x.sym_sizes(), ws = w.sym_sizes();
  TORCH_CHECK(ws[1] == xs[1] && ws[2] == 3 && ws[3] == 3, op, ": w must have shape (K, ", num(xs[1]), ", 3, 3), got ",
              shape(ws));
  TORCH_CHECK_VALUE(stride == 1 || stride == 2, op, ": stride must be 1 or 2, got ", num(stride));
  TORCH_CHECK_VALUE(padding == 0 || padding == 1, op, ": padding must be 0 or 1, got ", num(padding));
  if (bias.has_value() && bias->defined()) {
    check_same_device(x, "x", *bias, "bias", op);
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ",
                     dtype_name(x.scalar_type()), ", got ", dtype_name(bias->scalar_type()));
    TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == ws[0], op, ": bias must have shape (", num(ws[0]), "), got ",
                shape(bias->sym_sizes()));
  }
  TORCH_CHECK(xs[2] + 2 * padding >= 3 && xs[3] + 2 * padding >= 3, op,
              ": x's spatial size plus padding must be at least 3x3, got ", num(xs[2]), "x", num(xs[3]),
              " with padding ", num(padding));
  return {xs[0], ws[0], (xs[2] + 2 * padding - 3) / stride + 1, (xs[3] + 2 * padding - 3) / stride + 1};
}

}  // namespace opforge::conv

// The conv family's dense (groups == 1) CPU path (cpu/conv_dense_cpu.cpp),
// called by the CPU entries (cpu/conv_cpu.cpp).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "conv.h"

namespace opforge::conv {

// The forward's output as empty_output allocates it, without a trip through
// the dispatcher (a tenth of a small call's host time).
inline at::Tensor empty_output_cpu(const Geometry& g, const ForwardOperands& o) {
  return at::detail::empty_cpu({g.N, out_channels(g), g.Ho, g.Wo}, o.x.scalar_type(), false, o.fmt);
}

// act(conv3x3(x, w) + bias) for groups 1, operands as forward_operands gives
// them, the output not empty; in x's memory format.
at::Tensor dense_forward_cpu(const ForwardOperands& o, const Geometry& g, Activation act);

// The dense backward where its own path applies (stride 1, NCHW, below
// oneDNN's sizes; operands 4-d, not empty): grad x contiguous, grad weight
// contiguous, grad bias, masked-out entries (0,). nullopt elsewhere.
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> dense_backward_small_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& result, const at::Tensor& x, const at::Tensor& w,
    const Geometry& g, std::array<bool, 3> mask);

}  // namespace opforge::conv

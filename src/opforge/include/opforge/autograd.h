// Helpers for ops whose autograd is a torch::autograd::Function registered
// for the Autograd key: the no-graph fast path and gradient reduction.
#pragma once

#include <ATen/ExpandUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/SymIntArrayRef.h>
#include <torch/autograd.h>

#include <optional>
#include <vector>

namespace opforge::autograd {

using Context = torch::autograd::AutogradContext;
using Tensors = torch::autograd::variable_list;

inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && requires_grad(*t); }

// True when the call has to record a graph: grad mode is on and an input
// requires grad. Otherwise the Autograd kernel calls the op below autograd
// directly, so a call without gradients costs what the kernel costs.
template <typename... Ts>
bool records_graph(const Ts&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// What a gradient needs to reach an input of a broadcasting op: the input's
// shape and dtype where they differ from the output's, nothing otherwise
// (the common case costs no saved state). Sizes stay symbolic under
// torch.compile's dynamic shapes, so the backward traces with them.
inline void save_input_meta(Context* ctx, const char* key, const at::Tensor& input, const at::Tensor& output) {
  if (input.scalar_type() == output.scalar_type() && input.sym_sizes().equals(output.sym_sizes())) return;
  ctx->saved_data[key] = c10::IValue(std::make_tuple(input.sym_sizes().vec(), input.scalar_type()));
}

// The output gradient as the gradient of the input saved under `key`:
// summed over the broadcast dims, in the input's dtype.
inline at::Tensor to_input(Context* ctx, const char* key, const at::Tensor& grad) {
  auto it = ctx->saved_data.find(key);
  if (it == ctx->saved_data.end()) return grad;
  const auto meta = it->second.toTuple();
  const std::vector<c10::SymInt> sizes = meta->elements()[0].toSymIntVector();
  const auto dtype = meta->elements()[1].toScalarType();
  at::Tensor g = grad.sym_sizes().equals(sizes) ? grad : at::sum_to(grad, c10::SymIntArrayRef(sizes));
  return g.scalar_type() == dtype ? g : g.to(dtype);
}

}  // namespace opforge::autograd

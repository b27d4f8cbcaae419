// Shared set-up for elementwise ops: checks, type promotion and a
// TensorIterator that handles broadcasting, strides and the output's memory
// format exactly as torch's own binary ops do. Backends only supply the loop.
#pragma once

#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/result_type.h>

#include <opforge/checks.h>

namespace opforge {

// The common case needs no TensorIterator: same dtype (a supported float),
// same shape, both contiguous on one device. A flat loop over the elements
// then gives torch's result (a contiguous output), with less set-up cost.
inline bool is_flat_binary(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.scalar_type() == b.scalar_type() && is_supported_float(a.scalar_type()) &&
         a.device() == b.device() && a.sizes().equals(b.sizes()) && a.is_contiguous() && b.is_contiguous();
}

// Checks both inputs, promotes them to their common dtype (torch's rules,
// e.g. float16 + float32 -> float32), and builds an iterator with a freshly
// allocated output. Mixed devices are an error (no implicit copies).
inline at::TensorIterator make_binary_float_iter(const char* op, const at::Tensor& a, const char* a_name,
                                                 const at::Tensor& b, const char* b_name) {
  check_float_tensor(a, op, a_name);
  check_float_tensor(b, op, b_name);
  check_same_device(a, a_name, b, b_name, op);
  const auto common = at::result_type(a, b);
  const at::Tensor a_c = a.scalar_type() == common ? a : a.to(common);
  const at::Tensor b_c = b.scalar_type() == common ? b : b.to(common);
  // TensorIterator's own error would not name our arguments.
  const auto a_sizes = a.sizes(), b_sizes = b.sizes();
  const int64_t ndim = std::max<int64_t>(a.dim(), b.dim());
  for (int64_t i = 0; i < ndim; ++i) {
    const int64_t sa = i < a.dim() ? a_sizes[a.dim() - 1 - i] : 1;
    const int64_t sb = i < b.dim() ? b_sizes[b.dim() - 1 - i] : 1;
    TORCH_CHECK_VALUE(sa == sb || sa == 1 || sb == 1, op, ": ", a_name, " with shape ", shape(a_sizes), " and ", b_name,
                      " with shape ", shape(b_sizes), " are not broadcastable (dimension ", num(ndim - 1 - i), ": ",
                      num(sa), " vs ", num(sb), ")");
  }
  // Owned operands: the promoted copies die with this function, and the
  // output is allocated by the iterator (torch's memory-format rules).
  return at::TensorIteratorConfig()
      .add_owned_output(at::Tensor())
      .add_owned_const_input(a_c)
      .add_owned_const_input(b_c)
      .build();
}

}  // namespace opforge

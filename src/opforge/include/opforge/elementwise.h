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

// The add family's one argument contract, shared by the CPU and CUDA kernels
// and the shape function: float tensors on one device, broadcastable shapes. Symbolic sizes are compared as such.
inline void check_binary_args(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name) {
  check_float_tensor(a, op, a_name);
  check_float_tensor(b, op, b_name);
  check_same_device(a, a_name, b, b_name, op);
  const auto a_sizes = a.sym_sizes(), b_sizes = b.sym_sizes();
  const int64_t a_dim = static_cast<int64_t>(a_sizes.size()), b_dim = static_cast<int64_t>(b_sizes.size());
  const int64_t ndim = std::max(a_dim, b_dim);
  for (int64_t i = 0; i < ndim; ++i) {
    const c10::SymInt sa = i < a_dim ? a_sizes[a_dim - 1 - i] : c10::SymInt(1);
    const c10::SymInt sb = i < b_dim ? b_sizes[b_dim - 1 - i] : c10::SymInt(1);
    // Torch's own ops raise RuntimeError for shapes that do not broadcast;
    // so does this, so code written for torch.add catches it the same way.
    TORCH_CHECK(sa == sb || sa == 1 || sb == 1, op, ": ", a_name, " with shape ", shape(a_sizes), " and ", b_name,
                " with shape ", shape(b_sizes), " are not broadcastable (dimension ", num(ndim - 1 - i), ": ", num(sa),
                " vs ", num(sb), ")");
  }
}

// Promotes both inputs to their common dtype (torch's rules, e.g. float16 +
// float32 -> float32) and builds
// an iterator with a freshly allocated output. Call check_binary_args first.
inline at::TensorIterator make_binary_float_iter(const at::Tensor& a, const at::Tensor& b) {
  const auto common = at::result_type(a, b);
  const at::Tensor a_c = a.scalar_type() == common ? a : a.to(common);
  const at::Tensor b_c = b.scalar_type() == common ? b : b.to(common);
  // Owned operands: the promoted copies die with this function, and the
  // output is allocated by the iterator (torch's memory-format rules).
  return at::TensorIteratorConfig()
      .add_owned_output(at::Tensor())
      .add_owned_const_input(a_c)
      .add_owned_const_input(b_c)
      .build();
}

}  // namespace opforge

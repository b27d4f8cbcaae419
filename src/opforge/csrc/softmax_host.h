// Host side of the softmax family, shared by the CPU and CUDA entry points:
// argument checks (the same words as ops/softmax.py), the (outer, K, inner)
// view, the dtype= conversion, and the mask's row map.
//
// Non-contiguous inputs are made contiguous once (documented in
// docs/ops/softmax.md); contiguous ones are used in place, over any dim.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <opforge/checks.h>

#include <vector>

#include "softmax.h"

namespace opforge::softmax {

inline int64_t wrap_dim(const char* op, const at::Tensor& t, int64_t dim, const char* t_name) {
  const int64_t n = std::max<int64_t>(t.dim(), 1);
  TORCH_CHECK_INDEX(dim >= -n && dim < n, op, ": dim must be in [", -n, ", ", n - 1, "] for a ", t.dim(), "-d ", t_name,
                    ", got ", dim);
  return dim < 0 ? dim + n : dim;
}

inline void view_3d(const at::Tensor& t, int64_t dim, int64_t& outer, int64_t& K, int64_t& inner) {
  outer = 1;
  inner = 1;
  K = t.dim() == 0 ? 1 : t.size(dim);
  for (int64_t d = 0; d < dim; ++d) outer *= t.size(d);
  for (int64_t d = dim + 1; d < t.dim(); ++d) inner *= t.size(d);
}

struct Prepared {
  at::Tensor x;     // contiguous input (in the result dtype)
  at::Tensor out;   // contiguous, uninitialised
  at::Tensor mask;  // kept alive while the kernel runs
  FwdArgs args;
};

// softmax / log_softmax.
inline Prepared prepare_softmax(const char* op, Mode mode, const at::Tensor& x, int64_t dim,
                                c10::optional<c10::ScalarType> dtype) {
  check_float_tensor(x, op, "x");
  if (dtype.has_value()) {
    TORCH_CHECK_TYPE(is_supported_float(*dtype), op,
                     ": dtype must be float32, float64, float16, bfloat16 or None, got ", *dtype);
  }
  const int64_t d = wrap_dim(op, x, dim, "x");
  Prepared p;
  // dtype=: torch converts the input first, so do we (one conversion pass).
  p.x = (dtype.has_value() ? x.to(*dtype) : x).contiguous();
  p.out = at::empty(p.x.sizes(), p.x.options().memory_format(c10::MemoryFormat::Contiguous));
  p.args.dtype = p.x.scalar_type();
  p.args.mode = mode;
  p.args.in = p.x.const_data_ptr();
  p.args.out = p.out.mutable_data_ptr();
  view_3d(p.x, d, p.args.outer, p.args.K, p.args.inner);
  return p;
}

// scaled_masked_softmax: softmax(x * scale + mask) over the last dim.
inline Prepared prepare_scaled_masked(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                                      double scale, bool causal) {
  check_float_tensor(x, op, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension (..., Lk), got a 0-d tensor");
  Prepared p;
  p.x = x.contiguous();
  p.out = at::empty(p.x.sizes(), p.x.options().memory_format(c10::MemoryFormat::Contiguous));
  FwdArgs& a = p.args;
  a.dtype = p.x.scalar_type();
  a.mode = Mode::ScaledMasked;
  a.in = p.x.const_data_ptr();
  a.out = p.out.mutable_data_ptr();
  view_3d(p.x, x.dim() - 1, a.outer, a.K, a.inner);
  a.scale = scale;
  a.causal = causal;
  a.Lq = x.dim() >= 2 ? x.size(-2) : 1;
  if (a.Lq == 0) a.Lq = 1;

  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK_TYPE(m.scalar_type() == c10::kBool || m.scalar_type() == x.scalar_type(), op,
                     ": mask must be a bool tensor (True = masked out) or an additive float mask of x's dtype (",
                     x.scalar_type(), "), got ", m.scalar_type());
    check_same_device(x, "x", m, "mask", op);
    bool ok = m.dim() <= x.dim();
    for (int64_t i = 1; ok && i <= m.dim(); ++i) {
      const int64_t sm = m.size(-i), sx = x.size(-i);
      ok = sm == sx || sm == 1;
    }
    TORCH_CHECK_VALUE(ok, op, ": mask with shape ", m.sizes(), " is not broadcastable to x with shape ", x.sizes());
    at::Tensor e = m.expand(x.sizes());
    if (x.size(-1) > 1 && e.stride(-1) != 1) e = e.contiguous();
    // Leading dims of x (all but the last), size-1 dims dropped, coalesced
    // where the mask's strides allow.
    std::vector<int64_t> sizes, strides;
    for (int64_t d = 0; d + 1 < x.dim(); ++d) {
      if (x.size(d) == 1) continue;
      if (!sizes.empty() && strides.back() == e.stride(d) * x.size(d)) {
        sizes.back() *= x.size(d);
        strides.back() = e.stride(d);
      } else {
        sizes.push_back(x.size(d));
        strides.push_back(e.stride(d));
      }
    }
    if (static_cast<int>(sizes.size()) > RowOffset::kMaxDims) {
      e = e.contiguous();  // rare: too many independent broadcast dims
      sizes.assign(1, a.outer);
      strides.assign(1, x.size(-1));
    }
    a.mask_rows.ndim = static_cast<int>(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      a.mask_rows.sizes[i] = sizes[i];
      a.mask_rows.strides[i] = strides[i];
    }
    p.mask = e;
    a.mask = e.const_data_ptr();
    a.mask_is_bool = e.scalar_type() == c10::kBool;
  }
  return p;
}

struct PreparedBwd {
  at::Tensor grad, out, grad_in;
  BwdArgs args;
};

inline PreparedBwd prepare_backward(const char* op, Mode mode, const at::Tensor& grad, const at::Tensor& output,
                                    int64_t dim, double scale) {
  check_float_tensor(grad, op, "grad");
  check_float_tensor(output, op, "output");
  TORCH_CHECK_TYPE(grad.scalar_type() == output.scalar_type(), op,
                   ": grad and output must have the same dtype, got grad ", grad.scalar_type(), " and output ",
                   output.scalar_type());
  check_same_device(grad, "grad", output, "output", op);
  TORCH_CHECK_VALUE(grad.sizes() == output.sizes(), op, ": grad and output must have the same shape, got grad ",
                    grad.sizes(), " and output ", output.sizes());
  const int64_t d = wrap_dim(op, output, dim, "output");
  PreparedBwd p;
  p.grad = grad.contiguous();
  p.out = output.contiguous();
  p.grad_in = at::empty(p.out.sizes(), p.out.options().memory_format(c10::MemoryFormat::Contiguous));
  BwdArgs& a = p.args;
  a.dtype = p.out.scalar_type();
  a.mode = mode;
  a.grad = p.grad.const_data_ptr();
  a.out = p.out.const_data_ptr();
  a.grad_in = p.grad_in.mutable_data_ptr();
  a.scale = scale;
  view_3d(p.out, d, a.outer, a.K, a.inner);
  return p;
}

}  // namespace opforge::softmax

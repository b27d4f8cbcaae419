// Host side of the softmax family, in two parts:
//  * the argument contract (check_*_args): shared by the CPU and CUDA entry
//    points and the Meta shape functions (softmax.cpp). They read no data
//    and compare sizes as SymInts, so they also run on FakeTensors with
//    torch.compile's dynamic shapes;
//  * the kernel arguments (prepare_*), for real tensors that passed the
//    checks: the (outer, K, inner) view, the dtype= conversion, the output,
//    and the mask's row map.
//
// Non-contiguous inputs are made contiguous once (documented in
// docs/ops/softmax.md); contiguous ones are used in place, over any dim.
// Every output is a fresh contiguous tensor of the result dtype.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/Exception.h>

#include <opforge/checks.h>

#include <optional>

#include "softmax.h"

namespace opforge::softmax {

// ------------------------------------------------------------------ checks

// `dim` of a tensor with `ndim` dims, wrapped to [0, n); a 0-d tensor takes
// dim 0 or -1, as torch's reductions do. IndexError out of range.
inline int64_t wrap_dim(const char* op, int64_t ndim, int64_t dim, const char* t_name) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  TORCH_CHECK_INDEX(dim >= -n && dim < n, op, ": dim must be in [", num(-n), ", ", num(n - 1), "] for a ", num(ndim),
                    "-d ", t_name, ", got ", num(dim));
  return dim < 0 ? dim + n : dim;
}

// The output's dtype: dtype= where given, else x's.
inline c10::ScalarType result_dtype(const at::Tensor& x, std::optional<c10::ScalarType> dtype) {
  return dtype.has_value() ? *dtype : x.scalar_type();
}

// softmax / log_softmax: x a supported float tensor, dtype= a supported
// float dtype or None, dim in range. Returns dim wrapped to [0, n).
inline int64_t check_softmax_args(const char* op, const at::Tensor& x, int64_t dim,
                                  std::optional<c10::ScalarType> dtype) {
  check_float_tensor(x, op, "x");
  TORCH_CHECK_TYPE(!dtype.has_value() || is_supported_float(*dtype), op,
                   ": dtype must be float32, float64, float16, bfloat16 or None, got ", dtype_name(*dtype));
  return wrap_dim(op, x.dim(), dim, "x");
}

// scaled_masked_softmax: x a supported float tensor of at least 1 dim; mask
// bool or x's dtype, on x's device, broadcastable to x (its dims matched
// from the last; no more dims than x).
inline void check_scaled_masked_args(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& mask) {
  check_float_tensor(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension (..., Lk), got a 0-d tensor");
  if (!mask.has_value() || !mask->defined()) return;
  const at::Tensor& m = *mask;
  TORCH_CHECK_TYPE(m.scalar_type() == c10::kBool || m.scalar_type() == x.scalar_type(), op,
                   ": mask must be a bool tensor (True = masked out) or an additive float mask of x's dtype (",
                   dtype_name(x.scalar_type()), "), got ", dtype_name(m.scalar_type()));
  check_same_device(x, "x", m, "mask", op);
  const auto m_sizes = m.sym_sizes(), x_sizes = x.sym_sizes();
  bool ok = m_sizes.size() <= x_sizes.size();
  for (size_t i = 1; ok && i <= m_sizes.size(); ++i) {
    const c10::SymInt& sm = m_sizes[m_sizes.size() - i];
    ok = sm == x_sizes[x_sizes.size() - i] || sm == 1;
  }
  TORCH_CHECK(ok, op, ": mask with shape ", shape(m_sizes), " is not broadcastable to x with shape ", shape(x_sizes));
}

// The backward ops: grad and output supported float tensors of one dtype,
// device and shape; dim in range for output. Returns dim wrapped to [0, n).
inline int64_t check_backward_args(const char* op, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  check_float_tensor(grad, op, "grad");
  check_float_tensor(output, op, "output");
  TORCH_CHECK_TYPE(grad.scalar_type() == output.scalar_type(), op,
                   ": grad and output must have the same dtype, got grad ", dtype_name(grad.scalar_type()),
                   " and output ", dtype_name(output.scalar_type()));
  check_same_device(grad, "grad", output, "output", op);
  TORCH_CHECK(grad.sym_sizes().equals(output.sym_sizes()), op, ": grad and output must have the same shape, got grad ",
              shape(grad.sym_sizes()), " and output ", shape(output.sym_sizes()));
  return wrap_dim(op, output.dim(), dim, "output");
}

// --------------------------------------------------------- kernel arguments

inline void view_3d(const at::Tensor& t, int64_t dim, int64_t& outer, int64_t& K, int64_t& inner) {
  const auto sizes = t.sizes();
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  outer = 1;
  inner = 1;
  K = ndim == 0 ? 1 : sizes[dim];
  for (int64_t d = 0; d < dim; ++d) outer *= sizes[d];
  for (int64_t d = dim + 1; d < ndim; ++d) inner *= sizes[d];
}

// A fresh contiguous tensor shaped and placed like `t` (t's own layout and
// strides are not copied). On the CPU it is allocated directly, as torch's
// own CPU kernels allocate their outputs, without a second dispatch.
inline at::Tensor empty_contiguous(const at::Tensor& t) {
  if (t.is_cpu()) return at::detail::empty_cpu(t.sizes(), t.scalar_type());
  return at::empty(t.sizes(), t.options(), c10::MemoryFormat::Contiguous);
}

// `t` in `dtype`, contiguous: itself where it already is, else one copy
// (the conversion and the layout change in the same pass).
inline at::Tensor contiguous_as(const at::Tensor& t, c10::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t.contiguous();
  return t.to(dtype, /*non_blocking=*/false, /*copy=*/false, c10::MemoryFormat::Contiguous);
}

struct Prepared {
  at::Tensor x;     // contiguous input (in the result dtype)
  at::Tensor out;   // contiguous, uninitialised
  at::Tensor mask;  // kept alive while the kernel runs
  FwdArgs args;
};

// softmax / log_softmax over dim `d` (checked and wrapped by
// check_softmax_args). dtype=: torch converts the input first, so do we.
inline Prepared prepare_softmax(Mode mode, const at::Tensor& x, int64_t d, std::optional<c10::ScalarType> dtype) {
  Prepared p;
  p.x = contiguous_as(x, result_dtype(x, dtype));
  p.out = empty_contiguous(p.x);
  p.args.dtype = p.x.scalar_type();
  p.args.mode = mode;
  p.args.in = p.x.const_data_ptr();
  p.args.out = p.out.mutable_data_ptr();
  view_3d(p.x, d, p.args.outer, p.args.K, p.args.inner);
  return p;
}

// scaled_masked_softmax: softmax(x * scale + mask) over the last dim, for
// arguments that passed check_scaled_masked_args.
inline Prepared prepare_scaled_masked(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                      bool causal) {
  Prepared p;
  p.x = x.contiguous();
  p.out = empty_contiguous(p.x);
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
    const auto xs = x.sizes();
    const int64_t nd = static_cast<int64_t>(xs.size());
    // The mask's stride along x's dim d once expanded to x's shape (0 where
    // it broadcasts), read off its own sizes and strides: no view is made.
    auto stride_of = [&](const at::Tensor& t, int64_t d) -> int64_t {
      const int64_t dt = d - (nd - t.dim());
      return dt < 0 || (t.size(dt) == 1 && xs[d] != 1) ? 0 : t.stride(dt);
    };
    at::Tensor e = *mask;
    if (xs[nd - 1] > 1 && stride_of(e, nd - 1) != 1) e = e.expand(xs).contiguous();
    // Leading dims of x (all but the last), size-1 dims dropped, coalesced
    // where the mask's strides allow.
    RowOffset& rows = a.mask_rows;
    rows.ndim = 0;
    for (int64_t d = 0; d + 1 < nd && rows.ndim <= RowOffset::kMaxDims; ++d) {
      if (xs[d] == 1) continue;
      const int64_t stride = stride_of(e, d);
      if (rows.ndim > 0 && rows.strides[rows.ndim - 1] == stride * xs[d]) {
        rows.sizes[rows.ndim - 1] *= xs[d];
        rows.strides[rows.ndim - 1] = stride;
      } else if (rows.ndim < RowOffset::kMaxDims) {
        rows.sizes[rows.ndim] = xs[d];
        rows.strides[rows.ndim] = stride;
        ++rows.ndim;
      } else {
        ++rows.ndim;  // one more than the map holds: stop
      }
    }
    if (rows.ndim > RowOffset::kMaxDims) {
      e = e.expand(xs).contiguous();  // rare: too many independent broadcast dims
      rows.ndim = 1;
      rows.sizes[0] = a.outer;
      rows.strides[0] = xs[nd - 1];
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

// The backward ops over dim `d`, for arguments that passed check_backward_args.
inline PreparedBwd prepare_backward(Mode mode, const at::Tensor& grad, const at::Tensor& output, int64_t d,
                                    double scale) {
  PreparedBwd p;
  p.grad = grad.contiguous();
  p.out = output.contiguous();
  p.grad_in = empty_contiguous(p.out);
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

// The softmax family's home: schemas and shape functions. Kernels:
// cpu/softmax_cpu.cpp and cuda/softmax/ (the one argument contract, shared
// with the shape functions: softmax_host.h check_*_args); autograd:
// softmax_autograd.cpp. Backward passes are ops of their own so that
// opcheck and torch.compile see them.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "softmax_host.h"

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // torch.softmax / torch.log_softmax over any dim; dtype= converts x first.
  m.def("softmax(Tensor x, int dim=-1, ScalarType? dtype=None) -> Tensor");
  m.def("log_softmax(Tensor x, int dim=-1, ScalarType? dtype=None) -> Tensor");
  // softmax(x * scale + mask) over the last dim; mask: bool (True = masked
  // out) or additive float of x's dtype, broadcastable to x; causal: keys
  // after the query (top-left aligned) are masked. Fully masked rows give 0.
  m.def("scaled_masked_softmax(Tensor x, Tensor? mask=None, float scale=1.0, bool causal=False) -> Tensor");
  // y * (grad - sum(grad * y)) over dim; y = softmax's output.
  m.def("_softmax_backward(Tensor grad, Tensor output, int dim) -> Tensor");
  // grad - exp(y) * sum(grad) over dim; y = log_softmax's output.
  m.def("_log_softmax_backward(Tensor grad, Tensor output, int dim) -> Tensor");
  // scale * y * (grad - sum(grad * y)) over the last dim.
  m.def("_scaled_masked_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor");
}

TORCH_LIBRARY_FRAGMENT(opforge_bench, m) {
  // CUDA only, for measuring launch plans (bench/softmax_plans.py):
  // softmax and its backward over the last dim with a given plan: threads
  // per row (or per chunk of a longer row), rows per block, 16-byte vectors
  // per thread, whether a row longer than one block may use a cluster, and
  // (forward) whether clusters stay resident and walk the rows.
  m.def(
      "softmax_plan(Tensor x, int threads_per_row, int rows_per_block, int vectors_per_thread, bool cluster, "
      "bool persistent=False) -> Tensor");
  m.def(
      "softmax_backward_plan(Tensor grad, Tensor output, int threads_per_row, int rows_per_block, "
      "int vectors_per_thread, bool cluster) -> Tensor");
}

namespace {

namespace sm = opforge::softmax;

// Shape functions: the kernels' checks, then the kernels' output, a fresh
// contiguous tensor of x's shape in the result dtype. Sizes stay symbolic
// under torch.compile's dynamic shapes.
at::Tensor empty_like_contiguous(const at::Tensor& t, c10::ScalarType dtype) {
  return at::empty_symint(t.sym_sizes(), t.options().dtype(dtype), c10::MemoryFormat::Contiguous);
}

template <const char* Op>
at::Tensor softmax_meta(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  sm::check_softmax_args(Op, x, dim, dtype);
  return empty_like_contiguous(x, sm::result_dtype(x, dtype));
}

at::Tensor scaled_masked_softmax_meta(const at::Tensor& x, const std::optional<at::Tensor>& mask, double /*scale*/,
                                      bool /*causal*/) {
  sm::check_scaled_masked_args("opforge.scaled_masked_softmax", x, mask);
  return empty_like_contiguous(x, x.scalar_type());
}

template <const char* Op>
at::Tensor backward_meta(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  sm::check_backward_args(Op, grad, output, dim);
  return empty_like_contiguous(output, output.scalar_type());
}

at::Tensor scaled_masked_softmax_backward_meta(const at::Tensor& grad, const at::Tensor& output, double /*scale*/) {
  sm::check_backward_args("opforge._scaled_masked_softmax_backward", grad, output, -1);
  return empty_like_contiguous(output, output.scalar_type());
}

constexpr char kSoftmax[] = "opforge.softmax";
constexpr char kLogSoftmax[] = "opforge.log_softmax";
constexpr char kSoftmaxBackward[] = "opforge._softmax_backward";
constexpr char kLogSoftmaxBackward[] = "opforge._log_softmax_backward";

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("softmax", &softmax_meta<kSoftmax>);
  m.impl("log_softmax", &softmax_meta<kLogSoftmax>);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_meta);
  m.impl("_softmax_backward", &backward_meta<kSoftmaxBackward>);
  m.impl("_log_softmax_backward", &backward_meta<kLogSoftmaxBackward>);
  m.impl("_scaled_masked_softmax_backward", &scaled_masked_softmax_backward_meta);
}

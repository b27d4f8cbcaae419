// The softmax family's home: its schemas (kernels: cpu/softmax_cpu.cpp and
// cuda/softmax/; Python wrapper, fake kernels and autograd: ops/softmax.py).
// Backward passes are ops of their own so that opcheck and torch.compile see them.
#include <torch/library.h>

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

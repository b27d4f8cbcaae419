// Every opforge op's schema, in one place. Kernels are registered per backend
// in cpu/<op>.cpp and cuda/<op>.cu; Python wrappers, fake kernels and
// autograd live in ops/<op>.py. Backward passes are ops of their own so that
// opcheck and torch.compile see them.
#include <torch/library.h>

// ---- add family (ops/add.py) ------------------------------------------------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  // relu(a + b) in one pass: the seeds' `slow_add`, fused.
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  // grad * (result > 0) in one pass; `result` is add_relu's output.
  m.def("_add_relu_backward(Tensor grad, Tensor result) -> Tensor");
}

// ---- softmax family (ops/softmax.py) ----------------------------------------
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

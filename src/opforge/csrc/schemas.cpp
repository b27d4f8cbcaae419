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

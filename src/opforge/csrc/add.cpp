// The add family's schemas. Kernels: cpu/add_cpu.cpp, cuda/add.cu (their
// shared arithmetic: add.h); Python wrapper, fake kernels and autograd:
// ops/add.py. The backward is an op of its own so that opcheck and
// torch.compile see it.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  // relu(a + b) in one pass: the seeds' `slow_add`, fused.
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  // grad * (result > 0) in one pass; `result` is add_relu's output.
  m.def("_add_relu_backward(Tensor grad, Tensor result) -> Tensor");
}

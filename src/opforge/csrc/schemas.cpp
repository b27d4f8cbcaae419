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

// ---- conv family (ops/conv.py) ----------------------------------------------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // act(conv3x3(x, weight) + bias) with the bias and ReLU fused into the
  // convolution's write; groups is 1 (dense) or C (depthwise).
  m.def("conv2d_3x3(Tensor x, Tensor weight, Tensor? bias, int stride, int padding, int groups, bool relu) -> Tensor");
  // Gradients of conv2d_3x3. `result` is the forward's output when relu was
  // fused (the mask result > 0 is applied to grad_out inside), None otherwise.
  // Entries of output_mask that are False come back as empty (0,) tensors.
  m.def(
      "_conv2d_3x3_backward(Tensor grad_out, Tensor? result, Tensor x, Tensor weight, int stride, int padding, "
      "int groups, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

// CUDA kernels of the add family (opforge/cuda_loops.cuh): 16-byte
// vectorized loads for contiguous operands, a strided kernel for
// broadcast/non-contiguous ones; current stream, device guard, launch
// check, no host synchronisation.
#include <torch/library.h>

#include <opforge/cuda_loops.cuh>

#include "add.h"

namespace {

using opforge::cuda::run_elementwise;

at::Tensor add_cuda(const at::Tensor& a, const at::Tensor& b) {
  return run_elementwise<2>("opforge.add", {a, b}, {"a", "b"}, opforge::add_ops::Add{});
}

at::Tensor add_relu_cuda(const at::Tensor& a, const at::Tensor& b) {
  return run_elementwise<2>("opforge.add_relu", {a, b}, {"a", "b"}, opforge::add_ops::AddRelu{});
}

at::Tensor add_relu_backward_cuda(const at::Tensor& grad, const at::Tensor& result) {
  return run_elementwise<2>("opforge._add_relu_backward", {grad, result}, {"grad", "result"},
                            opforge::add_ops::ReluBackward{});
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("add", &add_cuda);
  m.impl("add_relu", &add_relu_cuda);
  m.impl("_add_relu_backward", &add_relu_backward_cuda);
}

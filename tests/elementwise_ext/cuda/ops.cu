// CUDA kernels of the test ops: opforge::cuda::run_elementwise (flat
// vectorized kernel, or a TensorIterator with the vectorized/strided
// kernels) over the functors the CPU loops use for their scalar tails.
#include <torch/library.h>

#include <opforge/cuda_loops.cuh>

#include "functors.h"

namespace {

using opforge::cuda::run_elementwise;

at::Tensor fma3_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z) {
  return run_elementwise<3>("opforge_nary_test.fma3", {x, y, z}, {"x", "y", "z"}, nary_test::Fma3{});
}

at::Tensor gelu_bias_cuda(const at::Tensor& x, const at::Tensor& bias) {
  return run_elementwise<2>("opforge_nary_test.gelu_bias", {x, bias}, {"x", "bias"}, nary_test::GeluBias{});
}

at::Tensor gelu_bias_backward_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  return run_elementwise<3>("opforge_nary_test._gelu_bias_backward", {grad, x, bias}, {"grad", "x", "bias"},
                            nary_test::GeluBiasBackward{});
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge_nary_test, CUDA, m) {
  m.impl("fma3", &fma3_cuda);
  m.impl("gelu_bias", &gelu_bias_cuda);
  m.impl("_gelu_bias_backward", &gelu_bias_backward_cuda);
}

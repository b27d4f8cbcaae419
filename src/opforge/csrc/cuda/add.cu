// CUDA kernels of the add family: 16-byte vectorized loads for contiguous
// operands, a strided kernel for broadcast/non-contiguous ones; current
// stream, device guard, launch check, no host synchronisation.
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_loops.cuh>
#include <opforge/dispatch.h>
#include <opforge/elementwise.h>

#include "add.h"

namespace {

template <typename Op>
at::Tensor run(const char* op_name, const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name,
               Op op) {
  if (opforge::is_flat_binary(a, b)) {
    const c10::cuda::CUDAGuard guard(a.device());
    auto out = at::empty_like(a, at::MemoryFormat::Contiguous);
    OPFORGE_DISPATCH_FLOATING_TYPES(a.scalar_type(), "opforge_add_family", [&] {
      opforge::cuda::binary_contiguous<scalar_t>(out.mutable_data_ptr<scalar_t>(), a.const_data_ptr<scalar_t>(),
                                                 b.const_data_ptr<scalar_t>(), a.numel(), op);
    });
    return out;
  }
  opforge::check_binary_args(op_name, a, a_name, b, b_name);
  auto iter = opforge::make_binary_float_iter(a, b);
  const c10::cuda::CUDAGuard guard(iter.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(iter.dtype(0), "opforge_add_family",
                                  [&] { opforge::cuda::binary_kernel<scalar_t>(iter, op); });
  return iter.output();
}

at::Tensor add_cuda(const at::Tensor& a, const at::Tensor& b) {
  return run("opforge.add", a, "a", b, "b", opforge::add_ops::Add{});
}

at::Tensor add_relu_cuda(const at::Tensor& a, const at::Tensor& b) {
  return run("opforge.add_relu", a, "a", b, "b", opforge::add_ops::AddRelu{});
}

at::Tensor add_relu_backward_cuda(const at::Tensor& grad, const at::Tensor& result) {
  return run("opforge._add_relu_backward", grad, "grad", result, "result", opforge::add_ops::ReluBackward{});
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("add", &add_cuda);
  m.impl("add_relu", &add_relu_cuda);
  m.impl("_add_relu_backward", &add_relu_backward_cuda);
}

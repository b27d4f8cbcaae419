// The softmax backward row kernels for float64, all three modes (one dtype
// per file: nvcc builds the files in parallel).
#include "launch_backward.cuh"

namespace opforge::softmax::gpu {

template <>
void backward_rows<double>(Mode mode, const BwdArgs& a, const at::Tensor& out, const PlanRequest* req) {
  with_mode(mode, [&](auto m) { backward_rows_impl<double, decltype(m)::value>(a, out, req); });
}

}  // namespace opforge::softmax::gpu

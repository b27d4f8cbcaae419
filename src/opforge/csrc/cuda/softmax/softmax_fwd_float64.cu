// The softmax forward row kernels for float64, all three modes (one dtype
// per file: nvcc builds the files in parallel).
#include "launch_forward.cuh"

namespace opforge::softmax::gpu {

template <>
void forward_rows<double>(Mode mode, const FwdArgs& a, const at::Tensor& x, const PlanRequest* req) {
  with_mode(mode, [&](auto m) { forward_rows_impl<double, decltype(m)::value>(a, x, req); });
}

}  // namespace opforge::softmax::gpu

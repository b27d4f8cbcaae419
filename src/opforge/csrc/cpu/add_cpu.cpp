// CPU entry points of the add family: checks, promotion and the iterator
// (opforge/cpu_elementwise.h), then the loop compiled for this CPU's best
// ISA (cpu/add_kernels.h), in parallel.
#include <torch/library.h>

#include <opforge/cpu_elementwise.h>
#include <opforge/cpu_isa.h>

OPFORGE_CPU_DECLARE(void, add_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)
OPFORGE_CPU_DECLARE(void, add_relu_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)
OPFORGE_CPU_DECLARE(void, relu_backward_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)

namespace {

at::Tensor add_cpu(const at::Tensor& a, const at::Tensor& b) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(add_loop), "opforge.add", {a, b}, {"a", "b"});
}

at::Tensor add_relu_cpu(const at::Tensor& a, const at::Tensor& b) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(add_relu_loop), "opforge.add_relu", {a, b}, {"a", "b"});
}

at::Tensor add_relu_backward_cpu(const at::Tensor& grad, const at::Tensor& result) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(relu_backward_loop), "opforge._add_relu_backward",
                                       {grad, result}, {"grad", "result"});
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("add", &add_cpu);
  m.impl("add_relu", &add_relu_cpu);
  m.impl("_add_relu_backward", &add_relu_backward_cpu);
}

// CPU entry points of the add family: checks, promotion and the iterator
// (opforge/elementwise.h), then the loop compiled for this CPU's best ISA
// (cpu/add_kernels.h), parallel through TensorIterator::for_each.
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <opforge/cpu_isa.h>
#include <opforge/elementwise.h>

OPFORGE_CPU_DECLARE(void, add_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)
OPFORGE_CPU_DECLARE(void, add_relu_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)
OPFORGE_CPU_DECLARE(void, relu_backward_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)

namespace {

using Loop = void (*)(c10::ScalarType, char**, const int64_t*, int64_t, int64_t);

at::Tensor run(Loop loop, const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
               const char* b_name) {
  if (opforge::is_flat_binary(a, b)) {
    auto out = at::empty_like(a, at::MemoryFormat::Contiguous);
    const int64_t s = a.element_size();
    char* po = static_cast<char*>(out.data_ptr());
    const char* pa = static_cast<const char*>(a.const_data_ptr());
    const char* pb = static_cast<const char*>(b.const_data_ptr());
    const auto dtype = a.scalar_type();
    at::parallel_for(0, a.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      char* data[3] = {po + begin * s, const_cast<char*>(pa + begin * s), const_cast<char*>(pb + begin * s)};
      const int64_t strides[6] = {s, s, s, 0, 0, 0};
      loop(dtype, data, strides, end - begin, 1);
    });
    return out;
  }
  opforge::check_binary_args(op, a, a_name, b, b_name);
  auto iter = opforge::make_binary_float_iter(a, b);
  const auto dtype = iter.dtype(0);
  iter.for_each([&](char** data, const int64_t* strides, int64_t n, int64_t m) { loop(dtype, data, strides, n, m); });
  return iter.output();
}

at::Tensor add_cpu(const at::Tensor& a, const at::Tensor& b) {
  return run(OPFORGE_CPU_SELECT(add_loop), "opforge.add", a, "a", b, "b");
}

at::Tensor add_relu_cpu(const at::Tensor& a, const at::Tensor& b) {
  return run(OPFORGE_CPU_SELECT(add_relu_loop), "opforge.add_relu", a, "a", b, "b");
}

at::Tensor add_relu_backward_cpu(const at::Tensor& grad, const at::Tensor& result) {
  return run(OPFORGE_CPU_SELECT(relu_backward_loop), "opforge._add_relu_backward", grad, "grad", result, "result");
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("add", &add_cpu);
  m.impl("add_relu", &add_relu_cpu);
  m.impl("_add_relu_backward", &add_relu_backward_cpu);
}

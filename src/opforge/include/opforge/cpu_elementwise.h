// The CPU driver of an elementwise op: checks, promotion and the iterator
// (elementwise.h), then a loop compiled per ISA (cpu_loops.h), run in
// parallel. Include it from a source compiled ONCE (not per ISA): the
// iterator and the parallel loop are ISA-neutral code, and TensorIterator's
// inline functions must not be compiled with a wider target than the
// baseline (the linker would keep one copy for every caller).
//
//   // cpu/my_op.cpp
//   OPFORGE_CPU_DECLARE(void, myops_fma3_loop, c10::ScalarType, char**, const int64_t*, int64_t, int64_t)
//   at::Tensor fma3_cpu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z) {
//     return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(myops_fma3_loop), "myops.fma3", {x, y, z},
//                                          {"x", "y", "z"});
//   }
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/SmallVector.h>

#include <opforge/elementwise.h>

namespace opforge::cpu {

// One TensorIterator 2-d chunk for the dtype of the output (operand 0):
// what a per-ISA loop built on elementwise_loop2d exposes (cpu_isa.h
// declares and selects it).
using Loop2d = void (*)(c10::ScalarType dtype, char** data, const int64_t* strides, int64_t n, int64_t m);

// Runs `loop` over an already-built iterator (outputs first, then inputs).
inline void for_each(Loop2d loop, at::TensorIteratorBase& iter) {
  const auto dtype = iter.dtype(0);
  iter.for_each([&](char** data, const int64_t* strides, int64_t n, int64_t m) { loop(dtype, data, strides, n, m); });
}

// out = op(inputs...) with one fresh output: inputs of one dtype, shape and
// device, all contiguous, run as one flat parallel loop (no iterator to
// build: the call costs less); anything else is checked, promoted and
// broadcast through make_float_iter. Either way the result is torch's
// (shape, dtype, memory format).
inline at::Tensor run_elementwise(Loop2d loop, const char* op, at::ArrayRef<at::Tensor> inputs,
                                  at::ArrayRef<const char*> names) {
  if (is_flat(inputs)) {
    const at::Tensor& first = inputs[0];
    auto out = at::empty_like(first, at::MemoryFormat::Contiguous);
    const int64_t nt = static_cast<int64_t>(inputs.size()) + 1;
    const int64_t s = first.element_size();
    c10::SmallVector<char*, 8> base(nt);
    base[0] = static_cast<char*>(out.data_ptr());
    for (int64_t k = 1; k < nt; ++k) base[k] = static_cast<char*>(const_cast<void*>(inputs[k - 1].const_data_ptr()));
    const auto dtype = first.scalar_type();
    at::parallel_for(0, first.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
      c10::SmallVector<char*, 8> data(nt);
      c10::SmallVector<int64_t, 16> strides(2 * nt, 0);  // inner strides s, outer strides 0 (one row)
      for (int64_t k = 0; k < nt; ++k) {
        data[k] = base[k] + begin * s;
        strides[k] = s;
      }
      loop(dtype, data.data(), strides.data(), end - begin, 1);
    });
    return out;
  }
  auto iter = make_float_iter(op, inputs, names);
  for_each(loop, iter);
  return iter.output();
}

}  // namespace opforge::cpu

// Loops of the add family, compiled once per ISA by add_{default,avx2,avx512}.cpp
// (which include cpu_isa_begin.h first). Each takes one TensorIterator 2-d
// chunk; cpu/add_cpu.cpp builds the iterator and picks the ISA.
#include <c10/core/ScalarType.h>

#include <opforge/cpu_loops.h>
#include <opforge/dispatch.h>

#include "add.h"

namespace opforge::cpu::CPU_CAPABILITY {

#define OPFORGE_ADD_LOOP(name, scalar_op, vec_body)                                             \
  void name(c10::ScalarType dtype, char** data, const int64_t* strides, int64_t n, int64_t m) { \
    OPFORGE_DISPATCH_FLOATING_TYPES(dtype, #name, [&] {                                         \
      binary_loop2d<scalar_t>(data, strides, n, m, scalar_op, [](auto x, auto y) { vec_body }); \
    });                                                                                         \
  }

OPFORGE_ADD_LOOP(add_loop, add_ops::Add{}, return x + y;)

// relu(x + y): blend, not max, so NaN propagates (NaN < 0 is false).
OPFORGE_ADD_LOOP(add_relu_loop, add_ops::AddRelu{}, using V = decltype(x); const auto z = x + y;
                 return V::blendv(z, V(0), z < V(0));)

// grad * (result > 0), as torch's threshold_backward: x = grad, y = result.
OPFORGE_ADD_LOOP(relu_backward_loop, add_ops::ReluBackward{}, using V = decltype(x);
                 return V::blendv(x, V(0), y <= V(0));)

#undef OPFORGE_ADD_LOOP

}  // namespace opforge::cpu::CPU_CAPABILITY

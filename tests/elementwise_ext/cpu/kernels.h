// The CPU loops of the test ops, compiled once per instruction set by
// cpu/isa_{default,avx2,avx512}.cpp. Each is one TensorIterator 2-d chunk;
// ops.cpp runs them through opforge::cpu::run_elementwise.
#include <c10/core/ScalarType.h>

#include <opforge/cpu_loops.h>
#include <opforge/dispatch.h>

#include "functors.h"

namespace opforge::cpu::CPU_CAPABILITY {

// One generic lambda serves values and vectors alike.
void nary_test_fma3_loop(c10::ScalarType dtype, char** data, const int64_t* strides, int64_t n, int64_t m) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "nary_test_fma3", [&] {
    elementwise_loop2d<scalar_t, 3>(data, strides, n, m, [](auto x, auto y, auto z) { return x * y + z; });
  });
}

void nary_test_gelu_bias_loop(c10::ScalarType dtype, char** data, const int64_t* strides, int64_t n, int64_t m) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "nary_test_gelu_bias", [&] {
    elementwise_loop2d<scalar_t, 2>(data, strides, n, m, nary_test::GeluBias{}, [](auto x, auto bias) {
      using V = decltype(x);
      const V z = x + bias;
      const V u = V(nary_test::kBeta) * (z + V(nary_test::kKappa) * z * z * z);
      return V(0.5) * z * (V(1) + u.tanh());
    });
  });
}

void nary_test_gelu_bias_backward_loop(c10::ScalarType dtype, char** data, const int64_t* strides, int64_t n,
                                       int64_t m) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "nary_test_gelu_bias_backward", [&] {
    elementwise_loop2d<scalar_t, 3>(data, strides, n, m, nary_test::GeluBiasBackward{},
                                    [](auto grad, auto x, auto bias) {
                                      using V = decltype(x);
                                      const V z = x + bias;
                                      const V z2 = z * z;
                                      const V t = (V(nary_test::kBeta) * (z + V(nary_test::kKappa) * z2 * z)).tanh();
                                      const V du = V(nary_test::kBeta) * (V(1) + V(3 * nary_test::kKappa) * z2);
                                      return grad * (V(0.5) * (V(1) + t) + V(0.5) * z * (V(1) - t * t) * du);
                                    });
  });
}

// Which ISA's copy of the loops runs (0 DEFAULT, 1 AVX2, 2 AVX512).
int nary_test_isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return 2;
#elif defined(CPU_CAPABILITY_AVX2)
  return 1;
#else
  return 0;
#endif
}

}  // namespace opforge::cpu::CPU_CAPABILITY

// g * d act(z) / dz for a vector, as torch's backward functions define it
// (threshold_backward, hardtanh_backward, hardswish_backward,
// silu_backward): the vector form of the derivative for loops that recompute
// the pre-activation z. Compiled once per ISA (after cpu_isa_begin.h).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include "activation.h"

namespace opforge::cpu::CPU_CAPABILITY {

// Comparisons are false for NaN: a NaN z passes the gradient through relu
// and relu6, as torch's backward does (it zeroes where z <= 0 or z >= 6).
template <typename T>
inline at::vec::Vectorized<T> act_grad_vec(const at::vec::Vectorized<T>& g, const at::vec::Vectorized<T>& z,
                                           Activation act) {
  using V = at::vec::Vectorized<T>;
  const V zero(T(0));
  switch (act) {
    case Activation::Relu:
      return V::blendv(g, zero, z <= zero);
    case Activation::Relu6:
      return V::blendv(g, zero, (z <= zero) | (z >= V(T(6))));
    case Activation::Hardswish: {
      const V mid = g * (z / V(T(3)) + V(T(0.5)));
      return V::blendv(V::blendv(mid, g, z > V(T(3))), zero, z < V(T(-3)));
    }
    case Activation::Silu: {
      const V one(T(1));
      const V s = one / (one + z.neg().exp());
      return g * s * (one + z * (one - s));
    }
    default:
      return g;
  }
}

}  // namespace opforge::cpu::CPU_CAPABILITY

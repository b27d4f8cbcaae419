// Scalar arithmetic of the test ops, shared by the CPU loops (scalar tails
// and strided data) and the CUDA kernels, so both compute the same thing in
// opmath_t.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>

namespace nary_test {

// x * y + z.
struct Fma3 {
  template <typename T>
  C10_HOST_DEVICE T operator()(T x, T y, T z) const {
    return x * y + z;
  }
};

// gelu_tanh(z) = z / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (z + 0.044715 z^3).
constexpr double kBeta = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kKappa = 0.044715;

struct GeluBias {
  template <typename T>
  C10_HOST_DEVICE T operator()(T x, T bias) const {
    const T z = x + bias;
    const T u = T(kBeta) * (z + T(kKappa) * z * z * z);
    return T(0.5) * z * (T(1) + std::tanh(u));
  }
};

// grad * d/dz gelu_tanh(z) at z = x + bias: the backward reads the input,
// not the output. d/dz = (1 + t) / 2 + z / 2 * (1 - t^2) * du/dz, t = tanh(u).
struct GeluBiasBackward {
  template <typename T>
  C10_HOST_DEVICE T operator()(T grad, T x, T bias) const {
    const T z = x + bias;
    const T z2 = z * z;
    const T t = std::tanh(T(kBeta) * (z + T(kKappa) * z2 * z));
    const T du = T(kBeta) * (T(1) + T(3 * kKappa) * z2);
    return grad * (T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * du);
  }
};

}  // namespace nary_test

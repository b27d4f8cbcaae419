// Scalar arithmetic of the add family, shared by the CPU and CUDA kernels so
// both backends compute exactly the same thing (in opmath_t).
#pragma once

#include <c10/macros/Macros.h>

namespace opforge::add_ops {

struct Add {
  template <typename T>
  C10_HOST_DEVICE T operator()(T a, T b) const {
    return a + b;
  }
};

// relu(a + b); NaN propagates (NaN < 0 is false), as torch.relu does.
struct AddRelu {
  template <typename T>
  C10_HOST_DEVICE T operator()(T a, T b) const {
    const T z = a + b;
    return z < T(0) ? T(0) : z;
  }
};

// torch's threshold_backward(grad, result, 0): the gradient flows where the
// output was positive (or NaN), and is zero where it was clamped.
struct ReluBackward {
  template <typename T>
  C10_HOST_DEVICE T operator()(T grad, T result) const {
    return result <= T(0) ? T(0) : grad;
  }
};

}  // namespace opforge::add_ops

// The fusable activations through torch's own functions (host code, any
// device): in place after an engine that cannot fuse them, and their
// derivatives as torch's backward functions compute them. Kernels that fuse
// an activation use activation.h instead.
#pragma once

#include <ATen/Functions.h>

#include "activation.h"

namespace opforge {

// ATen's CUDA hardswish multiplies by a float 1/6 (3e-8 relative error): float64 keeps its
// precision through the composite, extra passes on a dtype that is not a fast path.
inline bool hardswish_needs_composite(const at::Tensor& t) { return t.scalar_type() == at::kDouble && t.is_cuda(); }

// act(t) in place.
inline void activation_inplace_aten(at::Tensor& t, Activation act) {
  switch (act) {
    case Activation::Relu:
      t.relu_();
      break;
    case Activation::Relu6:
      at::hardtanh_(t, 0, 6);
      break;
    case Activation::Hardswish:
      if (hardswish_needs_composite(t)) {
        t.mul_(at::clamp(at::add(t, 3), 0, 6)).div_(6);
      } else {
        at::hardswish_(t);
      }
      break;
    case Activation::Silu:
      at::silu_(t);
      break;
    default:
      break;
  }
}

// act(z) as a new tensor, z kept (what the backward of hardswish and silu reads).
inline at::Tensor activation_aten(const at::Tensor& z, Activation act) {
  if (act == Activation::Silu) return at::silu(z);
  if (act == Activation::Hardswish && !hardswish_needs_composite(z)) return at::hardswish(z);
  at::Tensor out = z.clone();
  activation_inplace_aten(out, act);
  return out;
}

// grad * act'(z), read from `saved`: the output for relu and relu6
// (0 < y (< 6) exactly where 0 < z (< 6)), the pre-activation z for
// hardswish and silu (derivative_from_output says which).
inline at::Tensor activation_backward(const at::Tensor& grad, Activation act, const at::Tensor& saved) {
  switch (act) {
    case Activation::Relu:
      return at::threshold_backward(grad, saved, 0);
    case Activation::Relu6:
      return at::hardtanh_backward(grad, saved, 0, 6);
    case Activation::Hardswish:
      return at::hardswish_backward(grad, saved);
    case Activation::Silu:
      return at::silu_backward(grad, saved);
    default:
      return grad;
  }
}

}  // namespace opforge

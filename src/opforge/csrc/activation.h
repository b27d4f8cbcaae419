// The activations an op may fuse into its epilogue, computed as torch defines
// them (torch.nn.functional.relu, relu6, hardswish, silu) in the kernel's
// opmath type, NaN propagating as in torch. Host and device code both include
// this header: messages stream strings only (opforge/checks.h).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace opforge {

enum class Activation : int8_t { None = 0, Relu, Relu6, Hardswish, Silu };

// The schema's `str? activation` as an Activation; ValueError naming the
// accepted names otherwise.
inline Activation parse_activation(const char* op, std::optional<std::string_view> name) {
  if (!name.has_value()) return Activation::None;
  if (*name == "relu") return Activation::Relu;
  if (*name == "relu6") return Activation::Relu6;
  if (*name == "hardswish") return Activation::Hardswish;
  if (*name == "silu") return Activation::Silu;
  TORCH_CHECK_VALUE(false, op, ": activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got '",
                    std::string(*name), "'");
}

// Whether the activation's derivative follows from its output alone (relu,
// relu6: the gradient passes where 0 < y (< 6)); hardswish and silu need the
// pre-activation value instead.
inline bool derivative_from_output(Activation act) { return act == Activation::Relu || act == Activation::Relu6; }

namespace activation_detail {
template <typename T>
C10_HOST_DEVICE inline T exp_of(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return ::expf(v);
  } else {
    return ::exp(v);
  }
}
}  // namespace activation_detail

// act(a). Comparisons are false for NaN, so NaN passes through each branch.
template <typename T>
C10_HOST_DEVICE inline T apply_activation(T a, Activation act) {
  switch (act) {
    case Activation::Relu:
      return a < T(0) ? T(0) : a;
    case Activation::Relu6:
      return a < T(0) ? T(0) : (a > T(6) ? T(6) : a);
    case Activation::Hardswish: {
      // x * relu6(x + 3) / 6, the division as a product with 1/6 (within an ulp; a division is
      // a long instruction sequence on the GPU, run once per output element).
      T r = a + T(3);
      r = r < T(0) ? T(0) : (r > T(6) ? T(6) : r);
      return a * r * (T(1) / T(6));
    }
    case Activation::Silu:
      return a / (T(1) + activation_detail::exp_of(-a));
    default:
      return a;
  }
}

}  // namespace opforge

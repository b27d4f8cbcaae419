// Loops of the conv family, compiled once per ISA by conv_{default,avx2,avx512}.cpp
// (which include cpu_isa_begin.h first); cpu/conv_cpu.cpp picks the ISA at run time.
// The depthwise forward loops are cpu/conv_dw_{nchw,nhwc}_kernels.h; here is
// bias_act, the dense path's epilogue, run on each GEMM result tile while it
// is in cache (bias per row or per column, the activation, one rounding).
#pragma once

#include "cpu/conv_dw_nchw_kernels.h"
#include "cpu/conv_dw_nhwc_kernels.h"
#include "cpu/conv_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace conv_detail {

// dst (rows, cols; row stride dst_stride) = act(src + bias); src is the
// GEMM's contiguous opmath tile. This is the dense path's final write.
template <typename scalar_t>
void bias_act(const void* src_, void* dst_, const void* bias_, int64_t rows, int64_t cols, int64_t dst_stride,
              bool bias_per_row, Activation act) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const auto* src = static_cast<const opmath_t*>(src_);
  auto* dst = static_cast<scalar_t*>(dst_);
  const auto* bias = static_cast<const scalar_t*>(bias_);
  std::vector<opmath_t> bcol;
  if (bias && !bias_per_row) {
    bcol.resize(cols);
    for (int64_t j = 0; j < cols; ++j) bcol[j] = static_cast<opmath_t>(bias[j]);
  }
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, cols));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> tmp(std::is_same_v<scalar_t, opmath_t> ? 0 : L);
    for (int64_t r = begin; r < end; ++r) {
      const opmath_t* in = src + r * cols;
      scalar_t* out = dst + r * dst_stride;
      const opmath_t br = (bias && bias_per_row) ? static_cast<opmath_t>(bias[r]) : opmath_t(0);
      int64_t j = 0;
      for (; j + L <= cols; j += L) {
        V a = V::loadu(in + j);
        if (bias) a = a + (bias_per_row ? V(br) : V::loadu(bcol.data() + j));
        a = act_vec(a, act);
        if constexpr (std::is_same_v<scalar_t, opmath_t>) {
          a.store(out + j);
        } else {
          a.store(tmp.data());
          for (int64_t q = 0; q < L; ++q) out[j + q] = static_cast<scalar_t>(tmp[q]);
        }
      }
      for (; j < cols; ++j) {
        opmath_t a = in[j];
        if (bias) a += bias_per_row ? br : bcol[j];
        out[j] = static_cast<scalar_t>(apply_activation(a, act));
      }
    }
  });
}

}  // namespace conv_detail

void conv_dw_nchw(c10::ScalarType dtype, const conv::DwParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_nchw", [&] { conv_detail::dw_nchw<scalar_t>(p); });
}

void conv_dw_nhwc(c10::ScalarType dtype, const conv::DwParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_nhwc", [&] { conv_detail::dw_nhwc<scalar_t>(p); });
}

void conv_bias_act(c10::ScalarType dtype, const void* src, void* dst, const void* bias, int64_t rows, int64_t cols,
                   int64_t dst_stride, bool bias_per_row, Activation act) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_bias_act", [&] {
    conv_detail::bias_act<scalar_t>(src, dst, bias, rows, cols, dst_stride, bias_per_row, act);
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

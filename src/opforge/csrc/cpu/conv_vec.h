// Vector helpers of the conv family's CPU loops: the fused activations, half
// types loaded and stored in opmath, ReLU-masked gradient loads (the backward
// loops) and the stride-1 taps of a staged row.
// Compiled once per ISA with the loops that include it (after cpu_isa_begin.h).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <vector>

#include <opforge/dispatch.h>

#include "cpu/conv_params.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace conv_detail {

// NaN stays NaN, as in torch.relu. On x86, max(0, a) returns its second
// operand when either is NaN: one instruction instead of compare + blend.
template <typename T>
inline at::vec::Vectorized<T> relu_vec(const at::vec::Vectorized<T>& a) {
  using V = at::vec::Vectorized<T>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) return V(_mm512_max_ps(_mm512_setzero_ps(), a));
  if constexpr (std::is_same_v<T, double>) return V(_mm512_max_pd(_mm512_setzero_pd(), a));
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return V(_mm256_max_ps(_mm256_setzero_ps(), a));
  if constexpr (std::is_same_v<T, double>) return V(_mm256_max_pd(_mm256_setzero_pd(), a));
#endif
  return V::blendv(a, V(T(0)), a < V(T(0)));
}

// act(a) for relu6, hardswish and silu. Out of line: inlined into the
// unrolled row loops, silu's exp raised their register pressure and slowed
// the common cases (no activation, ReLU) by 15-30% at stride 1 in NCHW.
template <typename T>
[[gnu::noinline]] at::vec::Vectorized<T> act_vec_other(at::vec::Vectorized<T> a, Activation act) {
  using V = at::vec::Vectorized<T>;
  switch (act) {
    case Activation::Relu6:
      return at::vec::minimum(relu_vec(a), V(T(6)));
    case Activation::Hardswish:
      return a * at::vec::minimum(relu_vec(a + V(T(3))), V(T(6))) / V(T(6));
    case Activation::Silu:
      return a / (V(T(1)) + a.neg().exp());
    default:
      return a;
  }
}

// act(a) for a vector, as apply_activation (activation.h) for one value.
template <typename T>
inline at::vec::Vectorized<T> act_vec(const at::vec::Vectorized<T>& a, Activation act) {
  if (act == Activation::None) return a;
  if (act == Activation::Relu) return relu_vec(a);
  return act_vec_other(a, act);
}

// One vector of opmath values from / to scalar_t memory. The counted forms
// touch only the first n elements (the other lanes load as 0); on AVX-512 they
// are masked accesses, elsewhere they go through a small buffer.
template <typename scalar_t>
struct VecIo {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  static constexpr int L = V::size();
  static constexpr bool kSame = std::is_same_v<scalar_t, opmath_t>;
  static constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;

  static inline V load(const scalar_t* p) {
    if constexpr (kSame) {
      return V::loadu(p);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      __m512 o;
      if constexpr (kBf16)
        at::vec::cvtbf16_fp32(h, o);
      else
        at::vec::cvtfp16_fp32(h, o);
      return V(o);
#elif defined(CPU_CAPABILITY_AVX2)
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      __m256 o;
      if constexpr (kBf16)
        at::vec::cvtbf16_fp32(h, o);
      else
        at::vec::cvtfp16_fp32(h, o);
      return V(o);
#else
      return load(p, L);
#endif
    }
  }

  static inline V load(const scalar_t* p, int n) {
    if constexpr (kSame) {
      return V::loadu(p, n);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p);
      __m512 o;
      if constexpr (kBf16)
        at::vec::cvtbf16_fp32(h, o);
      else
        at::vec::cvtfp16_fp32(h, o);
      return V(o);
#else
      opmath_t buf[L] = {};
      for (int i = 0; i < n; ++i) buf[i] = static_cast<opmath_t>(p[i]);
      return V::loadu(buf);
#endif
    }
  }

  static inline void store(scalar_t* p, const V& v) {
    if constexpr (kSame) {
      v.store(p);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      const __m256i h = kBf16 ? at::vec::cvtfp32_bf16(__m512(v)) : at::vec::cvtfp32_fp16(__m512(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
#elif defined(CPU_CAPABILITY_AVX2)
      const __m128i h = kBf16 ? at::vec::cvtfp32_bf16(__m256(v)) : at::vec::cvtfp32_fp16(__m256(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
#else
      store(p, v, L);
#endif
    }
  }

  static inline void store(scalar_t* p, const V& v, int n) {
    if constexpr (kSame) {
      v.store(p, n);
    } else {
#if defined(CPU_CAPABILITY_AVX512)
      const __m256i h = kBf16 ? at::vec::cvtfp32_bf16(__m512(v)) : at::vec::cvtfp32_fp16(__m512(v));
      _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u), h);
#else
      opmath_t buf[L];
      v.store(buf);
      for (int i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(buf[i]);
#endif
    }
  }
};

// A vector of p's values where the ReLU passed the gradient (mask > 0, or
// NaN: relu's backward zeroes only where its result is <= 0), else 0; the
// counted form reads n values. mask null: p's values.
template <typename scalar_t>
inline at::vec::Vectorized<at::opmath_type<scalar_t>> load_passed(const scalar_t* p, const scalar_t* mask) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  const V v = IO::load(p);
  return mask ? V::blendv(v, V(0), IO::load(mask) <= V(0)) : v;
}

template <typename scalar_t>
inline at::vec::Vectorized<at::opmath_type<scalar_t>> load_passed(const scalar_t* p, const scalar_t* mask, int n) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  const V v = IO::load(p, n);
  return mask ? V::blendv(v, V(0), IO::load(mask, n) <= V(0)) : v;
}

// DwBackwardParams' pointers as scalar_t.
template <typename scalar_t>
struct BackwardPtrs {
  const scalar_t *g, *mask, *x, *w;
  scalar_t *gx, *gw, *gb;
  explicit BackwardPtrs(const conv::DwBackwardParams& p)
      : g(static_cast<const scalar_t*>(p.g)),
        mask(static_cast<const scalar_t*>(p.mask)),
        x(static_cast<const scalar_t*>(p.x)),
        w(static_cast<const scalar_t*>(p.w)),
        gx(static_cast<scalar_t*>(p.gx)),
        gw(static_cast<scalar_t*>(p.gw)),
        gb(static_cast<scalar_t*>(p.gb)) {}
};

// Stride-1 taps of one staged row at column ow: x0 = R[ow..], x1 = R[ow+1..],
// x2 = R[ow+2..]. With AVX-512 the rows are 64-byte aligned and the shifted
// vectors are built from two aligned loads with valign (two unaligned loads
// would each cross a cache line, and the loads, not the FMAs, would bound the
// loop); elsewhere they are three unaligned loads.
template <typename T>
inline void taps3(const T* R, at::vec::Vectorized<T>& x0, at::vec::Vectorized<T>& x1, at::vec::Vectorized<T>& x2) {
  using V = at::vec::Vectorized<T>;
#if defined(CPU_CAPABILITY_AVX512)
  x0 = V::loadu(R);
  const V xn = V::loadu(R + V::size());
  if constexpr (std::is_same_v<T, float>) {
    const __m512i a = _mm512_castps_si512(x0), b = _mm512_castps_si512(xn);
    x1 = V(_mm512_castsi512_ps(_mm512_alignr_epi32(b, a, 1)));
    x2 = V(_mm512_castsi512_ps(_mm512_alignr_epi32(b, a, 2)));
  } else {
    const __m512i a = _mm512_castpd_si512(x0), b = _mm512_castpd_si512(xn);
    x1 = V(_mm512_castsi512_pd(_mm512_alignr_epi64(b, a, 1)));
    x2 = V(_mm512_castsi512_pd(_mm512_alignr_epi64(b, a, 2)));
  }
#else
  x0 = V::loadu(R);
  x1 = V::loadu(R + 1);
  x2 = V::loadu(R + 2);
#endif
}

}  // namespace conv_detail
}  // namespace opforge::cpu::CPU_CAPABILITY

// Vector helpers of the softmax family's CPU loops: half types to and from
// opmath (ChunkIO's order), the exps (finite-input and NaN-safe forms), and
// the max / exp-and-sum passes over a row.
// Compiled once per ISA with cpu/softmax_kernels.h, which includes it (after cpu_isa_begin.h).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <opforge/cpu_loops.h>
#include <opforge/dispatch.h>

#include "softmax.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace {

namespace sm = ::opforge::softmax;
using at::vec::Vectorized;

template <typename T>
using Acc = at::opmath_type<T>;

template <typename T>
constexpr bool kNeedsConvert = !std::is_same_v<T, Acc<T>>;

// n values of T -> opmath.
template <typename T>
inline void to_acc(const T* src, Acc<T>* dst, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    using OVec = typename IO::OVec;
    constexpr int64_t W = IO::kWidth;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const auto p = IO::load(src + i);
      p.v[0].store(dst + i);
      p.v[1].store(dst + i + OVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<Acc<T>>(src[i]);
  } else {
    std::copy(src, src + n, dst);
  }
}

// n opmath values -> T, rounded once.
template <typename T>
inline void from_acc(const Acc<T>* src, T* dst, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using OVec = Vectorized<float>;
    constexpr int64_t W = Vectorized<T>::size();
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      at::vec::convert_from_float<T>(OVec::loadu(src + i), OVec::loadu(src + i + OVec::size())).store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  } else {
    std::copy(src, src + n, dst);
  }
}

// The half types' rows in chunks of Vectorized<T>::size() values, as two
// float vectors each, in an order of the kernels' own where that saves
// instructions: on AVX2, a bfloat16 chunk of 16 values loads as values 0-3
// and 8-11 in the first vector, 4-7 and 12-15 in the second (one unpack
// with zeros each, no moves across 128-bit lanes), and store() packs such a
// pair back in the original order. Loads serve the passes that do not see
// the order: reductions, and elementwise work whose results go back through
// store() chunk by chunk (at once, or from a scratch row); elsewhere the
// order is the original one. kFinite: the values are
// known not to be NaN (bfloat16 on AVX2 then skips the NaN test of every
// lane that at::vec's conversion makes).
template <typename T>
struct ChunkIO {
  using V = Vectorized<float>;
  using Pack = typename VecIO<T>::Pack;
  static constexpr int64_t kWidth = Vectorized<T>::size();

  static Pack load(const T* p) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i z = _mm256_setzero_si256();
      Pack out;
      out.v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
      out.v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
      return out;
    }
    if constexpr (std::is_same_v<T, c10::Half>) {
      // Two 128-bit loads instead of one 256-bit load split in two.
      Pack out;
      out.v[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      out.v[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
      return out;
    }
#endif
    return VecIO<T>::load(p);
  }

  template <bool kFinite>
  static void store(T* p, const V& a, const V& b) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      auto round = [](__m256 v) {
        const __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        if constexpr (!kFinite) {
          r = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
        }
        return r;
      };
      // packus takes 128-bit lanes in turn: lane 0 gets values 0-3, 4-7.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(round(a), round(b)));
      return;
    }
    if constexpr (std::is_same_v<T, c10::Half>) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(b, _MM_FROUND_TO_NEAREST_INT));
      return;
    }
#endif
    at::vec::convert_from_float<T>(a, b).store(p);
  }
};

template <typename A>
inline Vectorized<A> vexp(const Vectorized<A>& v) {
  if constexpr (std::is_same_v<A, float>) {
    // exp_u20 maps NaN to +inf; keep NaN so it propagates as in torch.
    return Vectorized<A>::blendv(v.exp_u20(), v, v != v);
  } else {
    return v.exp();
  }
}

// max that propagates NaN, as torch's reductions do.
template <typename A>
inline A max_nan(A a, A b) {
  return (std::isnan(a) || a > b) ? a : b;
}

template <typename A>
inline A row_max(const A* src, int64_t n) {
  using V = Vectorized<A>;
  return at::vec::reduce_all<A>([](V& a, V& b) { return at::vec::maximum(a, b); }, src, n);
}

// Half types: converts n values of src into dst (float, in ChunkIO's
// order) and returns their max, in one pass.
template <typename T>
inline float to_acc_max(const T* src, float* dst, int64_t n) {
  using V = Vectorized<float>;
  constexpr int64_t W = ChunkIO<T>::kWidth;
  V mx(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto p = ChunkIO<T>::load(src + i);
    p.v[0].store(dst + i);
    p.v[1].store(dst + i + V::size());
    mx = at::vec::maximum(mx, at::vec::maximum(p.v[0], p.v[1]));
  }
  float m = at::vec::vec_reduce_all<float>([](V& a, V& b) { return at::vec::maximum(a, b); }, mx);
  for (; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
    m = max_nan(m, dst[i]);
  }
  return m;
}

// Half types: log_softmax's outputs dst = T((src - m) - l), converted and
// stored in the same pass; src as to_acc_max wrote it. kFinite: m is
// finite, so src holds no NaN (and l = log of a sum >= 1 is finite).
template <typename T, bool kFinite>
inline void log_softmax_from_acc(const float* src, T* dst, int64_t n, float m, float l) {
  using V = Vectorized<float>;
  constexpr int64_t W = ChunkIO<T>::kWidth;
  const V vm(m), vl(l);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    ChunkIO<T>::template store<kFinite>(dst + i, (V::loadu(src + i) - vm) - vl,
                                        (V::loadu(src + i + V::size()) - vm) - vl);
  }
  for (; i < n; ++i) dst[i] = static_cast<T>((src[i] - m) - l);
}

#if defined(CPU_CAPABILITY_AVX2)
// AVX2 pieces of the exps below. horner: the polynomial with coefficients
// c, highest degree first, at x. ldexp_or_zero: p * 2^k for integral k (a
// float vector) by an add to p's exponent field, and 0 in the lanes where
// keep is false (where that add would leave the normal floats, or k is
// -inf: it converts to INT_MIN, which the shift makes 0).
template <size_t N>
inline __m256 horner(__m256 x, const float (&c)[N]) {
  __m256 p = _mm256_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm256_fmadd_ps(x, p, _mm256_set1_ps(c[i]));
  return p;
}

inline __m256 ldexp_or_zero(__m256 p, __m256 k, __m256 keep) {
  const __m256i e = _mm256_slli_epi32(_mm256_cvttps_epi32(k), 23);
  return _mm256_and_ps(_mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)), keep);
}
#endif

// exp(v) for v in [-inf, 0], never NaN: exp(x - max) over a row whose max
// is finite. AVX-512 float: 2^k p(r) with k = round(v log2 e), r = v - k ln2
// (ln2 in two parts, so r is exact), p the degree-5 polynomial exp_u20 uses,
// and 2^k applied by vscalefps (which underflows to denormals and 0 as exp
// does): 11 instructions against exp_u20's 19 plus vexp's NaN blend, on a
// CPU path that is bound by this arithmetic (the float forward ran about as
// fast with its input in cache as from memory). AVX2 float: see below.
// Elsewhere: vexp.
template <typename A>
inline Vectorized<A> exp_nonpos(const Vectorized<A>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    const __m512 x = _mm512_max_ps(v, _mm512_set1_ps(-104.f));  // exp(-104) rounds to 0, as exp(-inf)
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    // The same 2^k p(r), with 2^k added into p's exponent field: kept
    // normal for k >= -125, and below that (exp(v) < 2^-125.5) the result
    // is 0, as exp_u20 flushes its results below 2^-126 (vscalefps does not
    // exist here). 15 instructions against exp_u20's 19 plus the NaN blend.
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    static constexpr float kPoly[] = {0.00828929059f, 0.0418978221f, 0.166676521f, 0.499991506f, 0.999999701f, 1.f};
    // v = -inf: p is NaN and k = -inf; the mask zeroes that lane.
    return ldexp_or_zero(horner(r, kPoly), k, _mm256_cmp_ps(k, _mm256_set1_ps(-125.f), _CMP_GE_OQ));
  }
#endif
  return vexp(v);
}

#if defined(CPU_CAPABILITY_AVX2)
// AVX2, for results that end up in a half type: 2^t for t <= 0 (exp(v) for
// t = v log2 e), never NaN, as 2^k p(f) with k = floor(t), f in [0, 1) and
// p a polynomial for 2^f: degree 4 for bfloat16 (relative error 2.6e-6,
// against its rounding of 2^-9), degree 5 for float16 (9e-8, against
// 2^-12), so that about as many outputs round correctly as with exp_u20
// (float16) or more than with fexp_u20's cubic (bfloat16: 99.96% against
// 99.0%). 2^k goes into the exponent field by an integer add; results
// below 2^-126 are 0, as fexp_u20's. With t taken by one FMA from x and the
// scaled max (exp_shifted), 11-12 instructions against exp_u20's 19
// (fexp_u20's 16) plus the subtraction and the NaN blend.
template <typename T>
inline Vectorized<float> exp2_nonpos_half(__m256 t) {
  const __m256 k = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, k);
  static constexpr float kBF16[] = {0.013534137f, 0.052011490f, 0.24144277f, 0.69300383f, 1.0000026f};
  static constexpr float kF16[] = {0.0018775743f, 0.0089893453f, 0.055826314f, 0.24015361f, 0.69315308f, 1.f};
  __m256 p;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    p = horner(f, kBF16);
  } else {
    p = horner(f, kF16);
  }
  return ldexp_or_zero(p, k, _mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_GE_OQ));
}
#endif

// The exp of the element pass, for values whose results end up in T.
// kFinite: v = x - max over a row with a finite max, so in [-inf, 0] and
// never NaN: exp_nonpos (its fast form on AVX-512). bfloat16 otherwise (and
// in the portable build) takes at::vec's cheaper cubic exp: it keeps 8
// significant bits, and the cubic's relative error is far below that
// rounding. Every other case: vexp. (On AVX2 the half types' rows with a
// finite max take exp_shifted's own exp instead.)
template <typename T, bool kFinite>
inline Vectorized<Acc<T>> exp_for(const Vectorized<Acc<T>>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr bool kCubic = std::is_same_v<T, c10::BFloat16> && !kFinite;
#else
  constexpr bool kCubic = std::is_same_v<T, c10::BFloat16>;
#endif
  if constexpr (kCubic) {
    return Vectorized<float>::blendv(v.fexp_u20(), v, v != v);  // keep NaN
  } else if constexpr (kFinite) {
    return exp_nonpos(v);
  } else {
    return vexp(v);
  }
}

// exp(x - m) for the half types' element passes: exp_for, or on AVX2 with
// a finite m, exp2_nonpos_half(x log2 e - mk) with mk = m log2 e (ShiftedMax):
// mk's rounding shifts every exp of the row by the same factor, which the
// division by their sum cancels.
struct ShiftedMax {
  Vectorized<float> m, mk;
  explicit ShiftedMax(float max = 0.f) : m(max), mk(max * 1.44269504088896341f) {}
};

template <typename T, bool kFinite>
inline Vectorized<float> exp_shifted(const Vectorized<float>& x, const ShiftedMax& s) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kFinite) return exp2_nonpos_half<T>(_mm256_fmsub_ps(x, _mm256_set1_ps(1.44269504088896341f), s.mk));
#endif
  return exp_for<T, kFinite>(x - s.m);
}

// sum(exp(src - m)), also storing dst[i] = exp(src[i] - m) when kStore
// (dst may alias src); m is the max of src (NaN if src has one). Summed in
// blocks of 1024 values (two accumulators each), then the block sums: long
// rows lose far less to rounding than with one running sum. A finite m
// means src holds no NaN and no +inf: exp_nonpos. With kNext, the max of
// the n values at nx goes to *nmax, taken in the same loop.
template <bool kStore, bool kFinite, bool kNext = false, typename A>
inline A exp_sum_pass(const A* src, A* dst, int64_t n, A m, const A* nx = nullptr, A* nmax = nullptr) {
  using V = Vectorized<A>;
  V n0(-std::numeric_limits<A>::infinity()), n1 = n0;
  auto ex = [](const V& v) { return exp_for<A, kFinite>(v); };
  constexpr int64_t W = V::size();
  const V vm(m);
  V acc(0);
  int64_t i = 0;
  while (i + W <= n) {
    const int64_t end = std::min<int64_t>(n, i + 1024);
    V a0(0), a1(0);
    for (; i + 2 * W <= end; i += 2 * W) {
      if constexpr (kNext) {
        n0 = at::vec::maximum(n0, V::loadu(nx + i));
        n1 = at::vec::maximum(n1, V::loadu(nx + i + W));
      }
      const V e0 = ex(V::loadu(src + i) - vm);
      const V e1 = ex(V::loadu(src + i + W) - vm);
      if constexpr (kStore) {
        e0.store(dst + i);
        e1.store(dst + i + W);
      }
      a0 = a0 + e0;
      a1 = a1 + e1;
    }
    for (; i + W <= end; i += W) {
      if constexpr (kNext) n0 = at::vec::maximum(n0, V::loadu(nx + i));
      const V e = ex(V::loadu(src + i) - vm);
      if constexpr (kStore) e.store(dst + i);
      a0 = a0 + e;
    }
    acc = acc + (a0 + a1);
  }
  if (i < n) {
    const int64_t r = n - i;
    const V e = ex(V::loadu(src + i, r) - vm);
    if constexpr (kStore) e.store(dst + i, r);
    acc = acc + V::set(V(0), e, r);  // lanes past the row stay 0
  }
  if constexpr (kNext) {
    n0 = at::vec::maximum(n0, n1);
    A mx = at::vec::vec_reduce_all<A>([](V& u, V& w) { return at::vec::maximum(u, w); }, n0);
    for (int64_t j = n / W * W; j < n; ++j) mx = max_nan(mx, nx[j]);
    *nmax = mx;
  }
  return at::vec::vec_reduce_all<A>([](V& u, V& w) { return u + w; }, acc);
}

template <bool kStore, bool kNext = false, typename A>
inline A exp_sum_blocked(const A* src, A* dst, int64_t n, A m, const A* nx = nullptr, A* nmax = nullptr) {
  return std::isfinite(m) ? exp_sum_pass<kStore, true, kNext>(src, dst, n, m, nx, nmax)
                          : exp_sum_pass<kStore, false, kNext>(src, dst, n, m, nx, nmax);
}

// exp_and_sum of src, and the max of the n values at nx (the next row),
// taken in the same loop: that row's loads from memory overlap this row's
// exp arithmetic.
template <typename A>
inline A exp_and_sum_next_max(const A* src, A* dst, int64_t n, A m, const A* nx, A* nmax) {
  return exp_sum_blocked<true, true>(src, dst, n, m, nx, nmax);
}

// dst[i] = exp(src[i] - m); returns the sum. dst may alias src.
template <typename A>
inline A exp_and_sum(const A* src, A* dst, int64_t n, A m) {
  return exp_sum_blocked<true>(src, dst, n, m);
}

// sum(exp(src - m)) without storing.
template <typename A>
inline A sum_exp(const A* src, int64_t n, A m) {
  return exp_sum_blocked<false>(src, static_cast<A*>(nullptr), n, m);
}

}  // namespace
}  // namespace opforge::cpu::CPU_CAPABILITY

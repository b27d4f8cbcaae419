// CPU loops of the softmax family, compiled once per ISA by
// softmax_{default,avx2,avx512}.cpp (which include cpu_isa_begin.h first);
// cpu/softmax_cpu.cpp checks the arguments and picks the ISA.
//
// Inner-most dim (inner == 1): parallel over rows; each row is read once
// from memory (max, then exp written to the output -- or to a float scratch
// row for the half types -- while summing, then one scaling pass over the
// cache-resident row). Outer dims (inner > 1): parallel over (outer, block of
// inner columns); each pass walks K with the inner columns vectorised, so no
// transpose copy is made. Arithmetic in opmath (float for the half types),
// results rounded once.
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

// ------------------------------------------------------------------ forward, inner-most dim

// y[0, n) = T(buf * mul), rounded once. kChunks: buf holds a half type's
// row written chunk by chunk in ChunkIO's order (the values past the last
// whole chunk in the original one); kFinite: buf holds no NaN.
template <typename T, bool kChunks = false, bool kFinite = false>
inline void scale_out(const Acc<T>* buf, T* y, int64_t n, Acc<T> mul) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = Vectorized<T>::size();
  const V vm(mul);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    if constexpr (kChunks) {
      ChunkIO<T>::template store<kFinite>(y + i, V::loadu(buf + i) * vm, V::loadu(buf + i + V::size()) * vm);
    } else if constexpr (kNeedsConvert<T>) {
      at::vec::convert_from_float<T>(V::loadu(buf + i) * vm, V::loadu(buf + i + V::size()) * vm).store(y + i);
    } else {
      (V::loadu(buf + i) * vm).store(y + i);
    }
  }
  for (; i < n; ++i) y[i] = static_cast<T>(buf[i] * mul);
}

// max of n values of T, computed in opmath (NaN propagates).
template <typename T>
inline Acc<T> in_max(const T* x, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    using V = Vectorized<float>;
    constexpr int64_t W = IO::kWidth;
    V m0(-std::numeric_limits<float>::infinity()), m1 = m0;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const auto p = ChunkIO<T>::load(x + i);
      m0 = at::vec::maximum(m0, p.v[0]);
      m1 = at::vec::maximum(m1, p.v[1]);
    }
    m0 = at::vec::maximum(m0, m1);
    float m = at::vec::vec_reduce_all<float>([](V& u, V& w) { return at::vec::maximum(u, w); }, m0);
    for (; i < n; ++i) m = max_nan(m, static_cast<float>(x[i]));
    return m;
  } else {
    return row_max(x, n);
  }
}

// Half types: the last n < 2 * V::size() values of a row, buf[0, n) =
// exp(x - m) by the same exp as the rest of the row; returns their sum.
template <typename T, bool kFinite>
inline float tail_exp_sum(const T* x, float* buf, int64_t n, const ShiftedMax& sm) {
  using V = Vectorized<float>;
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(x[j]);
  V acc(0);
  for (int64_t j = 0; j < n; j += V::size()) {
    const int64_t c = std::min<int64_t>(V::size(), n - j);
    const V e = exp_shifted<T, kFinite>(V::loadu(buf + j, c), sm);
    e.store(buf + j, c);
    acc = acc + V::set(V(0), e, c);  // lanes past the row stay 0
  }
  return at::vec::vec_reduce_all<float>([](V& u, V& w) { return u + w; }, acc);
}

// Half types: buf = exp(x - m) in float; returns the sum. A finite m
// means x holds no NaN and no +inf (exp_for's kFinite).
template <typename T, bool kFinite>
inline float in_exp_sum_pass(const T* x, float* buf, int64_t n, float m) {
  using IO = VecIO<T>;
  using V = Vectorized<float>;
  constexpr int64_t W = IO::kWidth;
  const ShiftedMax sm(m);
  V acc0(0), acc1(0);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto p = ChunkIO<T>::load(x + i);
    const V e0 = exp_shifted<T, kFinite>(p.v[0], sm);
    const V e1 = exp_shifted<T, kFinite>(p.v[1], sm);
    e0.store(buf + i);
    e1.store(buf + i + V::size());
    acc0 = acc0 + e0;
    acc1 = acc1 + e1;
  }
  acc0 = acc0 + acc1;
  float s = at::vec::vec_reduce_all<float>([](V& u, V& w) { return u + w; }, acc0);
  if (i < n) s += tail_exp_sum<T, kFinite>(x + i, buf + i, n - i, sm);
  return s;
}

// buf = exp(x - m) in opmath; returns the sum.
template <typename T>
inline Acc<T> in_exp_sum(const T* x, Acc<T>* buf, int64_t n, Acc<T> m) {
  if constexpr (kNeedsConvert<T>) {
    return std::isfinite(m) ? in_exp_sum_pass<T, true>(x, buf, n, m) : in_exp_sum_pass<T, false>(x, buf, n, m);
  } else {
    return exp_and_sum(x, buf, n, m);
  }
}

// Short rows (K <= kShortK): kRows rows at once, so the latency chain of
// each row (max, its horizontal reduction, exp, the sum's reduction, the
// reciprocal) overlaps with the others'. x and y point at kRows consecutive
// rows; buf holds kRows * K opmath values (half types only). Used for the
// half types: for float32 it measured no faster than row by row, and at
// times slower.
constexpr int64_t kShortK = 1024;
constexpr int kRows = 4;

template <typename T>
inline void softmax_short_rows(const T* x, T* y, int64_t K, Acc<T>* buf) {
  static_assert(kNeedsConvert<T>, "half types only");
  using A = Acc<T>;
  using IO = VecIO<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  V mx[kRows], acc[kRows];
  for (int r = 0; r < kRows; ++r) mx[r] = V(-std::numeric_limits<A>::infinity());
  int64_t i = 0;
  for (; i + W <= K; i += W) {
    for (int r = 0; r < kRows; ++r) {
      const auto p = ChunkIO<T>::load(x + r * K + i);
      for (int k = 0; k < P; ++k) mx[r] = at::vec::maximum(mx[r], p.v[k]);
    }
  }
  const int64_t body = i;
  A m[kRows], s[kRows];
  ShiftedMax sm[kRows];
  for (int r = 0; r < kRows; ++r) {
    m[r] = at::vec::vec_reduce_all<A>([](V& u, V& w) { return at::vec::maximum(u, w); }, mx[r]);
    for (int64_t j = body; j < K; ++j) m[r] = max_nan(m[r], static_cast<A>(x[r * K + j]));
    sm[r] = ShiftedMax(m[r]);
    acc[r] = V(0);
  }
  // Every max finite: no NaN or +inf in the rows (exp_for's kFinite).
  auto exp_rows = [&](auto finite) {
    constexpr bool kFinite = decltype(finite)::value;
    for (i = 0; i < body; i += W) {
      for (int r = 0; r < kRows; ++r) {
        const auto p = ChunkIO<T>::load(x + r * K + i);
        for (int k = 0; k < P; ++k) {
          const V e = exp_shifted<T, kFinite>(p.v[k], sm[r]);
          e.store(buf + r * K + i + k * V::size());
          acc[r] = acc[r] + e;
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      s[r] = at::vec::vec_reduce_all<A>([](V& u, V& w) { return u + w; }, acc[r]);
      if (body < K) s[r] += tail_exp_sum<T, kFinite>(x + r * K + body, buf + r * K + body, K - body, sm[r]);
    }
    for (int r = 0; r < kRows; ++r) scale_out<T, true, kFinite>(buf + r * K, y + r * K, K, A(1) / s[r]);
  };
  if (std::all_of(m, m + kRows, [](A v) { return std::isfinite(v); })) {
    exp_rows(std::true_type{});
  } else {
    exp_rows(std::false_type{});
  }
}

// dst = src * mul with streaming (non-temporal) stores where the ISA has
// them: the output skips the caches, so writing it costs one pass over
// memory instead of two (a normal store first reads the line it fills).
// Callers issue a store fence (stream_fence) before the data is used.
template <typename A>
inline void scale_stream(const A* src, A* dst, int64_t n, A mul) {
  using V = Vectorized<A>;
  const V vm(mul);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    // Regular stores up to the first 64-byte boundary, then whole aligned vectors.
    const int64_t head = std::min<int64_t>(n, ((64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64) / sizeof(A));
    if (reinterpret_cast<std::uintptr_t>(dst) % sizeof(A) == 0) {
      for (; i < head; ++i) dst[i] = src[i] * mul;
      for (; i + V::size() <= n; i += V::size()) {
#if defined(CPU_CAPABILITY_AVX512)
        _mm512_stream_ps(dst + i, V::loadu(src + i) * vm);
#else
        _mm256_stream_ps(dst + i, V::loadu(src + i) * vm);
#endif
      }
    }
  }
#endif
  at::vec::map([vm](V v) { return v * vm; }, dst + i, src + i, n - i);
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// scaled_masked_softmax: buf[j] = -inf where the bool mask is set. AVX2
// float: eight mask bytes widened to a lane mask and blended (the
// element-by-element select took as long as the rest of the row).
template <typename A>
inline void mask_out(const bool* mk, A* buf, int64_t n) {
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(mk);  // a bool is one byte, 0 or 1
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    const __m256 ninf = _mm256_set1_ps(kNegInf);
    for (; j + 8 <= n; j += 8) {
      int64_t bytes;
      std::memcpy(&bytes, m8 + j, 8);
      const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
      const __m256 set = _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()));
      _mm256_storeu_ps(buf + j, _mm256_blendv_ps(_mm256_loadu_ps(buf + j), ninf, set));
    }
  }
#endif
  for (; j < n; ++j) buf[j] = m8[j] ? kNegInf : buf[j];
}

// scaled_masked_softmax: buf += an additive mask of T (converted a vector at
// a time for the half types).
template <typename T>
inline void add_mask(const T* mk, Acc<T>* buf, int64_t n) {
  using V = Vectorized<Acc<T>>;
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    constexpr int64_t W = IO::kWidth;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const auto p = IO::load(mk + j);
      (V::loadu(buf + j) + p.v[0]).store(buf + j);
      (V::loadu(buf + j + V::size()) + p.v[1]).store(buf + j + V::size());
    }
    for (; j < n; ++j) buf[j] += static_cast<float>(mk[j]);
  } else {
    at::vec::map2([](V u, V w) { return u + w; }, buf, buf, mk, n);
  }
}

// Rows [r0, r1) of softmax / scaled_masked_softmax. float: exp(x - max) is
// written to y and scaled in place while the row is in cache. Half types and
// masked rows: buf (K opmath values, cache-line aligned) holds exp(x - max),
// then y is written from it in one pass. Short half-type rows go kRows at a
// time (softmax_short_rows; buf then holds kRows * K values).
template <typename T>
void fwd_rows_range(const sm::FwdArgs& a, int64_t r0, int64_t r1, Acc<T>* buf, bool stream) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool masked_mode = a.mode == sm::Mode::ScaledMasked;
  bool next_max_ready = false;
  A next_max = A(0);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = in + r * K;
    T* y = out + r * K;
    if (masked_mode) {
      // buf[0, valid) = x * scale + mask (-inf where masked); the keys
      // above the diagonal are skipped and come out as 0.
      const int64_t valid = a.causal ? std::min<int64_t>(K, r % a.Lq + 1) : K;
      to_acc(x, buf, valid);
      const V vs(static_cast<A>(a.scale));
      at::vec::map([vs](V v) { return v * vs; }, buf, buf, valid);
      if (a.mask != nullptr) {
        const int64_t moff = a.mask_rows(r);
        if (a.mask_is_bool) {
          mask_out(static_cast<const bool*>(a.mask) + moff, buf, valid);
        } else {
          add_mask(static_cast<const T*>(a.mask) + moff, buf, valid);
        }
      }
      const A m = row_max(buf, valid);
      if (m == -std::numeric_limits<A>::infinity()) {
        // Every key masked out: zeros (documented), not NaN.
        std::fill(buf, buf + K, A(0));
        scale_out<T>(buf, y, K, A(0));
        continue;
      }
      const A s = exp_and_sum(buf, buf, valid, m);
      std::fill(buf + valid, buf + K, A(0));
      scale_out<T>(buf, y, K, A(1) / s);
    } else {
      if constexpr (kNeedsConvert<T>) {
        if (K <= kShortK && r + kRows <= r1) {
          softmax_short_rows(x, y, K, buf);
          r += kRows - 1;
          continue;
        }
      }
      if constexpr (kNeedsConvert<T>) {
        const A m = in_max(x, K);
        const A s = in_exp_sum(x, buf, K, m);
        if (std::isfinite(m)) {
          scale_out<T, true, true>(buf, y, K, A(1) / s);  // a finite max: no NaN
        } else {
          scale_out<T, true>(buf, y, K, A(1) / s);
        }
      } else {
        // float: row r + 1's max is taken in row r's exp pass. With
        // stream (buf set), exp goes to buf and y is written once, by
        // streaming stores.
        const A m = next_max_ready ? next_max : in_max(x, K);
        next_max_ready = r + 1 < r1;
        A* e = stream ? buf : y;
        const A s = next_max_ready ? exp_and_sum_next_max(x, e, K, m, x + K, &next_max) : exp_and_sum(x, e, K, m);
        if (stream) {
          scale_stream(buf, y, K, A(1) / s);
        } else {
          const V inv(A(1) / s);
          at::vec::map([inv](V v) { return v * inv; }, y, y, K);
        }
      }
    }
  }
}

template <typename T>
void fwd_rows_log(const sm::FwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    std::vector<A> scratch(kNeedsConvert<T> ? K : 0);
    A* buf = scratch.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = in + r * K;
      T* y = out + r * K;
      // (x - m) - log(sum), not x - (m + log(sum)): m + log(sum) would
      // round at m's magnitude (logits offset by thousands).
      if constexpr (kNeedsConvert<T>) {
        const A m = to_acc_max(x, buf, K);
        const A l = std::log(sum_exp(buf, K, m));
        if (std::isfinite(m)) {
          log_softmax_from_acc<T, true>(buf, y, K, m, l);
        } else {
          log_softmax_from_acc<T, false>(buf, y, K, m, l);
        }
      } else {
        const A m = row_max(x, K);
        const V vm(m), vl(std::log(sum_exp(x, K, m)));
        at::vec::map([vm, vl](V v) { return (v - vm) - vl; }, y, x, K);
      }
    }
  });
}

// The last-level cache one core sees (Linux sysfs; 32 MiB where unknown).
inline int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t v = 0;
    if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      long kib = 0;
      if (std::fscanf(f, "%ldK", &kib) == 1) v = int64_t{kib} << 10;
      std::fclose(f);
    }
    return v > 0 ? v : int64_t{32} << 20;
  }();
  return bytes;
}

// Whether the float softmax forward writes its output with streaming
// stores (exps to a scratch row, then one streaming pass to y): when input
// and output together outgrow the last-level cache, so the output would
// not stay there for the next op anyway, and rows are at most 2048 long.
// Measured on 2 cores (AVX-512, 32 MiB of input): rows of 128 to 2048
// 15-40% faster than writing y twice in cache (exp, then the scaling);
// rows of 4096 and 8192 17-20% slower (the streaming pass over a long row
// no longer overlaps the next row's loads), so they keep the cached path.
constexpr int64_t kStreamMaxK = 2048;

template <typename T>
bool stream_output(const sm::FwdArgs& a) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    const int64_t bytes = 2 * a.outer * a.K * static_cast<int64_t>(sizeof(T));
    return a.mode == sm::Mode::Softmax && a.K <= kStreamMaxK && bytes > last_level_cache_bytes();
  }
}

template <typename T>
void fwd_rows(const sm::FwdArgs& a) {
  using A = Acc<T>;
  if (a.mode == sm::Mode::LogSoftmax) {
    fwd_rows_log<T>(a);
    return;
  }
  const int64_t K = a.K;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    // Aligned to a cache line, so no vector access to it splits a line.
    constexpr int64_t kPad = 64 / sizeof(A);
    const bool half_or_masked = kNeedsConvert<T> || a.mode == sm::Mode::ScaledMasked;
    const bool stream = stream_output<T>(a);
    const int64_t buf_len = half_or_masked ? (kNeedsConvert<T> && K <= kShortK ? kRows * K : K) : (stream ? K : 0);
    const bool need_buf = buf_len > 0;
    std::vector<A> scratch(need_buf ? buf_len + kPad : 0);
    A* buf = scratch.data();
    if (need_buf) buf += (kPad - (reinterpret_cast<std::uintptr_t>(buf) % 64) / sizeof(A)) % kPad;
    fwd_rows_range<T>(a, r0, r1, buf, stream);
    if (stream) stream_fence();
  });
}

// ------------------------------------------------------------------ forward, outer dim

constexpr int64_t kColBlock = 64;  // inner columns per task (a multiple of every vector width)

template <typename T>
void fwd_cols(const sm::FwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K, inner = a.inner;
  const int64_t nb = (inner + kColBlock - 1) / kColBlock;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 12) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer * nb, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) A mx[kColBlock], sum[kColBlock], tmp[kColBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / nb;
      const int64_t i0 = (t % nb) * kColBlock;
      const int64_t n = std::min(kColBlock, inner - i0);
      const int64_t base = o * K * inner + i0;
      std::fill(mx, mx + n, -std::numeric_limits<A>::infinity());
      std::fill(sum, sum + n, A(0));
      for (int64_t k = 0; k < K; ++k) {
        to_acc(in + base + k * inner, tmp, n);
        at::vec::map2([](V u, V w) { return at::vec::maximum(u, w); }, mx, mx, tmp, n);
      }
      for (int64_t k = 0; k < K; ++k) {
        to_acc(in + base + k * inner, tmp, n);
        at::vec::map3([](V u, V w, V s) { return s + vexp(u - w); }, sum, tmp, mx, sum, n);
      }
      if (log_mode) {
        for (int64_t j = 0; j < n; ++j) sum[j] = std::log(sum[j]);  // (x - m) - log(sum), as the rows
        for (int64_t k = 0; k < K; ++k) {
          to_acc(in + base + k * inner, tmp, n);
          at::vec::map3([](V u, V w, V l) { return (u - w) - l; }, tmp, tmp, mx, sum, n);
          from_acc(tmp, out + base + k * inner, n);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) sum[j] = A(1) / sum[j];
        for (int64_t k = 0; k < K; ++k) {
          to_acc(in + base + k * inner, tmp, n);
          at::vec::map3([](V u, V w, V inv) { return vexp(u - w) * inv; }, tmp, tmp, mx, sum, n);
          from_acc(tmp, out + base + k * inner, n);
        }
      }
    }
  });
}

// ------------------------------------------------------------------ backward

// sum(dy * y) (softmax) or sum(dy) (log_softmax) over one row, in opmath,
// with several independent accumulators so the adds do not form one chain
// (dy and y loaded alike in ChunkIO's order, which a sum does not see).
template <typename T, bool kLog>
inline Acc<T> bwd_row_sum(const T* dy, const T* y, int64_t K) {
  using A = Acc<T>;
  using IO = VecIO<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  V acc[2 * P];
  for (int k = 0; k < 2 * P; ++k) acc[k] = V(0);
  int64_t i = 0;
  for (; i + 2 * W <= K; i += 2 * W) {
    for (int u = 0; u < 2; ++u) {
      const auto g = ChunkIO<T>::load(dy + i + u * W);
      if constexpr (kLog) {
        for (int k = 0; k < P; ++k) acc[u * P + k] = acc[u * P + k] + g.v[k];
      } else {
        const auto o = ChunkIO<T>::load(y + i + u * W);
        for (int k = 0; k < P; ++k) acc[u * P + k] = at::vec::fmadd(g.v[k], o.v[k], acc[u * P + k]);
      }
    }
  }
  for (; i + W <= K; i += W) {
    const auto g = ChunkIO<T>::load(dy + i);
    if constexpr (kLog) {
      for (int k = 0; k < P; ++k) acc[k] = acc[k] + g.v[k];
    } else {
      const auto o = ChunkIO<T>::load(y + i);
      for (int k = 0; k < P; ++k) acc[k] = at::vec::fmadd(g.v[k], o.v[k], acc[k]);
    }
  }
  for (int k = 1; k < 2 * P; ++k) acc[0] = acc[0] + acc[k];
  A s = at::vec::vec_reduce_all<A>([](V& u, V& w) { return u + w; }, acc[0]);
  for (; i < K; ++i) s += kLog ? static_cast<A>(dy[i]) : static_cast<A>(dy[i]) * static_cast<A>(y[i]);
  return s;
}

// Half types, one row: the sum in one pass over (dy, y) converted on the
// fly, then the result in a second pass (the row is in cache by then); dy
// and y load alike in ChunkIO's order, which its store puts back.
template <typename T>
void bwd_row_reduced(const T* dy, const T* y, T* dx, int64_t K, bool log_mode, float scale) {
  using IO = VecIO<T>;
  using V = Vectorized<float>;
  constexpr int64_t W = IO::kWidth;
  const float s = log_mode ? bwd_row_sum<T, true>(dy, y, K) : bwd_row_sum<T, false>(dy, y, K);
  int64_t i;
  const V vs(s), vscale(scale);
  for (i = 0; i + W <= K; i += W) {
    auto g = ChunkIO<T>::load(dy + i);
    const auto o = ChunkIO<T>::load(y + i);
    for (int k = 0; k < 2; ++k) {
      g.v[k] = log_mode ? g.v[k] - o.v[k].exp() * vs : o.v[k] * (g.v[k] - vs) * vscale;
    }
    ChunkIO<T>::template store<false>(dx + i, g.v[0], g.v[1]);
  }
  for (; i < K; ++i) {
    const float g = static_cast<float>(dy[i]), o = static_cast<float>(y[i]);
    dx[i] = static_cast<T>(log_mode ? g - std::exp(o) * s : o * (g - s) * scale);
  }
}

template <typename T>
void bwd_rows(const sm::BwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const A scale = a.mode == sm::Mode::ScaledMasked ? static_cast<A>(a.scale) : A(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kNeedsConvert<T>) {
        bwd_row_reduced(gy + r * K, yy + r * K, gx + r * K, K, log_mode, scale);
      } else {
        const A* dy = gy + r * K;
        const A* y = yy + r * K;
        A* dst = gx + r * K;
        if (log_mode) {
          const V s(bwd_row_sum<T, true>(dy, y, K));
          at::vec::map2([s](V g, V o) { return g - o.exp() * s; }, dst, dy, y, K);
        } else {
          const V s(bwd_row_sum<T, false>(dy, y, K));
          const V vs(scale);
          at::vec::map2([s, vs](V g, V o) { return o * (g - s) * vs; }, dst, dy, y, K);
        }
      }
    }
  });
}

template <typename T>
void bwd_cols(const sm::BwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K, inner = a.inner;
  const int64_t nb = (inner + kColBlock - 1) / kColBlock;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const A scale = a.mode == sm::Mode::ScaledMasked ? static_cast<A>(a.scale) : A(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 12) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer * nb, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) A sum[kColBlock], g[kColBlock], o[kColBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t oi = t / nb;
      const int64_t i0 = (t % nb) * kColBlock;
      const int64_t n = std::min(kColBlock, inner - i0);
      const int64_t base = oi * K * inner + i0;
      std::fill(sum, sum + n, A(0));
      for (int64_t k = 0; k < K; ++k) {
        to_acc(gy + base + k * inner, g, n);
        if (log_mode) {
          at::vec::map2([](V s, V u) { return s + u; }, sum, sum, g, n);
        } else {
          to_acc(yy + base + k * inner, o, n);
          at::vec::map3([](V s, V u, V w) { return s + u * w; }, sum, sum, g, o, n);
        }
      }
      const V vs(scale);
      for (int64_t k = 0; k < K; ++k) {
        to_acc(gy + base + k * inner, g, n);
        to_acc(yy + base + k * inner, o, n);
        if (log_mode) {
          at::vec::map3([](V u, V w, V s) { return u - w.exp() * s; }, g, g, o, sum, n);
        } else {
          at::vec::map3([vs](V u, V w, V s) { return w * (u - s) * vs; }, g, g, o, sum, n);
        }
        from_acc(g, gx + base + k * inner, n);
      }
    }
  });
}

}  // namespace

void softmax_forward(const sm::FwdArgs& a) {
  OPFORGE_DISPATCH_FLOATING_TYPES(a.dtype, "opforge_softmax_forward", [&] {
    if (a.inner == 1) {
      fwd_rows<scalar_t>(a);
    } else {
      fwd_cols<scalar_t>(a);
    }
  });
}

void softmax_backward(const sm::BwdArgs& a) {
  OPFORGE_DISPATCH_FLOATING_TYPES(a.dtype, "opforge_softmax_backward", [&] {
    if (a.inner == 1) {
      bwd_rows<scalar_t>(a);
    } else {
      bwd_cols<scalar_t>(a);
    }
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

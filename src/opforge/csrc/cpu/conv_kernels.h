// Loops of the conv family, compiled once per ISA by conv_{default,avx2,avx512}.cpp
// (which include cpu_isa_begin.h first); cpu/conv_cpu.cpp picks the ISA at run time.
//
// - depthwise forward, NCHW: per (image, input channel) the input rows are
//   converted to opmath into a zero-padded, 64-byte aligned plane a few rows
//   before their use (stride 2: each row split into even and odd columns so
//   every tap is a contiguous vector load), then 4, 2 or 1 output rows per
//   pass get their 9 vector FMAs along W starting from the bias, ReLU and one
//   rounding on the store. Channel multipliers reuse the plane.
// - depthwise forward, NHWC: two output rows per pass, tiles of pixels per
//   channel vector with the 9 weight vectors in registers; edge pixels and
//   the channel tail take their own (checked / masked) loops.
// - bias_act: the dense path's epilogue, run on each GEMM result tile while
//   it is in cache (bias per row or per column, optional ReLU, one rounding).
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

// R consecutive output rows of one channel from the staged plane: R0 is the
// first padded input row they read. Each staged row is loaded once per output
// vector and feeds every output row it belongs to (up to 3); the R
// accumulators are independent FMA chains, so narrow planes (few vectors per
// row) are not bound by the FMA latency. Stride 2 rows hold the even columns,
// then the odd ones from E.
template <int R, int S, typename scalar_t>
inline void dw_nchw_pass(const at::opmath_type<scalar_t>* R0, int64_t rowlen, int64_t E, int64_t Wo,
                         const at::vec::Vectorized<at::opmath_type<scalar_t>>* wv, at::opmath_type<scalar_t> bk,
                         Activation act, scalar_t* o0) {
  using IO = VecIo<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  constexpr int NR = (R - 1) * S + 3;  // staged rows read
  V w[9];
  for (int t = 0; t < 9; ++t) w[t] = wv[t];
  for (int64_t ow = 0; ow < Wo; ow += L) {
    V acc[R];
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t) acc[t] = V(bk);
#pragma GCC unroll 16
    for (int rr = 0; rr < NR; ++rr) {
      const opmath_t* row = R0 + rr * rowlen + ow;
      V x0, x1, x2;
      if constexpr (S == 1) {
        taps3(row, x0, x1, x2);
      } else {
        x0 = V::loadu(row);
        x1 = V::loadu(row + E);
        x2 = V::loadu(row + 1);
      }
#pragma GCC unroll 8
      for (int t = 0; t < R; ++t) {
        const int kh = rr - S * t;
        if (kh < 0 || kh > 2) continue;
        acc[t] = at::vec::fmadd(w[kh * 3], x0, acc[t]);
        acc[t] = at::vec::fmadd(w[kh * 3 + 1], x1, acc[t]);
        acc[t] = at::vec::fmadd(w[kh * 3 + 2], x2, acc[t]);
      }
    }
    const int64_t rem = Wo - ow;
#pragma GCC unroll 8
    for (int t = 0; t < R; ++t) {
      acc[t] = act_vec(acc[t], act);
      // Full-width loads stay inside the rows' slack (see rowlen); only the
      // rem valid values of the last vector are stored.
      if (rem >= L) {
        IO::store(o0 + t * Wo + ow, acc[t]);
      } else {
        IO::store(o0 + t * Wo + ow, acc[t], static_cast<int>(rem));
      }
    }
  }
}

// The staging is asked for kStageAhead rows more than a pass reads, so the
// vector loads that straddle the staging's stores find them written to the
// cache rather than still in the store buffer.
constexpr int64_t kStageAhead = 4;

// Rows [oh0, oh1) of output channel plane `op`: 4 rows per pass, then 2, then
// 1. `stage(r)` stages the padded rows before r (in increasing order).
template <int S, typename scalar_t, typename Stage>
inline void dw_nchw_rows(const at::opmath_type<scalar_t>* plane, int64_t rowlen, int64_t E, int64_t Wo, int64_t oh0,
                         int64_t oh1, const at::vec::Vectorized<at::opmath_type<scalar_t>>* wv,
                         at::opmath_type<scalar_t> bk, Activation act, scalar_t* op, Stage&& stage) {
  int64_t oh = oh0;
  for (; oh + 4 <= oh1; oh += 4) {
    stage(oh * S + 3 * S + 3 + kStageAhead);
    dw_nchw_pass<4, S, scalar_t>(plane + oh * S * rowlen, rowlen, E, Wo, wv, bk, act, op + oh * Wo);
  }
  if (oh + 2 <= oh1) {
    stage(oh * S + S + 3 + kStageAhead);
    dw_nchw_pass<2, S, scalar_t>(plane + oh * S * rowlen, rowlen, E, Wo, wv, bk, act, op + oh * Wo);
    oh += 2;
  }
  if (oh < oh1) {
    stage(oh * S + 3 + kStageAhead);
    dw_nchw_pass<1, S, scalar_t>(plane + oh * S * rowlen, rowlen, E, Wo, wv, bk, act, op + oh * Wo);
  }
}

// Stride 2 staging, straight from the input row: padded column q = iw + pad
// goes to row[q / 2] when q is even and to row[E + q / 2] when it is odd, in
// opmath (grad_out passed by `mr` when that is not null). Pairs of input
// vectors are split with deinterleave2 and stored with exact counts, so the
// padding entries, zero since the buffer was made, are never written.
// (Staging the padded row first and splitting it after read back what had
// just been stored at another offset: a store-forwarding stall per vector,
// and stride 2 ran slower than stride 1 on the same input.)
template <typename scalar_t>
inline void stage_even_odd(const scalar_t* xr, const scalar_t* mr, at::opmath_type<scalar_t>* row, int64_t W,
                           int64_t pad, int64_t E) {
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  constexpr int64_t L = V::size();
  auto load = [&](int64_t iw, int64_t n) {
    if (n <= 0) return V(0);
    return n >= L ? load_passed(xr + iw, mr ? mr + iw : nullptr)
                  : load_passed(xr + iw, mr ? mr + iw : nullptr, static_cast<int>(n));
  };
  for (int64_t iw = 0; iw < W; iw += 2 * L) {
    const int64_t n = std::min(2 * L, W - iw);
    const auto split = at::vec::deinterleave2(load(iw, n), load(iw + L, n - L));
    // x[iw + 2k] is padded column iw + 2k + pad (iw is even).
    const bool even_pad = pad % 2 == 0;
    split.first.store(even_pad ? row + (iw + pad) / 2 : row + E + (iw + pad - 1) / 2, static_cast<int>((n + 1) / 2));
    split.second.store(even_pad ? row + E + (iw + pad) / 2 : row + (iw + pad + 1) / 2, static_cast<int>(n / 2));
  }
}

// NCHW: work items are (image, channel, range of output rows); a plane is
// split into row ranges only when there are too few planes for the threads.
// The input rows an item needs are converted to opmath and zero padded into a
// plane buffer just before their first use, so reading the input (from
// memory) and the FMAs interleave instead of running as separate phases.
template <typename scalar_t>
void dw_nchw(const conv::DwParams& p) {
  using IO = VecIo<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const auto* x = static_cast<const scalar_t*>(p.x);
  const auto* w = static_cast<const scalar_t*>(p.w);
  const auto* b = static_cast<const scalar_t*>(p.b);
  auto* out = static_cast<scalar_t*>(p.out);
  const int64_t H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, s = p.stride, pad = p.pad, m = p.mult;
  const int64_t Hp = H + 2 * pad, Wp = W + 2 * pad;
  const int64_t E = (Wp + 1) / 2;  // stride 2: even columns first, then odd ones
  // Rows are a whole number of vectors (64-byte aligned with AVX-512) with at
  // least one vector of slack: every tap load of an output vector that has a
  // valid lane stays inside its row.
  const int64_t rowlen = (Wp + L - 1) / L * L + L;
  const int64_t planes = p.N * p.C;
  constexpr int64_t kLine = 64 / sizeof(scalar_t), kPrefetch = 4096 / sizeof(scalar_t);
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t rows_per_item = Ho;
  if (planes < want) {
    const int64_t chunks = std::min<int64_t>(Ho, (want + planes - 1) / planes);
    rows_per_item = (Ho + chunks - 1) / chunks;
  }
  const int64_t chunks = (Ho + rows_per_item - 1) / rows_per_item;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, rows_per_item * Wo * m));
  at::parallel_for(0, planes * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> plane_buf(Hp * rowlen + 64 / sizeof(opmath_t), opmath_t(0));
    opmath_t* plane =
        reinterpret_cast<opmath_t*>((reinterpret_cast<uintptr_t>(plane_buf.data()) + 63) & ~uintptr_t(63));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t nc = item / chunks, oh0 = (item % chunks) * rows_per_item;
      const int64_t oh1 = std::min(Ho, oh0 + rows_per_item);
      const int64_t n = nc / p.C, c = nc % p.C;
      const scalar_t* xp = x + nc * H * W;
      const scalar_t* mp = p.mask ? static_cast<const scalar_t*>(p.mask) + nc * H * W : nullptr;
      // Padded rows [first, next) are staged; rows up to `limit` are needed.
      int64_t next = oh0 * s;
      const int64_t limit = (oh1 - 1) * s + 3;
      auto stage = [&](int64_t upto) {
        for (upto = std::min(upto, limit); next < upto; ++next) {
          opmath_t* row = plane + next * rowlen;
          const int64_t ih = next - pad;
          if (ih < 0 || ih >= H) {
            std::fill(row, row + rowlen, opmath_t(0));
            continue;
          }
          const scalar_t* xr = xp + ih * W;
          // The next planes follow in memory: ask for the bytes about
          // kPrefetch ahead now, so they arrive while this row is used.
          for (int64_t q = 0; q < W; q += kLine) __builtin_prefetch(xr + kPrefetch + q, 0, 3);
          const scalar_t* mr = mp ? mp + ih * W : nullptr;
          if (s == 2) {
            stage_even_odd(xr, mr, row, W, pad, E);
            continue;
          }
          // Stride 1 stages the padded row in place.
          opmath_t* d = row + pad;
          int64_t iw = 0;
          if (mr) {
            for (; iw + L <= W; iw += L) load_passed(xr + iw, mr + iw).store(d + iw);
            if (iw < W) load_passed(xr + iw, mr + iw, static_cast<int>(W - iw)).store(d + iw, static_cast<int>(W - iw));
          } else {
            for (; iw + L <= W; iw += L) IO::load(xr + iw).store(d + iw);
            if (iw < W) IO::load(xr + iw, static_cast<int>(W - iw)).store(d + iw, static_cast<int>(W - iw));
          }
          // Padding columns (2 for the backward's grad x of a padding-0 conv).
          std::fill(row, row + pad, opmath_t(0));
          std::fill(row + pad + W, row + Wp, opmath_t(0));
        }
      };
      for (int64_t j = 0; j < m; ++j) {
        const int64_t k = c * m + j;
        V wv[9];
        for (int t = 0; t < 9; ++t) wv[t] = V(static_cast<opmath_t>(w[k * 9 + t]));
        const opmath_t bk = b ? static_cast<opmath_t>(b[k]) : opmath_t(0);
        scalar_t* op = out + (n * p.K + k) * Ho * Wo;
        if (s == 1) {
          dw_nchw_rows<1, scalar_t>(plane, rowlen, E, Wo, oh0, oh1, wv, bk, p.act, op, stage);
        } else {
          dw_nchw_rows<2, scalar_t>(plane, rowlen, E, Wo, oh0, oh1, wv, bk, p.act, op, stage);
        }
      }
    }
  });
}

// NHWC, R output rows x T output pixels for one vector of channels
// [k0, k0 + n): r[i] points at staged input row i's first needed pixel
// (channel k0), nullptr for a padding row; NR = (R - 1) * S + 3 input rows.
// Input pixels are C apart, output pixels K apart, output rows orow_stride.
// Each loaded input vector feeds up to 3 pixels of up to 3 rows: with R = 2
// the loads per FMA halve against R = 1.
template <typename scalar_t, int R, int S, int T, bool Full>
inline void dw_nhwc_tile(const scalar_t* const* r, int64_t C, const at::opmath_type<scalar_t>* wk, int64_t K,
                         const at::vec::Vectorized<at::opmath_type<scalar_t>>& bv, scalar_t* o, int64_t orow_stride,
                         Activation act, int n) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  constexpr int NI = (T - 1) * S + 3;
  constexpr int NR = (R - 1) * S + 3;
  V acc[R][T];
  V wv[9];
#pragma GCC unroll 9
  for (int t = 0; t < 9; ++t) wv[t] = V::loadu(wk + t * K);
#pragma GCC unroll 4
  for (int q = 0; q < R; ++q) {
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[q][t] = bv;
  }
#pragma GCC unroll 5
  for (int rr = 0; rr < NR; ++rr) {
    if (!r[rr]) continue;
    V in[NI];
#pragma GCC unroll 16
    for (int i = 0; i < NI; ++i) in[i] = Full ? IO::load(r[rr] + i * C) : IO::load(r[rr] + i * C, n);
#pragma GCC unroll 4
    for (int q = 0; q < R; ++q) {
      const int kh = rr - S * q;
      if (kh < 0 || kh > 2) continue;
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        acc[q][t] = at::vec::fmadd(wv[kh * 3], in[t * S], acc[q][t]);
        acc[q][t] = at::vec::fmadd(wv[kh * 3 + 1], in[t * S + 1], acc[q][t]);
        acc[q][t] = at::vec::fmadd(wv[kh * 3 + 2], in[t * S + 2], acc[q][t]);
      }
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < R; ++q) {
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      V a = acc[q][t];
      a = act_vec(a, act);
      if constexpr (Full) {
        IO::store(o + q * orow_stride + t * K, a);
      } else {
        IO::store(o + q * orow_stride + t * K, a, n);
      }
    }
  }
}

// One NHWC output pixel whose taps may fall into the left / right padding:
// rows[kh] points at input row kh's pixel 0 (channel k0) or is nullptr.
template <typename scalar_t, bool Full>
inline void dw_nhwc_edge(const scalar_t* const* rows, int64_t C, int64_t W, int64_t iw0,
                         const at::opmath_type<scalar_t>* wk, int64_t K,
                         const at::vec::Vectorized<at::opmath_type<scalar_t>>& bv, scalar_t* o, Activation act, int n) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  V a = bv;
  for (int kh = 0; kh < 3; ++kh) {
    if (!rows[kh]) continue;
    for (int kw = 0; kw < 3; ++kw) {
      const int64_t iw = iw0 + kw;
      if (iw < 0 || iw >= W) continue;
      const scalar_t* src = rows[kh] + iw * C;
      a = at::vec::fmadd(V::loadu(wk + (kh * 3 + kw) * K), Full ? IO::load(src) : IO::load(src, n), a);
    }
  }
  a = act_vec(a, act);
  if constexpr (Full) {
    IO::store(o, a);
  } else {
    IO::store(o, a, n);
  }
}

// R NHWC output rows (R = 2, or 1 for an odd last row), channel multiplier 1:
// rows[i] is input row oh * S - pad + i of the image (NR of them, nullptr in
// the padding). Pixels whose taps are all inside the row go through
// dw_nhwc_tile, kTile at a time (then kTile / 2, then one), every channel
// vector of a tile before the next tile (the input and output are read and
// written in order); the few pixels next to the padding go through
// dw_nhwc_edge. While a tile computes, the same columns of the input rows the
// next pass adds (next_rows, next_avail of them) are prefetched, one channel
// vector at a time so that few prefetches are in flight at once: the rows
// are far apart in memory and the hardware prefetchers alone leave the loads
// waiting.
template <typename scalar_t, int R, int S>
void dw_nhwc_rows(const scalar_t* const* rows, const at::opmath_type<scalar_t>* wt,
                  const at::opmath_type<scalar_t>* bias, scalar_t* orow, int64_t C, int64_t W, int64_t Wo, int64_t pad,
                  Activation act, const scalar_t* next_rows, int64_t next_avail) {
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  constexpr int64_t L = V::size();
  constexpr int NR = (R - 1) * S + 3;
#if defined(CPU_CAPABILITY_AVX512)
  // R * kTile accumulators, 9 weights and up to (kTile - 1) * S + 3 inputs
  // of 32 registers.
  constexpr int kTile = R == 1 ? 8 : 4;
#else
  constexpr int kTile = R == 1 ? 4 : 2;  // 16 vector registers
#endif
  const int64_t K = C, ostride = Wo * K;
  // Output columns [lo, hi) read input columns inside [0, W) only.
  const int64_t lo = std::min<int64_t>(Wo, (pad + S - 1) / S);
  const int64_t last = W - 3 + pad;  // largest ow * S with all taps inside
  const int64_t hi = std::max<int64_t>(lo, last < 0 ? 0 : std::min<int64_t>(Wo, last / S + 1));
  const int64_t kfull = K / L * L;
  const int ntail = static_cast<int>(K - kfull);
  auto edge = [&](int64_t ow) {
    const int64_t iw0 = ow * S - pad;
    for (int q = 0; q < R; ++q) {
      const scalar_t* r[3];
      for (int64_t k0 = 0; k0 < K; k0 += L) {
        for (int kh = 0; kh < 3; ++kh) r[kh] = rows[q * S + kh] ? rows[q * S + kh] + k0 : nullptr;
        scalar_t* o = orow + q * ostride + ow * K + k0;
        if (k0 < kfull) {
          dw_nhwc_edge<scalar_t, true>(r, C, W, iw0, wt + k0, K, V::loadu(bias + k0), o, act, L);
        } else {
          dw_nhwc_edge<scalar_t, false>(r, C, W, iw0, wt + k0, K, V::loadu(bias + k0), o, act, ntail);
        }
      }
    }
  };
  auto tiles = [&](auto tile_const, int64_t ow) {
    constexpr int Tn = decltype(tile_const)::value;
    const int64_t iw0 = ow * S - pad;
    const scalar_t* r[NR];
    for (int64_t k0 = 0; k0 < K; k0 += L) {
      for (int64_t q = 0; q < next_avail; ++q) {
        const scalar_t* pf = next_rows + q * W * C + iw0 * C + k0;
        for (int i = 0; i < Tn * S; ++i) __builtin_prefetch(pf + i * C, 0, 3);
      }
      for (int i = 0; i < NR; ++i) r[i] = rows[i] ? rows[i] + iw0 * C + k0 : nullptr;
      scalar_t* o = orow + ow * K + k0;
      if (k0 < kfull) {
        dw_nhwc_tile<scalar_t, R, S, Tn, true>(r, C, wt + k0, K, V::loadu(bias + k0), o, ostride, act, L);
      } else {
        dw_nhwc_tile<scalar_t, R, S, Tn, false>(r, C, wt + k0, K, V::loadu(bias + k0), o, ostride, act, ntail);
      }
    }
  };
  int64_t ow = 0;
  for (; ow < lo; ++ow) edge(ow);
  for (; ow + kTile <= hi; ow += kTile) tiles(std::integral_constant<int, kTile>{}, ow);
  if (ow + kTile / 2 <= hi) {
    tiles(std::integral_constant<int, kTile / 2>{}, ow);
    ow += kTile / 2;
  }
  for (; ow < hi; ++ow) tiles(std::integral_constant<int, 1>{}, ow);
  for (; ow < Wo; ++ow) edge(ow);
}

// NHWC: vectorised along the channels, parallel over (image, pair of output
// rows), through dw_nhwc_rows; a channel multiplier > 1 (output channel k
// reads input channel k / m) runs it on input rows with repeated channels.
template <typename scalar_t>
void dw_nhwc(const conv::DwParams& p) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const auto* x = static_cast<const scalar_t*>(p.x);
  const auto* w = static_cast<const scalar_t*>(p.w);
  const auto* b = static_cast<const scalar_t*>(p.b);
  auto* out = static_cast<scalar_t*>(p.out);
  const int64_t C = p.C, K = p.K, H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, s = p.stride, pad = p.pad, m = p.mult;
  // Weights transposed to (9, K) and the bias, in opmath; L slack values so
  // the last channel vector's full-width loads stay inside.
  std::vector<opmath_t> wt(9 * K + L, opmath_t(0)), bias(K + L, opmath_t(0));
  for (int64_t k = 0; k < K; ++k) {
    for (int t = 0; t < 9; ++t) wt[t * K + k] = static_cast<opmath_t>(w[k * 9 + t]);
    if (b) bias[k] = static_cast<opmath_t>(b[k]);
  }
  const int64_t pairs = (Ho + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, 2 * Wo * K));
  at::parallel_for(0, p.N * pairs, grain, [&](int64_t begin, int64_t end) {
    // Channel multiplier m > 1: the pass's input rows with every channel
    // repeated m times (channel k of a repeated row is input channel k / m),
    // so the same loops as for m = 1 run on them with C = K.
    std::vector<scalar_t> rep(m == 1 ? 0 : 5 * W * K);
    // With a mask (the backward's grad x): the pass's input rows, masked.
    std::vector<scalar_t> passed(p.mask ? 5 * W * C : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / pairs, oh0 = (item % pairs) * 2;
      const int R = oh0 + 1 < Ho ? 2 : 1;
      const scalar_t* rows[5];
      for (int i = 0; i < 5; ++i) {
        const int64_t ih = oh0 * s - pad + i;
        rows[i] = (ih < 0 || ih >= H) ? nullptr : x + ((n * H + ih) * W) * C;
      }
      scalar_t* orow = out + ((n * Ho + oh0) * Wo) * K;
      const int64_t ih_next = oh0 * s - pad + (R - 1) * s + 3;  // first input row the next pass adds
      int64_t next_avail = ih_next < 0 ? 0 : std::min<int64_t>(R * s, H - ih_next);
      const scalar_t* next_rows = next_avail > 0 ? x + ((n * H + ih_next) * W) * C : nullptr;
      if (p.mask) {
        using IO = VecIo<scalar_t>;
        const auto* mask = static_cast<const scalar_t*>(p.mask);
        const int nr = (R - 1) * static_cast<int>(s) + 3;
        for (int i = 0; i < nr; ++i) {
          if (!rows[i]) continue;
          const scalar_t* mr = mask + (rows[i] - x);
          scalar_t* d = passed.data() + i * W * C;
          int64_t q = 0;
          for (; q + L <= W * C; q += L) IO::store(d + q, load_passed(rows[i] + q, mr + q));
          if (q < W * C) {
            const int n_ = static_cast<int>(W * C - q);
            IO::store(d + q, load_passed(rows[i] + q, mr + q, n_), n_);
          }
          rows[i] = d;
        }
        next_rows = nullptr;  // prefetches would fetch the unmasked rows
        next_avail = 0;
      }
      int64_t Ceff = C;
      if (m > 1) {
        const int nr = (R - 1) * static_cast<int>(s) + 3;
        for (int i = 0; i < nr; ++i) {
          if (!rows[i]) continue;
          scalar_t* d = rep.data() + i * W * K;
          for (int64_t iw = 0; iw < W; ++iw) {
            const scalar_t* src = rows[i] + iw * C;
            for (int64_t c = 0; c < C; ++c) std::fill(d + iw * K + c * m, d + iw * K + (c + 1) * m, src[c]);
          }
          rows[i] = d;
        }
        Ceff = K;
        next_rows = nullptr;
        next_avail = 0;
      }
      if (s == 1) {
        if (R == 2) {
          dw_nhwc_rows<scalar_t, 2, 1>(rows, wt.data(), bias.data(), orow, Ceff, W, Wo, pad, p.act, next_rows,
                                       next_avail);
        } else {
          dw_nhwc_rows<scalar_t, 1, 1>(rows, wt.data(), bias.data(), orow, Ceff, W, Wo, pad, p.act, next_rows,
                                       next_avail);
        }
      } else {
        if (R == 2) {
          dw_nhwc_rows<scalar_t, 2, 2>(rows, wt.data(), bias.data(), orow, Ceff, W, Wo, pad, p.act, next_rows,
                                       next_avail);
        } else {
          dw_nhwc_rows<scalar_t, 1, 2>(rows, wt.data(), bias.data(), orow, Ceff, W, Wo, pad, p.act, next_rows,
                                       next_avail);
        }
      }
    }
  });
}

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

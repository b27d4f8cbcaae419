// Depthwise 3x3 forward, NHWC: two output rows per pass, tiles of pixels per
// channel vector with the 9 weight vectors in registers; edge pixels and the
// channel tail take their own (checked / masked) loops.
// Compiled once per ISA: included by cpu/conv_kernels.h, after cpu_isa_begin.h.
#pragma once

#include "cpu/conv_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace conv_detail {

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

}  // namespace conv_detail
}  // namespace opforge::cpu::CPU_CAPABILITY

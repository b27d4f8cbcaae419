// Depthwise 3x3 forward, NCHW: per (image, input channel) the input rows are
// converted to opmath into a zero-padded, 64-byte aligned plane a few rows
// before their use (stride 2: each row split into even and odd columns so
// every tap is a contiguous vector load), then 4, 2 or 1 output rows per
// pass get their 9 vector FMAs along W starting from the bias, the
// activation and one rounding on the store. Channel multipliers reuse the plane.
// Compiled once per ISA: included by cpu/conv_kernels.h, after cpu_isa_begin.h.
#pragma once

#include "cpu/conv_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace conv_detail {

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

}  // namespace conv_detail
}  // namespace opforge::cpu::CPU_CAPABILITY

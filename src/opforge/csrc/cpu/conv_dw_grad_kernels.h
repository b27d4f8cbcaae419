// Depthwise weight / bias gradients of the conv family on the CPU (channel
// multiplier 1, stride 1 or 2), compiled once per ISA by conv_{default,avx2,
// avx512}.cpp (helpers: cpu/conv_vec.h); cpu/conv_cpu.cpp picks the ISA at run time.
//
// gw[c, kh, kw] = sum_{n, oh, ow} g[n, c, oh, ow] * x[n, c, S oh - pad + kh, S ow - pad + kw]
// gb[c]         = sum_{n, oh, ow} g[n, c, oh, ow]
// with g grad_out where the ReLU passed it (mask > 0 or NaN; all of it
// without a mask). Sums are kept in opmath vectors and
// added in an order fixed by the shape alone (not by the thread count), so a
// result does not change from run to run.
//
// - NCHW: one work item per channel; each (image, channel) plane of x is
//   staged once into zero-padded opmath rows (stride 2: each row split into
//   its even and odd columns by the forward's stage_even_odd), then every
//   grad_out row adds its 9 tap products along W (3 staged rows x 3 shifted
//   loads, contiguous for either stride).
// - NHWC: vectorised along the channels; the N * Ho output rows are cut into
//   at most kNhwcChunks chunks of 4 rows or more (their count fixed by the
//   shape), each summing into its own (10, K) partials while one channel
//   vector walks two rows (AVX-512; one elsewhere, and at stride 2) with the
//   input window in registers (4 new loads per pixel for 18 products); the
//   partials are added chunk by chunk at the end.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

#include <opforge/dispatch.h>

#include "cpu/conv_vec.h"
#include "cpu/conv_params.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace conv_detail {

// The lanes of v added in lane order.
template <typename T>
inline T lane_sum(const at::vec::Vectorized<T>& v) {
  T buf[at::vec::Vectorized<T>::size()];
  v.store(buf);
  T s = T(0);
  for (T b : buf) s += b;
  return s;
}

// One grad_out vector's (n lanes; whole when Full) products with its 9 taps
// into acc, and the vector into accb. rows[kh]: the staged row of input row
// oh * S - pad + kh, at output column ow. Stride 2 rows hold the even padded
// columns, then the odd ones from E: taps kw = 0, 1, 2 are at ow, E + ow,
// ow + 1. A partial vector loads only its n lanes: the lanes past Wo, whose
// taps lie outside what the sums cover, add exact zeros (not 0 * x, which is
// NaN where x is infinite or NaN).
template <int S, bool Full, typename T>
inline void wgrad_taps(const T* gp, const T* const (&rows)[3], int64_t E, int n, at::vec::Vectorized<T> (&acc)[9],
                       at::vec::Vectorized<T>& accb) {
  using V = at::vec::Vectorized<T>;
  auto load = [&](const T* q) { return Full ? V::loadu(q) : V::loadu(q, n); };
  const V gv = load(gp);
  accb = accb + gv;
  for (int kh = 0; kh < 3; ++kh) {
    const T* xr = rows[kh];
    acc[kh * 3] = at::vec::fmadd(gv, load(xr), acc[kh * 3]);
    acc[kh * 3 + 1] = at::vec::fmadd(gv, load(S == 1 ? xr + 1 : xr + E), acc[kh * 3 + 1]);
    acc[kh * 3 + 2] = at::vec::fmadd(gv, load(S == 1 ? xr + 2 : xr + 1), acc[kh * 3 + 2]);
  }
}

template <typename scalar_t, int S>
void dw_wgrad_nchw(const conv::DwBackwardParams& p) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  using IO = VecIo<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const BackwardPtrs<scalar_t> ptr(p);
  const scalar_t *x = ptr.x, *g = ptr.g, *mask = ptr.mask;
  scalar_t *gw = ptr.gw, *gb = ptr.gb;
  const int64_t C = p.C, H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, pad = p.pad;
  const int64_t Wp = W + 2 * pad, Hp = H + 2 * pad;
  const int64_t E = (Wp + 1) / 2;             // stride 2: the odd padded columns' offset in a staged row
  const int64_t wvec = (Wo + L - 1) / L * L;  // grad_out columns, whole vectors
  // Staged rows: whole vectors past the last tap a partial vector could read.
  const int64_t rowlen = std::max((Wp + L - 1) / L * L, wvec + 2) + L;
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    // Zero padding (rows and columns outside the image) stays zero: staging
    // writes only the entries of columns [pad, pad + W) of rows [pad, pad + H).
    std::vector<opmath_t> plane(Hp * rowlen, opmath_t(0));
    std::vector<opmath_t> grow(wvec, opmath_t(0));
    for (int64_t c = begin; c < end; ++c) {
      V acc[9], accb(opmath_t(0));
      for (int t = 0; t < 9; ++t) acc[t] = V(opmath_t(0));
      for (int64_t n = 0; n < p.N; ++n) {
        const scalar_t* xp = x + (n * C + c) * H * W;
        // This channel's next plane (the next image's, C planes on, or the
        // next channel's first) is far from this one in memory: its rows are
        // asked for while this plane's are used, so that they arrive in time
        // (the hardware prefetchers follow only the current stream).
        const int64_t next = n + 1 < p.N ? (n + 1) * C + c : (c + 1 < end ? c + 1 : -1);
        auto prefetch = [&](const scalar_t* base, int64_t plane_elems, int64_t off, int64_t len) {
          if (next < 0) return;
          const scalar_t* q = base + next * plane_elems + off;
          for (int64_t i = 0; i < len; i += kLine) __builtin_prefetch(q + i, 0, 3);
        };
        for (int64_t ih = 0; ih < H; ++ih) {
          opmath_t* row = plane.data() + (ih + pad) * rowlen;
          const scalar_t* xr = xp + ih * W;
          prefetch(x, H * W, ih * W, W);
          if constexpr (S == 2) {
            stage_even_odd<scalar_t>(xr, nullptr, row, W, pad, E);
          } else {
            opmath_t* d = row + pad;
            int64_t iw = 0;
            for (; iw + L <= W; iw += L) IO::load(xr + iw).store(d + iw);
            if (iw < W) IO::load(xr + iw, static_cast<int>(W - iw)).store(d + iw, static_cast<int>(W - iw));
          }
        }
        const scalar_t* gp = g + (n * C + c) * Ho * Wo;
        const scalar_t* mp = mask ? mask + (n * C + c) * Ho * Wo : nullptr;
        for (int64_t oh = 0; oh < Ho; ++oh) {
          // The passed grad_out row in opmath.
          const scalar_t* gr = gp + oh * Wo;
          const scalar_t* mr = mp ? mp + oh * Wo : nullptr;
          prefetch(g, Ho * Wo, oh * Wo, Wo);
          if (mask) prefetch(mask, Ho * Wo, oh * Wo, Wo);
          int64_t ow = 0;
          for (; ow + L <= Wo; ow += L) load_passed(gr + ow, mr ? mr + ow : nullptr).store(grow.data() + ow);
          if (ow < Wo) {
            load_passed(gr + ow, mr ? mr + ow : nullptr, static_cast<int>(Wo - ow)).store(grow.data() + ow);
          }
          // Staged row oh * S + kh is input row oh * S - pad + kh.
          const opmath_t* rows[3];
          for (int kh = 0; kh < 3; ++kh) rows[kh] = plane.data() + (oh * S + kh) * rowlen;
          for (ow = 0; ow + L <= Wo; ow += L) {
            const opmath_t* taps[3] = {rows[0] + ow, rows[1] + ow, rows[2] + ow};
            wgrad_taps<S, true>(grow.data() + ow, taps, E, static_cast<int>(L), acc, accb);
          }
          if (ow < Wo) {
            const opmath_t* taps[3] = {rows[0] + ow, rows[1] + ow, rows[2] + ow};
            wgrad_taps<S, false>(grow.data() + ow, taps, E, static_cast<int>(Wo - ow), acc, accb);
          }
        }
      }
      if (gw) {
        for (int t = 0; t < 9; ++t) gw[c * 9 + t] = static_cast<scalar_t>(lane_sum(acc[t]));
      }
      if (gb) gb[c] = static_cast<scalar_t>(lane_sum(accb));
    }
  });
}

constexpr int64_t kNhwcChunks = 64;
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kPairRows = true;
#else
constexpr bool kPairRows = false;  // 16 vector registers: one row at a time
#endif

// Asks for the cache lines of p[0, n), into L2 (a pass's rows outgrow L1).
template <typename scalar_t>
inline void prefetch_span(const scalar_t* p, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < n; i += kLine) __builtin_prefetch(p + i, 0, 2);
}

// R consecutive NHWC output rows' contribution to the 10 sums of channels
// [c0, c0 + n) (n = L when Full), added into acc: xr[i] are input rows
// oh - pad + i (i < R + 2; a row of zeros outside the image; stride 2, R = 1:
// rows 2 oh - pad + i), gr[r] / mr[r] output row oh + r's grad_out and mask
// rows (mask rows may be null). The input window (R + 2 rows x 3 columns)
// walks along the rows, R + 2 new loads per pixel for 9 R products (two rows
// at once share half the loads); at stride 2 it moves two columns a pixel.
template <typename scalar_t, int R, bool Full, int S = 1>
inline void dw_wgrad_nhwc_rows(const scalar_t* const* xr, const scalar_t* const* gr, const scalar_t* const* mr,
                               int64_t C, int64_t W, int64_t Wo, int64_t pad, int64_t c0, int n,
                               at::vec::Vectorized<at::opmath_type<scalar_t>> (&acc)[10]) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  constexpr int NR = R + 2;
  auto load = [&](const scalar_t* src) { return Full ? IO::load(src) : IO::load(src, n); };
  auto passed = [&](const scalar_t* src, const scalar_t* m) {
    return Full ? load_passed(src, m) : load_passed(src, m, n);
  };
  V win[NR][3];  // win[i][kw]: input (S oh - pad + i, S ow - pad + kw)
  for (int i = 0; i < NR; ++i)
    for (int kw = 0; kw < 3; ++kw) {
      const int64_t iw = kw - pad;
      win[i][kw] = iw >= 0 && iw < W ? load(xr[i] + iw * C + c0) : V(0);
    }
  for (int64_t ow = 0; ow < Wo; ++ow) {
    const int64_t o = ow * C + c0;
    for (int r = 0; r < R; ++r) {
      const V gv = passed(gr[r] + o, mr[r] ? mr[r] + o : nullptr);
      for (int kh = 0; kh < 3; ++kh)
        for (int kw = 0; kw < 3; ++kw) acc[kh * 3 + kw] = at::vec::fmadd(gv, win[r + kh][kw], acc[kh * 3 + kw]);
      acc[9] = acc[9] + gv;
    }
    if constexpr (S == 1) {
      const int64_t iw = ow + 3 - pad;  // the next pixel's new column
      const bool in = iw < W;
      for (int i = 0; i < NR; ++i) {
        win[i][0] = win[i][1];
        win[i][1] = win[i][2];
        win[i][2] = in ? load(xr[i] + iw * C + c0) : V(0);
      }
    } else {
      const int64_t iw = 2 * ow + 3 - pad;  // the next pixel's two new columns
      for (int i = 0; i < NR; ++i) {
        win[i][0] = win[i][2];
        win[i][1] = iw < W ? load(xr[i] + iw * C + c0) : V(0);
        win[i][2] = iw + 1 < W ? load(xr[i] + (iw + 1) * C + c0) : V(0);
      }
    }
  }
}

template <typename scalar_t, int S>
void dw_wgrad_nhwc(const conv::DwBackwardParams& p) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const BackwardPtrs<scalar_t> ptr(p);
  const scalar_t *x = ptr.x, *g = ptr.g, *mask = ptr.mask;
  scalar_t *gw = ptr.gw, *gb = ptr.gb;
  const int64_t C = p.C, H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, pad = p.pad;
  const int64_t rows = p.N * Ho;
  // Chunks of at least 4 rows (two passes of two), at most kNhwcChunks.
  const int64_t chunks = std::max<int64_t>(1, std::min(rows / 4, kNhwcChunks));
  const int64_t Cp = (C + L - 1) / L * L;
  const int64_t cfull = C / L * L;
  // Rows outside the image read as this row of zeros.
  const std::vector<scalar_t> zeros(W * C, scalar_t(0));
  // part[chunk][t][c], t < 9 the taps, t = 9 the bias.
  std::vector<opmath_t> part(chunks * 10 * Cp, opmath_t(0));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ch = begin; ch < end; ++ch) {
      opmath_t* pc = part.data() + ch * 10 * Cp;
      const int64_t r0 = rows * ch / chunks, r1 = rows * (ch + 1) / chunks;
      for (int64_t row = r0; row < r1;) {
        const int64_t n = row / Ho, oh = row % Ho;
        // Two output rows of one image at once where the chunk has them
        // (AVX-512: 24 of its 32 vector registers; one row elsewhere, and at
        // stride 2, where two rows would share one input row of five).
        const int R = S == 1 && kPairRows && row + 1 < r1 && oh + 1 < Ho ? 2 : 1;
        const scalar_t* xr[4];
        for (int i = 0; i < R + 2; ++i) {
          const int64_t ih = oh * S - pad + i;
          xr[i] = ih >= 0 && ih < H ? x + (n * H + ih) * W * C : zeros.data();
        }
        const scalar_t* gr[2] = {g + row * Wo * C, g + (row + 1) * Wo * C};
        const scalar_t* mr[2] = {mask ? mask + row * Wo * C : nullptr, mask ? mask + (row + 1) * Wo * C : nullptr};
        // The next pass's new input rows and grad_out (and mask) rows, asked
        // for while this pass's channel vectors are walked.
        for (int64_t q = row + R; q < std::min(r1, row + 2 * R); ++q) {
          const int64_t nn = q / Ho, ih = q % Ho * S - pad + 2;
          if (ih >= 0 && ih < H) prefetch_span(x + (nn * H + ih) * W * C, W * C);
          prefetch_span(g + q * Wo * C, Wo * C);
          if (mask) prefetch_span(mask + q * Wo * C, Wo * C);
        }
        for (int64_t c0 = 0; c0 < C; c0 += L) {
          V acc[10];
          for (int t = 0; t < 10; ++t) acc[t] = V(opmath_t(0));
          const bool full = c0 < cfull;
          const int cnt = full ? static_cast<int>(L) : static_cast<int>(C - c0);
          if (S == 1 && R == 2) {
            if (full)
              dw_wgrad_nhwc_rows<scalar_t, 2, true>(xr, gr, mr, C, W, Wo, pad, c0, cnt, acc);
            else
              dw_wgrad_nhwc_rows<scalar_t, 2, false>(xr, gr, mr, C, W, Wo, pad, c0, cnt, acc);
          } else {
            if (full)
              dw_wgrad_nhwc_rows<scalar_t, 1, true, S>(xr, gr, mr, C, W, Wo, pad, c0, cnt, acc);
            else
              dw_wgrad_nhwc_rows<scalar_t, 1, false, S>(xr, gr, mr, C, W, Wo, pad, c0, cnt, acc);
          }
          for (int t = 0; t < 10; ++t) (V::loadu(pc + t * Cp + c0) + acc[t]).store(pc + t * Cp + c0);
        }
        row += R;
      }
    }
  });
  // The chunks' partials, added in chunk order.
  at::parallel_for(0, C, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int t = 0; t < 10; ++t) {
        opmath_t s = opmath_t(0);
        for (int64_t ch = 0; ch < chunks; ++ch) s += part[(ch * 10 + t) * Cp + c];
        if (t < 9) {
          if (gw) gw[c * 9 + t] = static_cast<scalar_t>(s);
        } else if (gb) {
          gb[c] = static_cast<scalar_t>(s);
        }
      }
    }
  });
}

}  // namespace conv_detail

void conv_dw_wgrad_nchw(c10::ScalarType dtype, const conv::DwBackwardParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_wgrad_nchw", [&] {
    if (p.stride == 2) {
      conv_detail::dw_wgrad_nchw<scalar_t, 2>(p);
    } else {
      conv_detail::dw_wgrad_nchw<scalar_t, 1>(p);
    }
  });
}

void conv_dw_wgrad_nhwc(c10::ScalarType dtype, const conv::DwBackwardParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_wgrad_nhwc", [&] {
    if (p.stride == 2) {
      conv_detail::dw_wgrad_nhwc<scalar_t, 2>(p);
    } else {
      conv_detail::dw_wgrad_nhwc<scalar_t, 1>(p);
    }
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

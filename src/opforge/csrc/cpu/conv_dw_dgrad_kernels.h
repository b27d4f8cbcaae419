// Depthwise input gradient of a stride-2 convolution on the CPU (channel
// multiplier 1, NCHW or NHWC), compiled once per ISA by conv_{default,avx2,
// avx512}.cpp (helpers: cpu/conv_vec.h); cpu/conv_cpu.cpp picks the ISA at run
// time. (Stride 1 runs the forward's loop with the kernel flipped.)
//
// gx[n, c, ih, iw] = sum of g[n, c, oh, ow] * w[c, kh, kw] over 2 oh + kh =
// ih + pad and 2 ow + kw = iw + pad, with g grad_out where the ReLU passed it.
// In padded coordinates q = iw + pad, an even column q = 2j takes taps
// kw = 0 (ow = j) and kw = 2 (ow = j - 1), an odd one q = 2j + 1 the tap
// kw = 1 (ow = j); likewise a padded row takes kh = 0 and 2 or kh = 1. So
// each NCHW input row is two contiguous vector sums over one or two grad_out
// rows, even and odd columns, interleaved once on the way out: no scatter,
// and every output element is written once (work items are whole planes).
// NHWC: each input row walks its one or two grad_out rows column by column,
// each pair of output pixels written whole (channel vector by channel
// vector, weights transposed to (9, C)) in the row's order; no staging.
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

// The grad_out indices o (in [0, limit)) feeding padded index q through tap
// k, q = 2 o + k: k = 0 and 2 for an even q, k = 1 for an odd one. Returns
// how many (0 to 2); used for rows and, in NHWC, columns.
inline int stride2_sources(int64_t q, int64_t limit, int64_t (&o)[2], int (&k)[2]) {
  int m = 0;
  for (int kk = static_cast<int>(q & 1); kk < 3; kk += 2) {
    if (q >= kk && (q - kk) / 2 < limit) {
      o[m] = (q - kk) / 2;
      k[m++] = kk;
    }
  }
  return m;
}

template <typename scalar_t>
void dw_dgrad_nchw_s2(const conv::DwBackwardParams& p) {
  using IO = VecIo<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const BackwardPtrs<scalar_t> ptr(p);
  const scalar_t *g = ptr.g, *mask = ptr.mask, *w = ptr.w;
  scalar_t* gx = ptr.gx;
  const int64_t C = p.C, H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, pad = p.pad;
  // Even padded columns: E = Wo + 1 of them (the last only takes kw = 2).
  const int64_t E = Wo + 1;
  const int64_t ev = (E + L - 1) / L * L;
  // A staged grad_out row: z[0] = 0, z[1 + ow] = the passed g[ow], zeros
  // after, so that z[j] is g[j - 1] and z[1 + j] is g[j] for every j < ev.
  const int64_t zlen = ev + L + 1;
  at::parallel_for(0, p.N * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> gplane(Ho * zlen, opmath_t(0));
    std::vector<opmath_t> padded(2 * ev);
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t c = nc % C;
      const scalar_t* gp = g + nc * Ho * Wo;
      const scalar_t* mp = mask ? mask + nc * Ho * Wo : nullptr;
      for (int64_t oh = 0; oh < Ho; ++oh) {
        const scalar_t* gr = gp + oh * Wo;
        const scalar_t* mr = mp ? mp + oh * Wo : nullptr;
        opmath_t* z = gplane.data() + oh * zlen + 1;
        int64_t ow = 0;
        for (; ow + L <= Wo; ow += L) load_passed(gr + ow, mr ? mr + ow : nullptr).store(z + ow);
        if (ow < Wo)
          load_passed(gr + ow, mr ? mr + ow : nullptr, static_cast<int>(Wo - ow))
              .store(z + ow, static_cast<int>(Wo - ow));
      }
      V wv[9];
      for (int t = 0; t < 9; ++t) wv[t] = V(static_cast<opmath_t>(w[c * 9 + t]));
      scalar_t* out = gx + nc * H * W;
      for (int64_t ih = 0; ih < H; ++ih) {
        // The grad_out rows this input row takes and their taps.
        int64_t oh[2];
        int kh_of[2];
        const int rows = stride2_sources(ih + pad, Ho, oh, kh_of);
        const opmath_t* z[2];
        for (int i = 0; i < rows; ++i) z[i] = gplane.data() + oh[i] * zlen;
        // Even columns 2 j: z[1 + j] w0 + z[j] w2; odd columns 2 j + 1:
        // z[1 + j] w1; interleaved into padded[2 j], padded[2 j + 1].
        for (int64_t j = 0; j < ev; j += L) {
          V e(opmath_t(0)), od(opmath_t(0));
          for (int i = 0; i < rows; ++i) {
            const V cur = V::loadu(z[i] + 1 + j), prev = V::loadu(z[i] + j);
            const V* wk = wv + kh_of[i] * 3;
            e = at::vec::fmadd(cur, wk[0], at::vec::fmadd(prev, wk[2], e));
            od = at::vec::fmadd(cur, wk[1], od);
          }
          const auto pair = at::vec::interleave2(e, od);
          pair.first.store(padded.data() + 2 * j);
          pair.second.store(padded.data() + 2 * j + L);
        }
        scalar_t* o = out + ih * W;
        const opmath_t* src = padded.data() + pad;
        int64_t iw = 0;
        for (; iw + L <= W; iw += L) IO::store(o + iw, V::loadu(src + iw));
        if (iw < W) IO::store(o + iw, V::loadu(src + iw, static_cast<int>(W - iw)), static_cast<int>(W - iw));
      }
    }
  });
}

// One NHWC input row of grad x at stride 2, from its NR (1 or 2) grad_out
// rows gr[i] (masks mr[i], may be null) through kernel rows kh[i] of wt
// (transposed to (9, Cp)). Per grad_out column j, channel vector by channel
// vector: padded column 2 j takes g[j] w0 + g[j - 1] w2, padded column
// 2 j + 1 takes g[j] w1 (g is zero outside [0, Wo)). The two output pixels
// are written whole, one after the other, in the row's order.
template <typename scalar_t, int NR>
inline void dw_dgrad_nhwc_s2_row(const scalar_t* const* gr, const scalar_t* const* mr, const int* kh,
                                 const at::opmath_type<scalar_t>* wt, int64_t Cp, scalar_t* out, int64_t C, int64_t W,
                                 int64_t Wo, int64_t pad) {
  using IO = VecIo<scalar_t>;
  using V = at::vec::Vectorized<at::opmath_type<scalar_t>>;
  constexpr int64_t L = V::size();
  const int64_t cfull = C / L * L;
  for (int64_t j = 0; j <= Wo; ++j) {
    const int64_t ie = 2 * j - pad, io = 2 * j + 1 - pad;  // the two input columns
    const bool we = ie >= 0 && ie < W, wo = io < W;
    for (int64_t c0 = 0; c0 < C; c0 += L) {
      const bool full = c0 < cfull;
      const int n = full ? static_cast<int>(L) : static_cast<int>(C - c0);
      auto passed = [&](const scalar_t* src, const scalar_t* m) {
        return full ? load_passed(src, m) : load_passed(src, m, n);
      };
      V even(0), odd(0);
      for (int i = 0; i < NR; ++i) {
        const at::opmath_type<scalar_t>* wr = wt + kh[i] * 3 * Cp + c0;
        const int64_t o = j * C + c0;
        if (j < Wo) {
          const V cur = passed(gr[i] + o, mr[i] ? mr[i] + o : nullptr);
          even = at::vec::fmadd(cur, V::loadu(wr), even);
          odd = at::vec::fmadd(cur, V::loadu(wr + Cp), odd);
        }
        if (j > 0) {
          const V prev = passed(gr[i] + o - C, mr[i] ? mr[i] + o - C : nullptr);
          even = at::vec::fmadd(prev, V::loadu(wr + 2 * Cp), even);
        }
      }
      if (we) full ? IO::store(out + ie * C + c0, even) : IO::store(out + ie * C + c0, even, n);
      if (wo) full ? IO::store(out + io * C + c0, odd) : IO::store(out + io * C + c0, odd, n);
    }
  }
}

template <typename scalar_t>
void dw_dgrad_nhwc_s2(const conv::DwBackwardParams& p) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = at::vec::Vectorized<opmath_t>;
  constexpr int64_t L = V::size();
  const BackwardPtrs<scalar_t> ptr(p);
  const scalar_t *g = ptr.g, *mask = ptr.mask, *w = ptr.w;
  scalar_t* gx = ptr.gx;
  const int64_t C = p.C, H = p.H, W = p.W, Ho = p.Ho, Wo = p.Wo, pad = p.pad;
  const int64_t Cp = (C + L - 1) / L * L;
  std::vector<opmath_t> wt(9 * Cp, opmath_t(0));  // wt[t * Cp + c] = w[c, t]
  for (int64_t c = 0; c < C; ++c)
    for (int t = 0; t < 9; ++t) wt[t * Cp + c] = static_cast<opmath_t>(w[c * 9 + t]);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, W * C));
  at::parallel_for(0, p.N * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / H, ih = row % H;
      int64_t oh[2];
      int kh[2];
      const int nr = stride2_sources(ih + pad, Ho, oh, kh);
      scalar_t* out = gx + row * W * C;
      if (nr == 0) {  // a padded row no output row reads
        std::fill(out, out + W * C, scalar_t(0));
        continue;
      }
      const scalar_t* gr[2];
      const scalar_t* mr[2];
      for (int i = 0; i < nr; ++i) {
        const int64_t off = (n * Ho + oh[i]) * Wo * C;
        gr[i] = g + off;
        mr[i] = mask ? mask + off : nullptr;
      }
      if (nr == 2) {
        dw_dgrad_nhwc_s2_row<scalar_t, 2>(gr, mr, kh, wt.data(), Cp, out, C, W, Wo, pad);
      } else {
        dw_dgrad_nhwc_s2_row<scalar_t, 1>(gr, mr, kh, wt.data(), Cp, out, C, W, Wo, pad);
      }
    }
  });
}

}  // namespace conv_detail

void conv_dw_dgrad_nhwc_s2(c10::ScalarType dtype, const conv::DwBackwardParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_dgrad_nhwc_s2", [&] { conv_detail::dw_dgrad_nhwc_s2<scalar_t>(p); });
}

void conv_dw_dgrad_nchw_s2(c10::ScalarType dtype, const conv::DwBackwardParams& p) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_dw_dgrad_nchw_s2", [&] { conv_detail::dw_dgrad_nchw_s2<scalar_t>(p); });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

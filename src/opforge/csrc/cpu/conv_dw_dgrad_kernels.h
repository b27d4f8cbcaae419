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
// NHWC: each input row first passes its one or two grad_out rows into an
// opmath buffer, then, per channel vector with its 9 weight vectors in
// registers (weights transposed to (9, C)), each pixel sums its 1, 2 or 4
// taps.
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

template <typename scalar_t>
void dw_dgrad_nhwc_s2(const conv::DwBackwardParams& p) {
  using IO = VecIo<scalar_t>;
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
    // An input row's one or two grad_out rows, passed and in opmath, each
    // pixel's channels padded to Cp (zeros past C).
    std::vector<opmath_t> buf(2 * Wo * Cp, opmath_t(0));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / H, ih = row % H;
      int64_t oh[2], ow[2];
      int kh[2], kw[2];
      const int nr = stride2_sources(ih + pad, Ho, oh, kh);
      for (int i = 0; i < nr; ++i) {
        const int64_t off = (n * Ho + oh[i]) * Wo * C;
        for (int64_t o = 0; o < Wo; ++o) {
          for (int64_t c0 = 0; c0 < C; c0 += L) {
            const int64_t at_g = off + o * C + c0;
            const scalar_t* mp = mask ? mask + at_g : nullptr;
            const V gv = c0 + L <= C ? load_passed(g + at_g, mp) : load_passed(g + at_g, mp, static_cast<int>(C - c0));
            gv.store(buf.data() + (i * Wo + o) * Cp + c0);
          }
        }
      }
      scalar_t* out = gx + row * W * C;
      for (int64_t c0 = 0; c0 < C; c0 += L) {
        const int cnt = static_cast<int>(std::min<int64_t>(L, C - c0));
        V wk[9];
        for (int t = 0; t < 9; ++t) wk[t] = V::loadu(wt.data() + t * Cp + c0);
        for (int64_t iw = 0; iw < W; ++iw) {
          const int nc = stride2_sources(iw + pad, Wo, ow, kw);
          V acc(opmath_t(0));
          for (int i = 0; i < nr; ++i) {
            const opmath_t* b = buf.data() + i * Wo * Cp + c0;
            for (int j = 0; j < nc; ++j) acc = at::vec::fmadd(V::loadu(b + ow[j] * Cp), wk[kh[i] * 3 + kw[j]], acc);
          }
          if (cnt == L) {
            IO::store(out + iw * C + c0, acc);
          } else {
            IO::store(out + iw * C + c0, acc, cnt);
          }
        }
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

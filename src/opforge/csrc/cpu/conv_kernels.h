// Loops of the conv family, compiled once per ISA by conv_cpu_{default,avx2,avx512}.cpp
// (which include cpu_isa_begin.h first); cpu/conv.cpp picks the ISA at run time.
//
// - depthwise forward, NCHW: per (image, input channel) the padded plane is
//   converted once to opmath (stride 2: each row split into even and odd
//   columns so every tap is a contiguous vector load), then each output row
//   is 9 vector FMAs along W starting from the bias (float/double stride 1:
//   two rows per pass, sharing loads), ReLU and one rounding on the store.
//   Channel multipliers reuse the plane.
// - depthwise forward, NHWC: per output row and channel vector, vectorised
//   along the channels with the 9 weight vectors in registers.
// - bias_act: the dense path's epilogue, run on each GEMM result tile while
//   it is in cache (bias per row or per column, optional ReLU, one rounding).
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

template <typename T>
inline at::vec::Vectorized<T> relu_vec(const at::vec::Vectorized<T>& a) {
  using V = at::vec::Vectorized<T>;
  return V::blendv(a, V(T(0)), a < V(T(0)));  // NaN stays NaN, as torch.relu
}

template <typename T>
inline T relu_scalar(T a) {
  return a < T(0) ? T(0) : a;
}

template <typename scalar_t>
void dw_nchw(const conv::DwParams& p) {
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
  const int64_t rowlen = Wp + L;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H * W * m));
  at::parallel_for(0, p.N * p.C, grain, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> plane(Hp * rowlen, opmath_t(0));
    std::vector<opmath_t> acc(Wo + L);
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t n = nc / p.C, c = nc % p.C;
      const scalar_t* xp = x + nc * H * W;
      for (int64_t r = 0; r < Hp; ++r) {
        opmath_t* row = plane.data() + r * rowlen;
        const int64_t ih = r - pad;
        if (ih < 0 || ih >= H) {
          std::fill(row, row + rowlen, opmath_t(0));
          continue;
        }
        const scalar_t* xr = xp + ih * W;
        if (s == 1) {
          if (pad) row[0] = row[Wp - 1] = opmath_t(0);
          for (int64_t iw = 0; iw < W; ++iw) row[iw + pad] = static_cast<opmath_t>(xr[iw]);
        } else {
          for (int64_t q = 0; q < Wp; ++q) {
            const int64_t iw = q - pad;
            const opmath_t v = (iw >= 0 && iw < W) ? static_cast<opmath_t>(xr[iw]) : opmath_t(0);
            row[(q & 1) ? E + (q >> 1) : (q >> 1)] = v;
          }
        }
      }
      for (int64_t j = 0; j < m; ++j) {
        const int64_t k = c * m + j;
        opmath_t wk[9];
        for (int t = 0; t < 9; ++t) wk[t] = static_cast<opmath_t>(w[k * 9 + t]);
        const opmath_t bk = b ? static_cast<opmath_t>(b[k]) : opmath_t(0);
        scalar_t* op = out + (n * p.K + k) * Ho * Wo;
        V wv[9];
        for (int t = 0; t < 9; ++t) wv[t] = V(wk[t]);
        for (int64_t oh = 0; oh < Ho; ++oh) {
          if constexpr (std::is_same_v<scalar_t, opmath_t>) {
            if (s == 1 && oh + 1 < Ho) {
              // Two output rows at once from four staged rows: each loaded
              // vector feeds both rows' accumulators (12 loads per 2 outputs).
              const opmath_t* R[4];
              for (int rr = 0; rr < 4; ++rr) R[rr] = plane.data() + (oh + rr) * rowlen;
              scalar_t* o0 = op + oh * Wo;
              scalar_t* o1 = o0 + Wo;
              for (int64_t ow = 0; ow < Wo; ow += L) {
                V a0(bk), a1(bk);
                for (int rr = 0; rr < 4; ++rr) {
                  const V x0 = V::loadu(R[rr] + ow), x1 = V::loadu(R[rr] + ow + 1), x2 = V::loadu(R[rr] + ow + 2);
                  if (rr < 3) {
                    a0 = at::vec::fmadd(wv[rr * 3], x0, a0);
                    a0 = at::vec::fmadd(wv[rr * 3 + 1], x1, a0);
                    a0 = at::vec::fmadd(wv[rr * 3 + 2], x2, a0);
                  }
                  if (rr > 0) {
                    a1 = at::vec::fmadd(wv[rr * 3 - 3], x0, a1);
                    a1 = at::vec::fmadd(wv[rr * 3 - 2], x1, a1);
                    a1 = at::vec::fmadd(wv[rr * 3 - 1], x2, a1);
                  }
                }
                if (p.relu) {
                  a0 = relu_vec(a0);
                  a1 = relu_vec(a1);
                }
                const int64_t rem = Wo - ow;
                if (rem >= L) {
                  a0.store(o0 + ow);
                  a1.store(o1 + ow);
                } else {
                  a0.store(o0 + ow, static_cast<int>(rem));
                  a1.store(o1 + ow, static_cast<int>(rem));
                }
              }
              ++oh;
              continue;
            }
          }
          const opmath_t* taps[9];
          for (int kh = 0; kh < 3; ++kh) {
            const opmath_t* row = plane.data() + (oh * s + kh) * rowlen;
            if (s == 1) {
              taps[kh * 3 + 0] = row;
              taps[kh * 3 + 1] = row + 1;
              taps[kh * 3 + 2] = row + 2;
            } else {
              taps[kh * 3 + 0] = row;
              taps[kh * 3 + 1] = row + E;
              taps[kh * 3 + 2] = row + 1;
            }
          }
          scalar_t* orow = op + oh * Wo;
          int64_t ow = 0;
          for (; ow + L <= Wo; ow += L) {
            V a(bk);
            for (int t = 0; t < 9; ++t) a = at::vec::fmadd(wv[t], V::loadu(taps[t] + ow), a);
            if (p.relu) a = relu_vec(a);
            if constexpr (std::is_same_v<scalar_t, opmath_t>) {
              a.store(orow + ow);
            } else {
              a.store(acc.data() + ow);
              for (int64_t i = 0; i < L; ++i) orow[ow + i] = static_cast<scalar_t>(acc[ow + i]);
            }
          }
          if (ow < Wo) {
            // Tail: full-width loads stay inside the row's slack (rowlen = Wp + L),
            // only Wo - ow values are stored.
            const int64_t rem = Wo - ow;
            V a(bk);
            for (int t = 0; t < 9; ++t) a = at::vec::fmadd(wv[t], V::loadu(taps[t] + ow), a);
            if (p.relu) a = relu_vec(a);
            if constexpr (std::is_same_v<scalar_t, opmath_t>) {
              a.store(orow + ow, static_cast<int>(rem));
            } else {
              a.store(acc.data() + ow);
              for (int64_t i = 0; i < rem; ++i) orow[ow + i] = static_cast<scalar_t>(acc[ow + i]);
            }
          }
        }
      }
    }
  });
}

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
  // Weights transposed to (9, K) and the bias, in opmath.
  std::vector<opmath_t> wt(9 * K), bias(K, opmath_t(0));
  for (int64_t k = 0; k < K; ++k) {
    for (int t = 0; t < 9; ++t) wt[t * K + k] = static_cast<opmath_t>(w[k * 9 + t]);
    if (b) bias[k] = static_cast<opmath_t>(b[k]);
  }
  constexpr bool kSame = std::is_same_v<scalar_t, opmath_t>;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, Wo * K));
  at::parallel_for(0, p.N * Ho, grain, [&](int64_t begin, int64_t end) {
    // Up to three input rows (converted to opmath for half types) and one
    // output pixel's accumulators.
    std::vector<opmath_t> rows(kSame ? 0 : 3 * W * C);
    std::vector<opmath_t> acc(K + L);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = r / Ho, oh = r % Ho;
      const opmath_t* xrow[3];
      for (int kh = 0; kh < 3; ++kh) {
        const int64_t ih = oh * s - pad + kh;
        if (ih < 0 || ih >= H) {
          xrow[kh] = nullptr;
          continue;
        }
        const scalar_t* src = x + ((n * H + ih) * W) * C;
        if constexpr (kSame) {
          xrow[kh] = src;
        } else {
          opmath_t* dst = rows.data() + kh * W * C;
          for (int64_t i = 0; i < W * C; ++i) dst[i] = static_cast<opmath_t>(src[i]);
          xrow[kh] = dst;
        }
      }
      scalar_t* orow = out + ((n * Ho + oh) * Wo) * K;
      int64_t k0 = 0;
      if (m == 1) {
        // One channel vector at a time along the whole row: its 9 weight
        // vectors stay in registers, each output is 9 FMAs from the bias.
        for (; k0 + L <= K; k0 += L) {
          V wv[9];
          for (int t = 0; t < 9; ++t) wv[t] = V::loadu(wt.data() + t * K + k0);
          const V bv = V::loadu(bias.data() + k0);
          for (int64_t ow = 0; ow < Wo; ++ow) {
            const int64_t iw0 = ow * s - pad;
            V a = bv;
            for (int kh = 0; kh < 3; ++kh) {
              if (!xrow[kh]) continue;
              const opmath_t* xr = xrow[kh] + k0;
              for (int kw = 0; kw < 3; ++kw) {
                const int64_t iw = iw0 + kw;
                if (iw < 0 || iw >= W) continue;
                a = at::vec::fmadd(wv[kh * 3 + kw], V::loadu(xr + iw * C), a);
              }
            }
            if (p.relu) a = relu_vec(a);
            scalar_t* o = orow + ow * K + k0;
            if constexpr (kSame) {
              a.store(o);
            } else {
              a.store(acc.data());
              for (int64_t q = 0; q < L; ++q) o[q] = static_cast<scalar_t>(acc[q]);
            }
          }
        }
      }
      if (k0 < K) {
        // Remaining channels (fewer than a vector, or a channel multiplier > 1).
        for (int64_t ow = 0; ow < Wo; ++ow) {
          std::copy(bias.begin() + k0, bias.end(), acc.begin() + k0);
          for (int kh = 0; kh < 3; ++kh) {
            if (!xrow[kh]) continue;
            for (int kw = 0; kw < 3; ++kw) {
              const int64_t iw = ow * s - pad + kw;
              if (iw < 0 || iw >= W) continue;
              const opmath_t* xi = xrow[kh] + iw * C;
              const opmath_t* wv = wt.data() + (kh * 3 + kw) * K;
              for (int64_t k = k0; k < K; ++k) acc[k] += wv[k] * xi[k / m];
            }
          }
          scalar_t* o = orow + ow * K;
          for (int64_t k = k0; k < K; ++k) o[k] = static_cast<scalar_t>(p.relu ? relu_scalar(acc[k]) : acc[k]);
        }
      }
    }
  });
}

// dst (rows, cols; row stride dst_stride) = act(src + bias); src is the
// GEMM's contiguous opmath tile. This is the dense path's final write.
template <typename scalar_t>
void bias_act(const void* src_, void* dst_, const void* bias_, int64_t rows, int64_t cols, int64_t dst_stride,
              bool bias_per_row, bool relu) {
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
        if (relu) a = relu_vec(a);
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
        out[j] = static_cast<scalar_t>(relu ? relu_scalar(a) : a);
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
                   int64_t dst_stride, bool bias_per_row, bool relu) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv_bias_act", [&] {
    conv_detail::bias_act<scalar_t>(src, dst, bias, rows, cols, dst_stride, bias_per_row, relu);
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

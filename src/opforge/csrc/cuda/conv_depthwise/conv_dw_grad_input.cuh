// Depthwise grad x kernels: the general gather (any stride and multiplier)
// and the row kernels of stride 1, multiplier 1, with the ReLU mask applied
// as grad_out is read. (Stride 1 mostly runs the forward's staged kernels on
// the masked gradient instead: conv_dw.cpp.)
#pragma once

#include "cuda/conv_depthwise/conv_dw_device.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

// One thread per element of grad x (in x's layout order):
// gx[n,c,ih,iw] = sum_j sum_{kh,kw} g'[n, c*m+j, oh, ow] * w[c*m+j, kh, kw]
// where oh*S = ih + pad - kh, ow*S = iw + pad - kw, g' = g * (result > 0).
// IT is int32_t when every index fits (64-bit divisions are subroutine calls
// whose saved registers spill), else int64_t. At most 64 registers (four
// blocks per SM): ptxas's own choice of 32-48 spilled.
template <typename scalar_t, bool kNhwc, typename IT>
__global__ void __launch_bounds__(kThreads, 4)
    dw_bwd_input(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res, const scalar_t* __restrict__ w,
                 scalar_t* __restrict__ gx, DwArgs a, int S, IT total) {
  using opmath_t = at::opmath_type<scalar_t>;
  const IT C = static_cast<IT>(a.C), H = static_cast<IT>(a.H), W = static_cast<IT>(a.W);
  const IT K = static_cast<IT>(a.K), Ho = static_cast<IT>(a.Ho), Wo = static_cast<IT>(a.Wo);
  const IT pad = a.pad, mult = a.mult, stride = S;
  const IT step = static_cast<IT>(gridDim.x) * blockDim.x;
  for (IT idx = static_cast<IT>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    IT n, c, ih, iw, rem = idx;
    if (kNhwc) {
      c = rem % C;
      rem /= C;
      iw = rem % W;
      rem /= W;
      ih = rem % H;
      n = rem / H;
    } else {
      iw = rem % W;
      rem /= W;
      ih = rem % H;
      rem /= H;
      c = rem % C;
      n = rem / C;
    }
    opmath_t acc = opmath_t(0);
    for (int kh = 0; kh < 3; ++kh) {
      const IT th = ih + pad - kh;
      if (th < 0 || th % stride != 0) continue;
      const IT oh = th / stride;
      if (oh >= Ho) continue;
      for (int kw = 0; kw < 3; ++kw) {
        const IT tw = iw + pad - kw;
        if (tw < 0 || tw % stride != 0) continue;
        const IT ow = tw / stride;
        if (ow >= Wo) continue;
        for (IT j = 0; j < mult; ++j) {
          const IT k = c * mult + j;
          const IT off = kNhwc ? ((n * Ho + oh) * Wo + ow) * K + k : ((n * K + k) * Ho + oh) * Wo + ow;
          acc += masked_grad<opmath_t>(g, res, off) * static_cast<opmath_t>(w[k * 9 + kh * 3 + kw]);
        }
      }
    }
    gx[idx] = static_cast<scalar_t>(acc);
  }
}

// Stride 1, multiplier 1 (K == C): grad x is the depthwise convolution of
// g' = g * (result > 0) with the kernel flipped,
// gx[n, c, ih, iw] = sum_{kh, kw} g'[n, c, ih + pad - kh, iw + pad - kw] * w[c, kh, kw]
// (zero outside the output image), computed a row at a time with one
// division per row instead of the general kernel's per-element index
// arithmetic (64-bit divisions are subroutine calls).
// NCHW: warps take the N * C * H rows of grad x in turn, lanes along iw
// (coalesced); the 9 taps read grad_out and result through L1.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    dw_bwd_input_s1_nchw(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                         const scalar_t* __restrict__ w, scalar_t* __restrict__ gx, DwArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t rows = a.N * a.C * a.H;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t plane = r / a.H, ih = r - plane * a.H;
    const int64_t c = plane % a.C;
    opmath_t wk[9];
#pragma unroll
    for (int t = 0; t < 9; ++t) wk[t] = static_cast<opmath_t>(w[c * 9 + t]);
    const int64_t gplane = plane * a.Ho * a.Wo;
    for (int64_t iw = lane; iw < a.W; iw += 32) {
      opmath_t acc = opmath_t(0);
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        const int64_t oh = ih + a.pad - kh;
        if (oh < 0 || oh >= a.Ho) continue;
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) {
          const int64_t ow = iw + a.pad - kw;
          if (ow >= 0 && ow < a.Wo) acc += masked_grad<opmath_t>(g, res, gplane + oh * a.Wo + ow) * wk[kh * 3 + kw];
        }
      }
      gx[r * a.W + iw] = static_cast<scalar_t>(acc);
    }
  }
}

// NHWC: block (chunk of 32 channels, split of the N * H rows);
// threadIdx.x is the channel (coalesced along C), threadIdx.y takes rows
// y, y + 8, ... of the split and walks each along iw with the 3 x 3 window
// of g' in registers (one new column of three output rows per step).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 2)
    dw_bwd_input_s1_nhwc(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                         const scalar_t* __restrict__ w, scalar_t* __restrict__ gx, DwArgs a, int64_t rows_per_split) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  if (c >= a.C) return;  // no block barrier below
  const int64_t rows = a.N * a.H;
  const int64_t begin = blockIdx.y * rows_per_split;
  const int64_t end = begin + rows_per_split < rows ? begin + rows_per_split : rows;
  opmath_t wk[9];
#pragma unroll
  for (int t = 0; t < 9; ++t) wk[t] = static_cast<opmath_t>(w[c * 9 + t]);
  for (int64_t row = begin + threadIdx.y; row < end; row += blockDim.y) {
    const int64_t n = row / a.H, ih = row - n * a.H;
    int64_t base[3];  // offset of output row ih + pad - kh, column 0, channel c
    bool ok[3];
#pragma unroll
    for (int kh = 0; kh < 3; ++kh) {
      const int64_t oh = ih + a.pad - kh;
      ok[kh] = oh >= 0 && oh < a.Ho;
      base[kh] = (n * a.Ho + (ok[kh] ? oh : 0)) * a.Wo * a.C + c;
    }
    auto tap = [&](int kh, int64_t ow) {
      return ok[kh] && ow >= 0 && ow < a.Wo ? masked_grad<opmath_t>(g, res, base[kh] + ow * a.C) : opmath_t(0);
    };
    opmath_t win[3][3];  // win[kh][kw] = g'(ih + pad - kh, iw + pad - kw)
#pragma unroll
    for (int kh = 0; kh < 3; ++kh)
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) win[kh][kw] = tap(kh, a.pad - kw);
    scalar_t* out = gx + row * a.W * a.C + c;
    for (int64_t iw = 0; iw < a.W; ++iw) {
      opmath_t acc = opmath_t(0);
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) acc += win[kh][kw] * wk[kh * 3 + kw];
      out[iw * a.C] = static_cast<scalar_t>(acc);
      // iw + 1 reads columns one further: kw = 2 takes kw = 1's, 1 takes 0's.
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        win[kh][2] = win[kh][1];
        win[kh][1] = win[kh][0];
        win[kh][0] = tap(kh, iw + 1 + a.pad);
      }
    }
  }
}

}  // namespace
}  // namespace opforge::conv

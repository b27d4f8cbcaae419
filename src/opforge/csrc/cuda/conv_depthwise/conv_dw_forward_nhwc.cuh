// Depthwise forward kernels, NHWC: the general one (any stride and channel
// multiplier) and the staged stride-1 one.
#pragma once

#include "cuda/conv_depthwise/conv_dw_stage.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

template <int S>
struct NhwcTile {
  static constexpr int OH = S == 1 ? 8 : 4, OW = 8;
  static constexpr int IH = (OH - 1) * S + 3, IW = (OW - 1) * S + 3;
};

template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads)
    dw_fwd_nhwc(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                scalar_t* __restrict__ out, DwArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  using T = NhwcTile<S>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int cb = a.cb;                                     // staged input channels (multiple of V)
  const int kb = cb * a.mult;                              // output channels of the chunk
  opmath_t* tile = reinterpret_cast<opmath_t*>(smem_raw);  // [IH][IW][cb]
  opmath_t* ws = tile + T::IH * T::IW * cb;                // [9][kb]
  opmath_t* bs = ws + 9 * kb;                              // [kb]

  unsigned bid = blockIdx.x;  // 32-bit decode, as in the NCHW kernel
  const int chunk = static_cast<int>(bid % static_cast<unsigned>(a.chunks));
  bid /= static_cast<unsigned>(a.chunks);
  const int tw = static_cast<int>(bid % static_cast<unsigned>(a.tiles_w));
  bid /= static_cast<unsigned>(a.tiles_w);
  const int th = static_cast<int>(bid % static_cast<unsigned>(a.tiles_h));
  const int64_t n = bid / static_cast<unsigned>(a.tiles_h);
  const int64_t C = a.C, K = a.K, H = a.H, W = a.W;
  const int64_t cin0 = static_cast<int64_t>(chunk) * cb;
  const int cba = static_cast<int>(C - cin0 < cb ? C - cin0 : cb);  // channels in this chunk
  const int kba = cba * a.mult;
  const int64_t k0 = cin0 * a.mult;
  const int oh0 = th * T::OH, ow0 = tw * T::OW;
  const int64_t ih0 = static_cast<int64_t>(oh0) * S - a.pad, iw0 = static_cast<int64_t>(ow0) * S - a.pad;

  for (int i = threadIdx.x; i < 10 * kba; i += blockDim.x) {
    if (i < 9 * kba) {
      const int t = i / kba, kk = i % kba;
      ws[t * kb + kk] = static_cast<opmath_t>(w[(k0 + kk) * 9 + t]);
    } else {
      const int kk = i - 9 * kba;
      bs[kk] = b ? static_cast<opmath_t>(b[k0 + kk]) : opmath_t(0);
    }
  }
  const int cvec = cba / V;
  for (int i = threadIdx.x; i < T::IH * T::IW * cvec; i += blockDim.x) {
    const int v = i % cvec, pix = i / cvec;
    const int r = pix / T::IW, q = pix % T::IW;
    const int64_t ih = ih0 + r, iw = iw0 + q;
    opmath_t* dst = tile + pix * cb + v * V;
    opmath_t o[V];
    if (ih >= 0 && ih < H && iw >= 0 && iw < W) {
      const auto val =
          *reinterpret_cast<const AlignedVec<scalar_t, V>*>(x + ((n * H + ih) * W + iw) * C + cin0 + v * V);
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = static_cast<opmath_t>(val.val[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) o[e] = opmath_t(0);
    }
    SmemVec<opmath_t, V>::store(o, dst);
  }
  __syncthreads();

  const int kvec = kba / V;
  for (int i = threadIdx.x; i < T::OH * T::OW * kvec; i += blockDim.x) {
    const int g = i % kvec, pix = i / kvec;
    const int r = pix / T::OW, q = pix % T::OW;
    const int64_t oh = oh0 + r, ow = ow0 + q;
    if (oh >= a.Ho || ow >= a.Wo) continue;
    const int kk0 = g * V;
    opmath_t acc[V];
#pragma unroll
    for (int e = 0; e < V; ++e) acc[e] = bs[kk0 + e];
#pragma unroll
    for (int kh = 0; kh < 3; ++kh) {
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) {
        const opmath_t* src = tile + ((r * S + kh) * T::IW + q * S + kw) * cb;
        opmath_t wv[V];
        SmemVec<opmath_t, V>::load(ws + (kh * 3 + kw) * kb + kk0, wv);
        if (a.mult == 1) {
          opmath_t xv[V];
          SmemVec<opmath_t, V>::load(src + kk0, xv);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += wv[e] * xv[e];
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += wv[e] * src[(kk0 + e) / a.mult];
        }
      }
    }
    AlignedVec<scalar_t, V> res;
#pragma unroll
    for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(apply_activation(acc[e], a.act));
    *reinterpret_cast<AlignedVec<scalar_t, V>*>(out + ((n * a.Ho + oh) * a.Wo + ow) * K + k0 + kk0) = res;
  }
}

// NHWC, stride 1, multiplier 1, C % 4 == 0. A tile is (BH + 2) x (TW + 2)
// input pixels x CB channels staged in shared memory (input dtype, copies of
// LB bytes along C, zeros outside the image). Each thread owns 4 consecutive
// channels of one output column and slides down the tile's BH rows with the
// 36 weights, one staged row and two partial sums in registers (three 4-wide
// shared loads per output row), storing 4 channels at once. One tile per
// block, as in the NCHW kernel above.
// (Arguments: DwS1NhwcArgs, conv_dw.h.)

template <typename scalar_t, int PAD, int LB>
__global__ void __launch_bounds__(kThreads)
    dw_fwd_nhwc_s1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                   scalar_t* __restrict__ out, DwS1NhwcArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const scalar_t* tile = reinterpret_cast<const scalar_t*>(smem_raw);
  const DwS1NhwcTile tt = dw_s1_nhwc_tile(a, blockIdx.x);
  dw_s1_nhwc_stage<scalar_t, PAD, LB>(x, reinterpret_cast<scalar_t*>(smem_raw), a, tt);

  // One item (4 channels x 1 output column) per thread: the host launches at
  // least CB / 4 * TW threads. The item's weights and bias are read while the
  // stage is in flight, so that their latency overlaps the copies' instead of
  // following it.
  constexpr int V = 4;
  const int cvn = tt.cba / V;
  const bool active = static_cast<int>(threadIdx.x) < cvn * tt.bw;
  const int cv = static_cast<int>(threadIdx.x) % cvn, q = static_cast<int>(threadIdx.x) / cvn;
  const int c0 = tt.cin0 + cv * V;
  float wr[9][V], bv[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
#pragma unroll
    for (int t = 0; t < 9; ++t) wr[t][e] = active ? static_cast<float>(w[static_cast<int64_t>(c0 + e) * 9 + t]) : 0.f;
    bv[e] = active && b != nullptr ? static_cast<float>(b[c0 + e]) : 0.f;
  }
  const int rstep = (a.TW + 2) * a.CB;
  const scalar_t* s = tile + q * a.CB + cv * V;  // staged row 0, column q
  scalar_t* o = out + ((tt.n * a.Ho + tt.oh0) * a.Wo + tt.ow0 + q) * static_cast<int64_t>(a.C) + c0;
  const int64_t ostep = static_cast<int64_t>(a.Wo) * a.C;
  auto load_row = [&](const scalar_t* sp, float (&r)[3][V]) {
#pragma unroll
    for (int kw = 0; kw < 3; ++kw) widen4(sp + kw * a.CB, r[kw]);
  };
  // Rolling accumulators: staged row ri completes output row ri - 2 (kernel
  // row 2), continues ri - 1 (row 1) and starts ri (row 0), so only one
  // input row and two partial sums are live.
  auto fma_row = [&](const float (&xr)[3][V], int kh, float (&acc)[V]) {
#pragma unroll
    for (int e = 0; e < V; ++e)
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) acc[e] = fmaf(wr[kh * 3 + kw][e], xr[kw][e], acc[e]);
  };
  copy_async_wait_all();  // this thread's copies have landed
  __syncthreads();        // and every thread's
  if (!active) return;
  float xr[3][V], accP[V], accQ[V];
  load_row(s, xr);
#pragma unroll
  for (int e = 0; e < V; ++e) accP[e] = bv[e];
  fma_row(xr, 0, accP);
  load_row(s + rstep, xr);
  fma_row(xr, 1, accP);
#pragma unroll
  for (int e = 0; e < V; ++e) accQ[e] = bv[e];
  fma_row(xr, 0, accQ);
  s += 2 * rstep;
#pragma unroll 2
  for (int r = 0; r < tt.bh; ++r) {
    load_row(s, xr);
    s += rstep;
    fma_row(xr, 2, accP);
    *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = narrow4<scalar_t>(accP, a.act);
    o += ostep;
#pragma unroll
    for (int e = 0; e < V; ++e) accP[e] = accQ[e];
    fma_row(xr, 1, accP);
#pragma unroll
    for (int e = 0; e < V; ++e) accQ[e] = bv[e];
    fma_row(xr, 0, accQ);
  }
}

}  // namespace
}  // namespace opforge::conv

namespace opforge::conv {
namespace {

// NHWC without an input stage (multiplier 1): each thread computes V
// consecutive channels of one output pixel from its 3x3 input pixels, read
// as V-wide vectors; consecutive threads take consecutive channel vectors,
// then pixels, so a warp's loads are contiguous runs along C, and the
// pixels the windows share are served by L1. The weights and bias are
// staged once per block, tap-major ([10][C], opmath), so a thread reads its
// V weights of a tap as consecutive words. (Arguments: DwDirectArgs with
// ngw = C / V.)
template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads)
    dw_fwd_nhwc_direct(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                       scalar_t* __restrict__ out, DwDirectArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  opmath_t* ws = reinterpret_cast<opmath_t*>(smem_raw);
  const int C = static_cast<int>(a.C);
  for (int i = threadIdx.x; i < 10 * C; i += blockDim.x) {
    const int t = i / C, c = i % C;
    ws[i] = t < 9 ? static_cast<opmath_t>(w[c * 9 + t]) : (b != nullptr ? static_cast<opmath_t>(b[c]) : opmath_t(0));
  }
  __syncthreads();
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.items) return;
  // 32-bit decode (items below 2^31): item = ((n * Ho + oh) * Wo + ow) * ngw + channel vector.
  const int c = static_cast<int>(i % a.ngw) * V;
  const unsigned pix = i / a.ngw;
  const int ow = static_cast<int>(pix % static_cast<unsigned>(a.Wo));
  const unsigned rest = pix / static_cast<unsigned>(a.Wo);
  const int oh = static_cast<int>(rest % a.Ho);
  const int64_t n = rest / a.Ho;
  opmath_t acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = ws[9 * C + c + e];
#pragma unroll
  for (int kh = 0; kh < 3; ++kh) {
    const int ih = oh * S - a.pad + kh;
    if (ih < 0 || ih >= a.H) continue;
#pragma unroll
    for (int kw = 0; kw < 3; ++kw) {
      const int iw = ow * S - a.pad + kw;
      if (iw < 0 || iw >= a.W) continue;
      const auto v = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(x + ((n * a.H + ih) * a.W + iw) * C + c);
      const opmath_t* wt = ws + (kh * 3 + kw) * C + c;
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += wt[e] * static_cast<opmath_t>(v.val[e]);
    }
  }
  AlignedVec<scalar_t, V> res;
#pragma unroll
  for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(activate(acc[e], a.act));
  *reinterpret_cast<AlignedVec<scalar_t, V>*>(out + static_cast<int64_t>(pix) * C + c) = res;
}

}  // namespace
}  // namespace opforge::conv

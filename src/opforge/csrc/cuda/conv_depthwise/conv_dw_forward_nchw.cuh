// Depthwise forward kernels, NCHW: the general one (any stride and channel
// multiplier) and the staged stride-1 one.
#pragma once

#include "cuda/conv_depthwise/conv_dw_stage.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

// (kThreads, 1): with no minimum, ptxas held the float64 instantiations to 48
// registers and spilled.
template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads, 1)
    dw_fwd_nchw(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                scalar_t* __restrict__ out, DwArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  opmath_t* tile = reinterpret_cast<opmath_t*>(smem_raw);
  opmath_t* ws = tile + static_cast<int64_t>(a.tih) * a.pitch;  // mult * 9 weights, then mult biases

  // 32-bit decode (the host checks the grid fits in int32): 64-bit divisions
  // are subroutine calls.
  unsigned bid = blockIdx.x;
  const int tw = static_cast<int>(bid % static_cast<unsigned>(a.tiles_w));
  bid /= static_cast<unsigned>(a.tiles_w);
  const int th = static_cast<int>(bid % static_cast<unsigned>(a.tiles_h));
  const unsigned nc32 = bid / static_cast<unsigned>(a.tiles_h);
  const int64_t nc = nc32;
  const int64_t n = nc32 / static_cast<unsigned>(a.C), c = nc32 % static_cast<unsigned>(a.C);
  const int64_t H = a.H, W = a.W;
  const int oh0 = th * a.toh, ow0 = tw * a.tow;
  const int toh = min(a.toh, static_cast<int>(a.Ho - oh0));
  const int tow = min(a.tow, static_cast<int>(a.Wo - ow0));
  const int tih = (toh - 1) * S + 3;
  const int tiw = (a.tow - 1) * S + 3;  // staged width (columns past the image are zeros)
  const int64_t ih0 = static_cast<int64_t>(oh0) * S - a.pad;
  const int64_t iw0 = static_cast<int64_t>(ow0) * S - a.pad;
  const scalar_t* xp = x + nc * H * W;

  // Weights and biases of this input channel's outputs.
  for (int i = threadIdx.x; i < a.mult * 10; i += blockDim.x) {
    if (i < a.mult * 9) {
      ws[i] = static_cast<opmath_t>(w[c * a.mult * 9 + i]);
    } else {
      const int j = i - a.mult * 9;
      ws[i] = b ? static_cast<opmath_t>(b[c * a.mult + j]) : opmath_t(0);
    }
  }

  // Stage the input tile: aligned interior columns [c0, c1) by V-wide loads,
  // the rest (halo, zeros past the border) one by one.
  int64_t c0 = iw0 > 0 ? iw0 : 0;
  c0 = (c0 + V - 1) / V * V;
  int64_t c1 = (iw0 + tiw < W ? iw0 + tiw : W) / V * V;
  int nvec = c1 > c0 ? static_cast<int>((c1 - c0) / V) : 0;
  if (nvec == 0) c0 = c1 = iw0;
  const int lead = static_cast<int>(c0 - iw0);
  const int nscalar = tiw - nvec * V;
  for (int i = threadIdx.x; i < tih * nvec; i += blockDim.x) {
    const int r = i / nvec, v = i % nvec;
    const int64_t ih = ih0 + r;
    opmath_t* dst = tile + r * a.pitch + lead + v * V;
    if (ih >= 0 && ih < H) {
      const auto val = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(xp + ih * W + c0 + v * V);
#pragma unroll
      for (int e = 0; e < V; ++e) dst[e] = static_cast<opmath_t>(val.val[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) dst[e] = opmath_t(0);
    }
  }
  for (int i = threadIdx.x; i < tih * nscalar; i += blockDim.x) {
    const int r = i / nscalar, j = i % nscalar;
    const int64_t col = j < lead ? iw0 + j : c1 + (j - lead);
    const int64_t ih = ih0 + r;
    opmath_t v = opmath_t(0);
    if (ih >= 0 && ih < H && col >= 0 && col < W) v = static_cast<opmath_t>(xp[ih * W + col]);
    tile[r * a.pitch + (col - iw0)] = v;
  }
  __syncthreads();

  // Each item: V consecutive outputs of one row. The window of input
  // columns it needs, [ow*S, ow*S + V*S + 2), is read as NW aligned vectors.
  constexpr int NW = (V * S + 2 + V - 1) / V;
  const int ngw = (tow + V - 1) / V;
  for (int item = threadIdx.x; item < toh * ngw; item += blockDim.x) {
    const int r = item / ngw, gcol = item % ngw;
    const int owl = gcol * V;  // first output column of the item, in the tile
    opmath_t win[3][NW * V];
#pragma unroll
    for (int kh = 0; kh < 3; ++kh) {
      const opmath_t* src = tile + (r * S + kh) * a.pitch + owl * S;
#pragma unroll
      for (int q = 0; q < NW; ++q) SmemVec<opmath_t, V>::load(src + q * V, &win[kh][q * V]);
    }
    const int64_t oh = oh0 + r;
    const int64_t ow = ow0 + owl;
    const int valid = min(V, tow - owl);
    for (int j = 0; j < a.mult; ++j) {
      const opmath_t* wk = ws + j * 9;
      const opmath_t bk = ws[a.mult * 9 + j];
      AlignedVec<scalar_t, V> res;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        opmath_t acc = bk;
#pragma unroll
        for (int kh = 0; kh < 3; ++kh)
#pragma unroll
          for (int kw = 0; kw < 3; ++kw) acc += wk[kh * 3 + kw] * win[kh][e * S + kw];
        acc = apply_activation(acc, a.act);
        res.val[e] = static_cast<scalar_t>(acc);
      }
      scalar_t* op = out + ((n * a.K + c * a.mult + j) * a.Ho + oh) * a.Wo + ow;
      if (a.store_vec && valid == V) {
        *reinterpret_cast<AlignedVec<scalar_t, V>*>(op) = res;
      } else {
        for (int e = 0; e < valid; ++e) op[e] = res.val[e];
      }
    }
  }
}

// NCHW, stride 1. A tile is `np` consecutive (image, channel) planes, or one
// band of output rows of one plane, staged in shared memory in the input
// dtype: staged row rr holds input row oh0 - PAD + rr at columns [E, E + W)
// of a row of pitch P elements (E = 16 bytes of elements; columns [0, E) and
// [E + W, P) and rows outside the image are zeros). Copies of LB bytes
// (16/8/4 with cp.async, or single elements). Each thread item then owns V
// consecutive output columns of a run of up to R output rows: it slides
// down the rows with one (V + 2)-wide input row window and two partial sums
// in registers (one V-wide shared load plus two scalars per input row; each
// input row finishes one output row, continues the next and starts the one
// after), adds the bias, applies ReLU and stores V values at once. A
// channel multiplier loops over the same stage.
// One tile per block: these kernels are bound by instruction issue more
// than by memory latency, so a second stage buffer (the next tile's copies
// in flight) would cost resident blocks for nothing (docs/ops/conv.md).
// (Arguments: DwS1Args, conv_dw.h.)

// The outputs of tile `tt` from its stage.
template <typename scalar_t, int V, int PAD>
__device__ __forceinline__ void dw_s1_compute(const scalar_t* tile, const scalar_t* __restrict__ w,
                                              const scalar_t* __restrict__ b, scalar_t* __restrict__ out,
                                              const DwS1Args& a, const DwS1Tile& tt) {
  constexpr int E = 16 / static_cast<int>(sizeof(scalar_t));
  const int items = tt.np * a.runs * a.ngw;
  for (int j = 0; j < a.mult; ++j) {
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const DwS1Item item = dw_s1_item(a, tt, it);
      const int g = item.g, p = item.p, r0 = item.r0, nr = item.nr;
      if (nr <= 0) continue;
      const int64_t plane = tt.plane0 + p;
      const int64_t k = (plane % a.C) * a.mult + j;
      float wk[9];
#pragma unroll
      for (int q = 0; q < 9; ++q) wk[q] = static_cast<float>(w[k * 9 + q]);
      const float bk = b != nullptr ? static_cast<float>(b[k]) : 0.f;

      const int ow = g * V;
      const int valid = min(V, a.Wo - ow);
      const scalar_t* s = tile + (p * a.SR + r0) * a.P + E + ow;
      scalar_t* o = out + ((plane * a.mult + j) * a.Ho + tt.oh0 + r0) * static_cast<int64_t>(a.Wo) + ow;
      // Rolling accumulators (as in the NHWC kernel below): only one input
      // row window and two partial sums are live.
      auto fma_row = [&](const float (&xr)[V + 2], int kh, float (&acc)[V]) {
#pragma unroll
        for (int e = 0; e < V; ++e)
#pragma unroll
          for (int kw = 0; kw < 3; ++kw) acc[e] = fmaf(wk[kh * 3 + kw], xr[e + kw], acc[e]);
      };
      float xr[V + 2], accP[V], accQ[V];
      load_window_row<scalar_t, V, PAD>(s, xr);
#pragma unroll
      for (int e = 0; e < V; ++e) accP[e] = bk;
      fma_row(xr, 0, accP);
      load_window_row<scalar_t, V, PAD>(s + a.P, xr);
      fma_row(xr, 1, accP);
#pragma unroll
      for (int e = 0; e < V; ++e) accQ[e] = bk;
      fma_row(xr, 0, accQ);
      s += 2 * a.P;
      for (int r = 0; r < nr; ++r) {
        load_window_row<scalar_t, V, PAD>(s, xr);
        s += a.P;
        fma_row(xr, 2, accP);
        AlignedVec<scalar_t, V> res;
#pragma unroll
        for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(activate(accP[e], a.act));
        if (a.store_vec) {
          *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = res;
        } else {
          for (int e = 0; e < valid; ++e) o[e] = res.val[e];
        }
        o += a.Wo;
#pragma unroll
        for (int e = 0; e < V; ++e) accP[e] = accQ[e];
        fma_row(xr, 1, accP);
#pragma unroll
        for (int e = 0; e < V; ++e) accQ[e] = bk;
        fma_row(xr, 0, accQ);
      }
    }
  }
}

template <typename scalar_t, int V, int PAD>
__global__ void __launch_bounds__(kThreads)
    dw_fwd_nchw_s1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                   scalar_t* __restrict__ out, DwS1Args a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* stage = reinterpret_cast<scalar_t*>(smem_raw);
  const DwS1Tile tile = dw_s1_tile(a, blockIdx.x);
  dw_s1_stage<scalar_t, PAD>(x, stage, a, tile);
  copy_async_wait_all();
  __syncthreads();  // every thread's copies (and zeros) are in place
  dw_s1_compute<scalar_t, V, PAD>(stage, w, b, out, a, tile);
}

}  // namespace
}  // namespace opforge::conv

namespace opforge::conv {
namespace {

// NCHW without a stage, for planes too small to fill the tiled kernels'
// blocks (a 7x7 output plane is 14 items of 4 columns for 256 threads):
// each thread computes V consecutive outputs of one output row of one output
// channel from its 3 x ((V - 1) * S + 3) input window, read from global
// memory; neighbouring threads' windows overlap, and L1 serves the overlap.
// Any padding and channel multiplier. (Arguments: DwDirectArgs, conv_dw.h.)
template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads)
    dw_fwd_nchw_direct(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, const scalar_t* __restrict__ b,
                       scalar_t* __restrict__ out, DwDirectArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int WIN = (V - 1) * S + 3;
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= a.items) return;
  // 32-bit decode (the planner keeps items below 2^31): item = ((n * K + k) * Ho + oh) * ngw + g.
  const unsigned g = i % a.ngw;
  const unsigned row = i / a.ngw;
  const int oh = static_cast<int>(row % a.Ho);
  const unsigned plane = row / a.Ho;  // n * K + k: the output plane
  const unsigned k = plane % a.K, n = plane / a.K;
  const unsigned c = k / a.mult;
  const int ow = static_cast<int>(g) * V;
  const scalar_t* xp = x + (static_cast<int64_t>(n) * a.C + c) * a.H * a.W;
  const scalar_t* wk = w + static_cast<int64_t>(k) * 9;
  const opmath_t bk = b != nullptr ? static_cast<opmath_t>(b[k]) : opmath_t(0);
  opmath_t acc[V];
#pragma unroll
  for (int e = 0; e < V; ++e) acc[e] = bk;
  const int iw0 = ow * S - a.pad;
#pragma unroll
  for (int kh = 0; kh < 3; ++kh) {
    const int ih = oh * S - a.pad + kh;
    if (ih < 0 || ih >= a.H) continue;
    const scalar_t* src = xp + static_cast<int64_t>(ih) * a.W;
    opmath_t win[WIN];
#pragma unroll
    for (int j = 0; j < WIN; ++j) {
      const int col = iw0 + j;
      win[j] = col >= 0 && col < a.W ? static_cast<opmath_t>(src[col]) : opmath_t(0);
    }
#pragma unroll
    for (int kw = 0; kw < 3; ++kw) {
      const opmath_t wv = static_cast<opmath_t>(wk[kh * 3 + kw]);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += wv * win[e * S + kw];
    }
  }
  AlignedVec<scalar_t, V> res;
#pragma unroll
  for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(activate(acc[e], a.act));
  scalar_t* o = out + (static_cast<int64_t>(plane) * a.Ho + oh) * a.Wo + ow;
  if (a.store_vec) {  // Wo % V == 0: every item is whole
    *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = res;
  } else {
    const int valid = min(V, a.Wo - ow);
    for (int e = 0; e < valid; ++e) o[e] = res.val[e];
  }
}

}  // namespace
}  // namespace opforge::conv

// Depthwise grad weight / grad bias kernels: per-row reductions (NCHW and
// NHWC, any stride and multiplier), the staged stride-1 ones on the
// forward's tiles, and the kernel that adds the splits' partial sums.
#pragma once

#include "cuda/conv_depthwise/conv_dw_stage.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

// Both weight kernels split the N * Ho output rows (of one channel) into
// `splits` runs of rows_per_split rows and find a row's (n, oh) with one
// division per row, not per element (64-bit divisions are subroutine calls).
// A thread's 10 sums (9 taps and the bias) go to part[(k * splits + split) *
// 10 + t] after a block reduction.

// NCHW: block (k, split); warp w takes rows w, w + 8, ... of the split, its
// lanes along ow (coalesced loads of grad_out, result and x).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    dw_bwd_weight_nchw(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res, const scalar_t* __restrict__ x,
                       at::opmath_type<scalar_t>* __restrict__ part, DwArgs a, int S, int splits,
                       int64_t rows_per_split) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t k = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t c = k / a.mult;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const int64_t rows = a.N * a.Ho;
  const int64_t begin = split * rows_per_split, end = begin + rows_per_split < rows ? begin + rows_per_split : rows;
  opmath_t acc[10];
#pragma unroll
  for (int t = 0; t < 10; ++t) acc[t] = opmath_t(0);
  for (int64_t row = begin + warp; row < end; row += nwarps) {
    const int64_t n = row / a.Ho, oh = row - n * a.Ho;
    const int64_t goff = ((n * a.K + k) * a.Ho + oh) * a.Wo;
    const scalar_t* xp = x + (n * a.C + c) * a.H * a.W;
    for (int64_t ow = lane; ow < a.Wo; ow += 32) {
      const opmath_t gv = masked_grad<opmath_t>(g, res, goff + ow);
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        const int64_t ih = oh * S - a.pad + kh;
        const bool row_ok = ih >= 0 && ih < a.H;
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) {
          const int64_t iw = ow * S - a.pad + kw;
          if (row_ok && iw >= 0 && iw < a.W) acc[kh * 3 + kw] += gv * static_cast<opmath_t>(xp[ih * a.W + iw]);
        }
      }
      acc[9] += gv;
    }
  }
  block_sums10(acc, part + (k * splits + split) * 10);
}

// NHWC: block (chunk of 32 output channels, split); threadIdx.x is the
// channel (coalesced along C), threadIdx.y (8) takes rows y, y + 8, ... of
// the split and walks each along ow with the 3 x 3 input window in
// registers: S new columns (3 * S loads) per output instead of 9.
// (kThreads, 2): ptxas's own choice of 64 registers spilled the S = 2 window.
template <typename scalar_t, int S>
__global__ void __launch_bounds__(kThreads, 2)
    dw_bwd_weight_nhwc(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res, const scalar_t* __restrict__ x,
                       at::opmath_type<scalar_t>* __restrict__ part, DwArgs a, int splits, int64_t rows_per_split) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int split = blockIdx.y;
  const bool active = k < a.K;
  const int64_t c = active ? k / a.mult : 0;
  const int64_t rows = a.N * a.Ho;
  const int64_t begin = split * rows_per_split, end = begin + rows_per_split < rows ? begin + rows_per_split : rows;
  opmath_t acc[10];
#pragma unroll
  for (int t = 0; t < 10; ++t) acc[t] = opmath_t(0);
  if (active) {
    for (int64_t row = begin + threadIdx.y; row < end; row += blockDim.y) {
      const int64_t n = row / a.Ho, oh = row - n * a.Ho;
      const scalar_t* gr = g + row * a.Wo * a.K + k;  // (n, oh, ow, k) at gr[ow * K]
      const scalar_t* rr = res != nullptr ? res + row * a.Wo * a.K + k : nullptr;
      const scalar_t* xr[3];  // input row oh * S - pad + kh, pixel iw at xr[kh][iw * C]
      bool row_ok[3];
#pragma unroll
      for (int kh = 0; kh < 3; ++kh) {
        const int64_t ih = oh * S - a.pad + kh;
        row_ok[kh] = ih >= 0 && ih < a.H;
        xr[kh] = x + (n * a.H + (row_ok[kh] ? ih : 0)) * a.W * a.C + c;
      }
      auto at_col = [&](int kh, int64_t iw) {
        return row_ok[kh] && iw >= 0 && iw < a.W ? static_cast<opmath_t>(xr[kh][iw * a.C]) : opmath_t(0);
      };
      opmath_t win[3][3];  // win[kh][kw]: input (oh * S - pad + kh, ow * S - pad + kw)
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) win[kh][kw] = at_col(kh, kw - a.pad);
      for (int64_t ow = 0; ow < a.Wo; ++ow) {
        const opmath_t gv = masked_grad<opmath_t>(gr, rr, ow * a.K);
#pragma unroll
        for (int kh = 0; kh < 3; ++kh)
#pragma unroll
          for (int kw = 0; kw < 3; ++kw) acc[kh * 3 + kw] += gv * win[kh][kw];
        acc[9] += gv;
        // Slide to ow + 1, whose window starts S columns on.
        const int64_t next = (ow + 1) * S - a.pad;
#pragma unroll
        for (int kh = 0; kh < 3; ++kh) {
          if constexpr (S == 1) {
            win[kh][0] = win[kh][1];
            win[kh][1] = win[kh][2];
          } else {
            win[kh][0] = win[kh][2];
            win[kh][1] = at_col(kh, next + 1);
          }
          win[kh][2] = at_col(kh, next + 2);
        }
      }
    }
  }
  __shared__ opmath_t red[8][10][33];
#pragma unroll
  for (int t = 0; t < 10; ++t) red[threadIdx.y][t][threadIdx.x] = acc[t];
  __syncthreads();
  // 320 (channel, value) sums over the 8 rows, by the 256 threads.
  for (int i = threadIdx.y * 32 + threadIdx.x; i < 320; i += 256) {
    const int t = i / 32, lane = i % 32;
    const int64_t kk = static_cast<int64_t>(blockIdx.x) * 32 + lane;
    if (kk < a.K) {
      opmath_t s = opmath_t(0);
      for (int q = 0; q < 8; ++q) s += red[q][t][lane];
      part[(kk * splits + split) * 10 + t] = s;
    }
  }
}

// Stride 1, multiplier 1, on the forward's tiles and stage code: a block
// stays on one channel (NCHW) or chunk of channels (NHWC) and walks the
// tiles split, split + splits, ... of it; each tile's input window (halo
// included) is staged with cp.async as in the forward, and a thread item
// slides down its rows with the 3 x 3 input window and the last three
// grad_out rows in registers, adding into the 9 tap sums and the bias sum it
// keeps across tiles. One block reduction at the end writes
// part[(c * splits + split) * 10 + t]. NCHW reads grad_out from global
// memory (once, masked by result on the way when given); NHWC stages the
// tile's grad_out pixels (already masked) too, which beat reading them
// from global memory in the row loop. (The per-row kernels above index
// every tap with 64-bit arithmetic and bounds tests, far from the floor.)

// grad_out at V consecutive places, masked by result (when given) as
// masked_grad does; zeros past `valid` (scalar loads then).
template <typename scalar_t, int V>
__device__ __forceinline__ void load_masked_grad(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                                                 int64_t off, bool vec, int valid, float (&out)[V]) {
  if (vec) {
    const auto gv = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(g + off);
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = static_cast<float>(gv.val[e]);
    if (res != nullptr) {
      const auto rv = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(res + off);
#pragma unroll
      for (int e = 0; e < V; ++e) out[e] = static_cast<float>(rv.val[e]) <= 0.f ? 0.f : out[e];  // as masked_grad
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = e < valid ? masked_grad<float>(g, res, off + e) : 0.f;
  }
}

// 9 taps + bias of one output row's grad_out gq (V places) against the input
// row window xr: acc[kh * 3 + kw] += sum_e gq[e] * xr[e + kw].
template <int V>
__device__ __forceinline__ void add_row_taps(const float (&gq)[V], const float (&xr)[V + 2], int kh, float (&acc)[10]) {
#pragma unroll
  for (int kw = 0; kw < 3; ++kw)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[kh * 3 + kw] = fmaf(gq[e], xr[e + kw], acc[kh * 3 + kw]);
}

// NCHW: block (channel c, split); tiles are (PB planes of channel c, band).
template <typename scalar_t, int V, int PAD>
__global__ void __launch_bounds__(kThreads)
    dw_bwd_weight_nchw_s1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                          const scalar_t* __restrict__ res, float* __restrict__ part, DwS1Args a, int splits,
                          bool vec_g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* stage = reinterpret_cast<scalar_t*>(smem_raw);
  constexpr int E = 16 / static_cast<int>(sizeof(scalar_t));
  const int c = blockIdx.x, split = blockIdx.y;
  const int64_t N = a.planes / a.C;
  const int64_t tiles = (N + a.PB - 1) / a.PB * a.bands;
  float acc[10];
#pragma unroll
  for (int t = 0; t < 10; ++t) acc[t] = 0.f;
  for (int64_t j = split; j < tiles; j += splits) {
    const int band = static_cast<int>(j % a.bands);
    const int64_t n0 = (j / a.bands) * a.PB;
    DwS1Tile tt;
    tt.plane0 = n0 * a.C + c;
    tt.np = static_cast<int>(N - n0 < a.PB ? N - n0 : a.PB);
    tt.oh0 = band * a.BH;
    tt.bh = min(a.BH, a.Ho - tt.oh0);
    dw_s1_stage<scalar_t, PAD>(x, stage, a, tt);
    copy_async_wait_all();
    __syncthreads();
    const int items = tt.np * a.runs * a.ngw;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const DwS1Item item = dw_s1_item(a, tt, it);
      const int p = item.p, r0 = item.r0, nr = item.nr;
      if (nr <= 0) continue;
      const int ow = item.g * V;
      const int valid = min(V, a.Wo - ow);
      const scalar_t* sp = stage + (p * a.SR + r0) * a.P + E + ow;
      const int64_t goff =
          ((n0 + p) * a.C + c) * static_cast<int64_t>(a.Ho) * a.Wo + static_cast<int64_t>(tt.oh0 + r0) * a.Wo + ow;
      // Staged row ri meets output rows ri - kh (kh = 0, 1, 2): gq[kh].
      float gq[3][V], xr[V + 2];
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int e = 0; e < V; ++e) gq[kh][e] = 0.f;
      for (int ri = 0; ri < nr + 2; ++ri) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          gq[2][e] = gq[1][e];
          gq[1][e] = gq[0][e];
          gq[0][e] = 0.f;
        }
        if (ri < nr) load_masked_grad<scalar_t, V>(g, res, goff + static_cast<int64_t>(ri) * a.Wo, vec_g, valid, gq[0]);
        load_window_row<scalar_t, V, PAD>(sp + ri * a.P, xr);
#pragma unroll
        for (int kh = 0; kh < 3; ++kh) add_row_taps<V>(gq[kh], xr, kh, acc);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[9] += gq[0][e];
      }
    }
    __syncthreads();  // the next tile's stage overwrites this one
  }
  block_sums10(acc, part + (static_cast<int64_t>(c) * splits + split) * 10);
}

// NHWC: block (chunk of CB channels, split); tiles are the forward's
// (image, BH x TW output pixels) of that chunk, and grad_out's pixels of the
// tile (already masked) are staged next to the input window. A thread item
// is 4 channels of one output column, as in the forward.
// (kThreads, 2): ptxas's own choice of 80 registers spilled the float32
// instantiations.
template <typename scalar_t, int PAD, int LB>
__global__ void __launch_bounds__(kThreads, 2)
    dw_bwd_weight_nhwc_s1(const scalar_t* __restrict__ x, const scalar_t* __restrict__ g, float* __restrict__ part,
                          DwS1NhwcArgs a, int splits) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* tile = reinterpret_cast<scalar_t*>(smem_raw);
  scalar_t* gtile = tile + (a.BH + 2) * (a.TW + 2) * a.CB;
  constexpr int V = 4;
  const int chunk = blockIdx.x, split = blockIdx.y;
  const int cin0 = chunk * a.CB;
  const int cvn = min(a.CB, a.C - cin0) / V;
  const int cv = static_cast<int>(threadIdx.x) % cvn, q = static_cast<int>(threadIdx.x) / cvn;
  const int64_t spatial = a.N * a.tiles_h * a.tiles_w;
  const int rstep = (a.TW + 2) * a.CB, gstep = a.TW * a.CB;
  float acc[10][V];
#pragma unroll
  for (int t = 0; t < 10; ++t)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[t][e] = 0.f;
  for (int64_t sp = split; sp < spatial; sp += splits) {
    const DwS1NhwcTile tt = dw_s1_nhwc_tile(a, sp * a.chunks + chunk);
    dw_s1_nhwc_stage<scalar_t, PAD, LB>(x, tile, a, tt);
    dw_s1_nhwc_stage<scalar_t, 0, LB, 0>(g, gtile, a, tt);
    copy_async_wait_all();
    __syncthreads();
    if (q < tt.bw) {
      const scalar_t* s = tile + q * a.CB + cv * V;    // input window row 0, column q
      const scalar_t* gs = gtile + q * a.CB + cv * V;  // grad_out row 0, column q
      // Staged input row ri meets output rows ri - kh (kh = 0, 1, 2): gq[kh].
      float gq[3][V];
#pragma unroll
      for (int kh = 0; kh < 3; ++kh)
#pragma unroll
        for (int e = 0; e < V; ++e) gq[kh][e] = 0.f;
      for (int ri = 0; ri < tt.bh + 2; ++ri) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          gq[2][e] = gq[1][e];
          gq[1][e] = gq[0][e];
          gq[0][e] = 0.f;
        }
        if (ri < tt.bh) widen4(gs + ri * gstep, gq[0]);
        float xr[3][V];
#pragma unroll
        for (int kw = 0; kw < 3; ++kw) widen4(s + ri * rstep + kw * a.CB, xr[kw]);
#pragma unroll
        for (int kh = 0; kh < 3; ++kh)
#pragma unroll
          for (int kw = 0; kw < 3; ++kw)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[kh * 3 + kw][e] = fmaf(gq[kh][e], xr[kw][e], acc[kh * 3 + kw][e]);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[9][e] += gq[0][e];
      }
    }
    __syncthreads();  // the next tile's stage overwrites this one
  }
  nhwc_block_sums(acc, reinterpret_cast<float*>(smem_raw), q < a.TW, cvn, a.TW, cin0, split, splits, part);
}

template <typename scalar_t>
__global__ void dw_bwd_weight_finish(const at::opmath_type<scalar_t>* __restrict__ part, scalar_t* __restrict__ gw,
                                     scalar_t* __restrict__ gb, int64_t K, int splits) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K * 10) return;
  const int64_t k = i / 10;
  const int t = static_cast<int>(i % 10);
  opmath_t s = opmath_t(0);
  for (int q = 0; q < splits; ++q) s += part[(k * splits + q) * 10 + t];
  if (t < 9) {
    if (gw != nullptr) gw[k * 9 + t] = static_cast<scalar_t>(s);
  } else if (gb != nullptr) {
    gb[k] = static_cast<scalar_t>(s);
  }
}

}  // namespace
}  // namespace opforge::conv

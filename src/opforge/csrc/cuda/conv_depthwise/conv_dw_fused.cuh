// The fused depthwise backward: NHWC, stride 1, padding 1, multiplier 1.
#pragma once

#include "cuda/conv_depthwise/conv_dw_stage.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

// Stride 1, padding 1, multiplier 1, NHWC: grad x and the weight/bias sums
// from one stage per tile. The tile's output pixels and their 1-pixel ring
// are staged for grad_out, result (with a fused ReLU) and x alike (with
// padding 1 the input and output grids coincide), so each tensor is read
// once (plus its halo) and grad x written once: 4 passes over memory where
// the separate kernels (mask pass, grad x as a forward, weight sums) make 7.
// A thread item (4 channels of one column) slides down the staged rows:
// grad x is the forward's rolling sum over the masked grad_out window with
// the kernel flipped; the weight sums pair the input row one step behind
// with the grad_out centres of the three output rows it feeds. Blocks stay on
// one chunk of channels and walk its tiles, as dw_bwd_weight_nhwc_s1.
// Blocks of at most 128 threads (CB / 4 x TW, CB <= 32, TW <= 16), three
// per SM: up to 168 registers (a thread keeps 36 weights, 40 sums and two
// staged rows; at 128 registers ptxas spilled).
constexpr int kFusedThreads = 128;

template <typename scalar_t, int LB, bool MASK>
__global__ void __launch_bounds__(kFusedThreads, 3)
    dw_bwd_fused_nhwc_s1(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                         const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, scalar_t* __restrict__ gx,
                         float* __restrict__ part, DwS1NhwcArgs a, int splits) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ts = (a.BH + 2) * (a.TW + 2) * a.CB;  // elements per staged tile
  scalar_t* xt = reinterpret_cast<scalar_t*>(smem_raw);
  scalar_t* gt = xt + ts;
  scalar_t* rt = gt + ts;  // MASK only
  constexpr int V = 4;
  const int chunk = blockIdx.x, split = blockIdx.y;
  const int cin0 = chunk * a.CB;
  const int cvn = min(a.CB, a.C - cin0) / V;
  const int cv = static_cast<int>(threadIdx.x) % cvn, q = static_cast<int>(threadIdx.x) / cvn;
  const bool active = q < a.TW;
  const int c0 = cin0 + cv * V;
  // grad x's weights, flipped: wf[t][e] = w[c0 + e][8 - t].
  float wf[9][V];
#pragma unroll
  for (int e = 0; e < V; ++e)
#pragma unroll
    for (int t = 0; t < 9; ++t)
      wf[t][e] = active ? static_cast<float>(w[static_cast<int64_t>(c0 + e) * 9 + 8 - t]) : 0.f;
  float acc[10][V];
#pragma unroll
  for (int t = 0; t < 10; ++t)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[t][e] = 0.f;
  const int64_t spatial = a.N * a.tiles_h * a.tiles_w;
  const int rstep = (a.TW + 2) * a.CB;
  const int64_t ostep = static_cast<int64_t>(a.W) * a.C;
  for (int64_t sp = split; sp < spatial; sp += splits) {
    const DwS1NhwcTile tt = dw_s1_nhwc_tile(a, sp * a.chunks + chunk);
    dw_s1_nhwc_stage<scalar_t, 1, LB>(x, xt, a, tt);
    dw_s1_nhwc_stage<scalar_t, 1, LB>(g, gt, a, tt);
    if constexpr (MASK) dw_s1_nhwc_stage<scalar_t, 1, LB>(res, rt, a, tt);
    copy_async_wait_all();
    __syncthreads();
    if (q < tt.bw) {
      const int off0 = q * a.CB + cv * V;  // staged row 0, column q
      scalar_t* o = gx + ((tt.n * a.H + tt.oh0) * a.W + tt.ow0 + q) * static_cast<int64_t>(a.C) + c0;
      float accP[V], accQ[V];  // grad x rows ri - 2 and ri - 1 in progress
      float xp[3][V];          // the input row one step behind
      float gc1[V], gc2[V];    // grad_out centres of staged rows ri - 1, ri - 2 (0 off the tile)
#pragma unroll
      for (int e = 0; e < V; ++e) accP[e] = accQ[e] = gc1[e] = gc2[e] = 0.f;
#pragma unroll
      for (int kw = 0; kw < 3; ++kw)
#pragma unroll
        for (int e = 0; e < V; ++e) xp[kw][e] = 0.f;
      for (int ri = 0; ri <= tt.bh + 2; ++ri) {
        float gr[3][V], xr[3][V], gc[V];
        if (ri <= tt.bh + 1) {
          const int off = off0 + ri * rstep;
#pragma unroll
          for (int kw = 0; kw < 3; ++kw) {
            widen4(gt + off + kw * a.CB, gr[kw]);
            widen4(xt + off + kw * a.CB, xr[kw]);
            if constexpr (MASK) {
              float rv[V];
              widen4(rt + off + kw * a.CB, rv);
#pragma unroll
              for (int e = 0; e < V; ++e) gr[kw][e] = rv[e] <= 0.f ? 0.f : gr[kw][e];  // as masked_grad
            }
          }
        } else {
#pragma unroll
          for (int kw = 0; kw < 3; ++kw)
#pragma unroll
            for (int e = 0; e < V; ++e) gr[kw][e] = xr[kw][e] = 0.f;
        }
        // Staged row ri is output row ri - 1 of the tile: its centre counts
        // for the weights only inside the tile.
        const bool in_tile = ri >= 1 && ri <= tt.bh;
#pragma unroll
        for (int e = 0; e < V; ++e) gc[e] = in_tile ? gr[1][e] : 0.f;
        // Weights: input row ri - 1 (xp) feeds output rows ri - 1 - kh,
        // whose grad_out centres are staged rows ri - kh: gc, gc1, gc2.
#pragma unroll
        for (int kw = 0; kw < 3; ++kw)
#pragma unroll
          for (int e = 0; e < V; ++e) {
            acc[kw][e] = fmaf(gc[e], xp[kw][e], acc[kw][e]);
            acc[3 + kw][e] = fmaf(gc1[e], xp[kw][e], acc[3 + kw][e]);
            acc[6 + kw][e] = fmaf(gc2[e], xp[kw][e], acc[6 + kw][e]);
          }
#pragma unroll
        for (int e = 0; e < V; ++e) {
          acc[9][e] += gc[e];
          gc2[e] = gc1[e];
          gc1[e] = gc[e];
        }
#pragma unroll
        for (int kw = 0; kw < 3; ++kw)
#pragma unroll
          for (int e = 0; e < V; ++e) xp[kw][e] = xr[kw][e];
        // grad x: staged grad_out row ri completes row ri - 2 (flipped kernel
        // row 2), continues ri - 1 (row 1) and starts ri (row 0).
        if (ri <= tt.bh + 1) {
#pragma unroll
          for (int e = 0; e < V; ++e)
#pragma unroll
            for (int kw = 0; kw < 3; ++kw) accP[e] = fmaf(wf[6 + kw][e], gr[kw][e], accP[e]);
          if (ri >= 2) {
            *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = narrow4<scalar_t>(accP, Activation::None);
            o += ostep;
          }
#pragma unroll
          for (int e = 0; e < V; ++e) {
            accP[e] = accQ[e];
            accQ[e] = 0.f;
#pragma unroll
            for (int kw = 0; kw < 3; ++kw) {
              accP[e] = fmaf(wf[3 + kw][e], gr[kw][e], accP[e]);
              accQ[e] = fmaf(wf[kw][e], gr[kw][e], accQ[e]);
            }
          }
        }
      }
    }
    __syncthreads();  // the next tile's stage overwrites this one
  }
  nhwc_block_sums(acc, reinterpret_cast<float*>(smem_raw), q < a.TW, cvn, a.TW, cin0, split, splits, part);
}

}  // namespace
}  // namespace opforge::conv

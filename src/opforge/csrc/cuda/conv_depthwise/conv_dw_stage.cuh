// The stride-1 kernels' staged tiles (cp.async into shared memory), shared
// by the forward, the weight gradient and the fused backward: NCHW bands of
// planes (dw_s1_*) and NHWC pixel tiles (dw_s1_nhwc_*). Layouts: the kernel
// comments in conv_dw_forward_nchw.cuh and conv_dw_forward_nhwc.cuh.
#pragma once

#include "cuda/conv_depthwise/conv_dw_device.cuh"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

struct DwS1Tile {
  int64_t plane0;
  int np, oh0, bh;
};

__device__ __forceinline__ DwS1Tile dw_s1_tile(const DwS1Args& a, int64_t t) {
  DwS1Tile r;
  const int band = static_cast<int>(t % a.bands);
  r.plane0 = (t / a.bands) * a.PB;
  r.np = static_cast<int>(a.planes - r.plane0 < a.PB ? a.planes - r.plane0 : a.PB);
  r.oh0 = band * a.BH;
  r.bh = min(a.BH, a.Ho - r.oh0);
  return r;
}

template <typename scalar_t, int V, int PAD>
__device__ __forceinline__ void load_window_row(const scalar_t* s, float (&win)[V + 2]) {
  const auto v = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(s);
  if constexpr (PAD == 2) {  // the backward's grad x of a padding-0 forward
    win[0] = static_cast<float>(s[-2]);
    win[1] = static_cast<float>(s[-1]);
#pragma unroll
    for (int e = 0; e < V; ++e) win[e + 2] = static_cast<float>(v.val[e]);
  } else if constexpr (PAD == 1) {
    win[0] = static_cast<float>(s[-1]);
#pragma unroll
    for (int e = 0; e < V; ++e) win[e + 1] = static_cast<float>(v.val[e]);
    win[V + 1] = static_cast<float>(s[V]);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) win[e] = static_cast<float>(v.val[e]);
    win[V] = static_cast<float>(s[V]);
    win[V + 1] = static_cast<float>(s[V + 1]);
  }
}

// Queues the copies of tile `tt` into `tile` (2^lpr_shift lanes per row).
template <typename scalar_t, int PAD>
__device__ __forceinline__ void dw_s1_stage(const scalar_t* __restrict__ x, scalar_t* tile, const DwS1Args& a,
                                            const DwS1Tile& tt) {
  constexpr int E = 16 / static_cast<int>(sizeof(scalar_t));
  const int sr = tt.bh + 2;
  const int lpr = 1 << a.lpr_shift;
  const int lane = threadIdx.x & (lpr - 1);
  const int slots = blockDim.x >> a.lpr_shift;
  const int L = a.LB / static_cast<int>(sizeof(scalar_t));  // elements per copy
  if (a.LB == 16) {
    // Rows of P / E 16-byte chunks: chunk 0 and those past the image's W / E
    // are zeros, chunk j in between is input columns [(j - 1) E, j E). Rows
    // advance by `slots` without a division (the stage is a large part of
    // this kernel's instructions).
    const int chunks = a.P / E, full = a.W / E;
    int p = 0, rr = threadIdx.x >> a.lpr_shift;
    while (rr >= sr) rr -= sr, ++p;
    for (; p < tt.np;) {
      const int ih = tt.oh0 - PAD + rr;
      const bool inside = ih >= 0 && ih < a.H;
      scalar_t* dst = tile + (p * a.SR + rr) * a.P;
      const scalar_t* src = x + ((tt.plane0 + p * a.plane_step) * a.H + (inside ? ih : 0)) * static_cast<int64_t>(a.W);
      for (int j = lane; j < chunks; j += lpr) {
        if (inside && j >= 1 && j <= full) {
          copy_async<16>(dst + j * E, src + (j - 1) * E);
        } else {
          zero_bytes(dst + j * E, 16);
        }
      }
      rr += slots;
      while (rr >= sr) rr -= sr, ++p;
    }
    return;
  }
  const int nvec = a.W / L;
  for (int q = threadIdx.x >> a.lpr_shift; q < tt.np * sr; q += slots) {
    const int p = q / sr, rr = q - p * sr;
    const int ih = tt.oh0 - PAD + rr;
    scalar_t* dst = tile + (p * a.SR + rr) * a.P;
    if (ih < 0 || ih >= a.H) {
      for (int j = lane; j < a.P / E; j += lpr) zero_bytes(dst + j * E, 16);
      continue;
    }
    const scalar_t* src = x + ((tt.plane0 + p * a.plane_step) * a.H + ih) * static_cast<int64_t>(a.W);
    scalar_t* d = dst + E;
    switch (a.LB) {
      case 16:
        for (int v = lane; v < nvec; v += lpr) copy_async<16>(d + v * L, src + v * L);
        break;
      case 8:
        for (int v = lane; v < nvec; v += lpr) copy_async<8>(d + v * L, src + v * L);
        break;
      case 4:
        for (int v = lane; v < nvec; v += lpr) copy_async<4>(d + v * L, src + v * L);
        break;
      default:
        for (int v = lane; v < nvec; v += lpr) d[v] = src[v];
        break;
    }
    for (int j = lane; j < E; j += lpr) dst[j] = scalar_t(0);
    for (int j = E + a.W + lane; j < a.P; j += lpr) dst[j] = scalar_t(0);
  }
}

// Thread item `it` of a tile: column group g (V output columns), plane p of
// the tile, and its run of output rows [r0, r0 + nr) (nr <= 0: none).
struct DwS1Item {
  int g, p, r0, nr;
};

__device__ __forceinline__ DwS1Item dw_s1_item(const DwS1Args& a, const DwS1Tile& tt, int it) {
  DwS1Item r;
  r.g = it % a.ngw;
  const int t = it / a.ngw;
  const int run = t % a.runs;
  r.p = t / a.runs;
  r.r0 = run * a.R;
  r.nr = min(a.R, tt.bh - r.r0);
  return r;
}

struct DwS1NhwcTile {
  int64_t n;
  int cin0, cba, oh0, ow0, bh, bw;
};

__device__ __forceinline__ DwS1NhwcTile dw_s1_nhwc_tile(const DwS1NhwcArgs& a, int64_t t) {
  DwS1NhwcTile r;
  const int chunk = static_cast<int>(t % a.chunks);
  t /= a.chunks;
  const int tw = static_cast<int>(t % a.tiles_w);
  t /= a.tiles_w;
  const int th = static_cast<int>(t % a.tiles_h);
  r.n = t / a.tiles_h;
  r.cin0 = chunk * a.CB;
  r.cba = min(a.CB, a.C - r.cin0);
  r.oh0 = th * a.BH;
  r.ow0 = tw * a.TW;
  r.bh = min(a.BH, a.Ho - r.oh0);
  r.bw = min(a.TW, a.Wo - r.ow0);
  return r;
}

// Queues the copies of the tile (pair with copy_async_wait_all). LB: bytes
// per copy (16, 8 or 4), a template argument so that the copy is one
// instruction with no switch. HALO 2: the input window of the tile's output
// pixels, (BH + 2) x (TW + 2) pixels of x (H x W) from (oh0 - PAD,
// ow0 - PAD); HALO 0: the output pixels themselves, BH x TW pixels of an
// output-shaped tensor (Ho x Wo) from (oh0, ow0), PAD 0.
template <typename scalar_t, int PAD, int LB, int HALO = 2>
__device__ __forceinline__ void dw_s1_nhwc_stage(const scalar_t* __restrict__ x, scalar_t* tile, const DwS1NhwcArgs& a,
                                                 const DwS1NhwcTile& tt) {
  static_assert(HALO == 2 || (HALO == 0 && PAD == 0), "stage: the input window, or the output tile");
  constexpr int L = LB / static_cast<int>(sizeof(scalar_t));
  const int H = HALO == 2 ? a.H : a.Ho, W = HALO == 2 ? a.W : a.Wo;
  const int pitch = a.TW + HALO;  // staged pixels per tile row
  const int sw = tt.bw + HALO;    // staged columns
  const int rows = tt.bh + HALO;  // staged rows
  const int cpp = tt.cba / L;     // copies per pixel
  // Thread i copies part i % cpp of staged pixels i / cpp, + step, ...: the
  // pixel's row and column, and both offsets, advance by additions only (the
  // stage is a large part of this kernel's instructions: a division or a
  // 64-bit index product per copy would be most of it).
  const int step = static_cast<int>(blockDim.x) / cpp;
  const int first = static_cast<int>(threadIdx.x) / cpp;
  if (first >= step) return;
  const int part = static_cast<int>(threadIdx.x) - first * cpp;
  int rr = first / sw, qq = first - rr * sw;
  const int ih0 = tt.oh0 - PAD, iw0 = tt.ow0 - PAD;
  // Tiles away from the border stage only pixels inside the image; pixels
  // outside it are staged as zeros by the same copy instruction.
  const bool inside = ih0 >= 0 && iw0 >= 0 && ih0 + rows <= H && iw0 + sw <= W;
  const int64_t C = a.C;
  // Where (rr, qq) is read from (the image's pixel (ih0 + rr, iw0 + qq):
  // the pointer lies outside x for pixels outside the image, which are not
  // read) and written to (a shared-memory address).
  const scalar_t* src = x + ((tt.n * H + ih0 + rr) * W + iw0 + qq) * C + tt.cin0 + part * L;
  uint32_t dst = opforge::cuda::smem_u32(tile + (rr * pitch + qq) * a.CB + part * L);
  const int64_t xstep = step * C, xwrap = (W - sw) * C;
  const uint32_t tstep = step * a.CB * sizeof(scalar_t), twrap = (pitch - sw) * a.CB * sizeof(scalar_t);
  while (rr < rows) {
    const bool in = inside || (static_cast<unsigned>(ih0 + rr) < static_cast<unsigned>(H) &&
                               static_cast<unsigned>(iw0 + qq) < static_cast<unsigned>(W));
    opforge::cuda::copy_async_zfill<LB>(dst, src, in);
    qq += step;
    src += xstep;
    dst += tstep;
    while (qq >= sw) qq -= sw, ++rr, src += xwrap, dst += twrap;
  }
}

}  // namespace
}  // namespace opforge::conv

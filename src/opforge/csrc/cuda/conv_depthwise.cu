// Depthwise 3x3 convolution on CUDA: direct kernels, memory-bound by design.
//
// Forward, NCHW: one block per (image, input channel, tile of output rows x
// columns). The input tile with its halo is staged in shared memory (opmath)
// with 16-byte global loads along W where the row is aligned (scalar loads
// for the halo and unaligned rows); each thread then computes V consecutive
// outputs of a row for every channel multiplier from a window read with
// vector shared-memory loads, adds the bias, applies ReLU and stores V
// values at once (16 bytes when aligned).
// Forward, NHWC: one block per (image, tile of 8x8 or 4x8 output pixels,
// chunk of input channels); the tile is staged with 16-byte loads along C and
// each thread computes V consecutive output channels of one pixel.
// Backward: for stride 1 and multiplier 1, NHWC with padding 1 runs one
// fused kernel (grad x and the weight sums from one stage of grad_out,
// result and x per tile); otherwise one pass masks grad_out by the fused
// ReLU's result and grad x is the forward kernel run on it with the kernel
// flipped (padding 2 - pad), the weight sums coming from staged kernels on
// the forward's tiles; other strides and multipliers: grad x is a gather (the
// flipped kernel, stride-aware) with the ReLU mask applied as grad_out is
// read (row kernels for stride 1 when the forward's do not apply); grad
// weight and grad bias are per-channel reductions: block reductions into a
// (K, splits, 10) partial buffer, then one small kernel sums the splits in a
// fixed order (deterministic, no atomics).
#include <ATen/Functions.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <opforge/cuda_async.cuh>
#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>
#include <opforge/dispatch.h>

#include "cuda/conv_depthwise.h"

namespace opforge::conv {
namespace {

using opforge::cuda::AlignedVec;

constexpr int kThreads = 256;

struct DwArgs {
  int64_t N, C, H, W, K, Ho, Wo;
  int pad, mult;
  bool relu;
  // NCHW tiling
  int toh, tow, tiles_h, tiles_w, pitch, tih;
  bool store_vec;
  // NHWC tiling
  int cb, chunks;
};

// Copies V consecutive values between aligned shared-memory (or register)
// locations in accesses of at most 16 bytes (the dynamic shared memory base is
// only guaranteed 16-byte alignment).
template <typename T, int V>
struct SmemVec {
  static constexpr int R = (V * sizeof(T) > 16) ? static_cast<int>(16 / sizeof(T)) : V;
  __device__ __forceinline__ static void load(const T* src, T* dst) {
#pragma unroll
    for (int q = 0; q < V / R; ++q) {
      const auto v = reinterpret_cast<const AlignedVec<T, R>*>(src)[q];
#pragma unroll
      for (int e = 0; e < R; ++e) dst[q * R + e] = v.val[e];
    }
  }
  __device__ __forceinline__ static void store(const T* src, T* dst) {
#pragma unroll
    for (int q = 0; q < V / R; ++q) {
      AlignedVec<T, R> v;
#pragma unroll
      for (int e = 0; e < R; ++e) v.val[e] = src[q * R + e];
      reinterpret_cast<AlignedVec<T, R>*>(dst)[q] = v;
    }
  }
};

template <typename T>
__device__ __forceinline__ T relu_op(T v) {
  return v < T(0) ? T(0) : v;  // NaN stays NaN
}

// ---------------------------------------------------------------- forward NCHW

// (kThreads, 1): with no minimum, ptxas held the float64 instantiations to 48
// registers and spilled.
template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads, 1) dw_fwd_nchw(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                                        const scalar_t* __restrict__ b, scalar_t* __restrict__ out,
                                                        DwArgs a) {
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
        if (a.relu) acc = relu_op(acc);
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

// ---------------------------------------------------------------- forward NHWC

template <int S>
struct NhwcTile {
  static constexpr int OH = S == 1 ? 8 : 4, OW = 8;
  static constexpr int IH = (OH - 1) * S + 3, IW = (OW - 1) * S + 3;
};

template <typename scalar_t, int V, int S>
__global__ void __launch_bounds__(kThreads) dw_fwd_nhwc(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                                        const scalar_t* __restrict__ b, scalar_t* __restrict__ out,
                                                        DwArgs a) {
  using opmath_t = at::opmath_type<scalar_t>;
  using T = NhwcTile<S>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int cb = a.cb;                 // staged input channels (multiple of V)
  const int kb = cb * a.mult;          // output channels of the chunk
  opmath_t* tile = reinterpret_cast<opmath_t*>(smem_raw);       // [IH][IW][cb]
  opmath_t* ws = tile + T::IH * T::IW * cb;                       // [9][kb]
  opmath_t* bs = ws + 9 * kb;                                     // [kb]

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
      const auto val = *reinterpret_cast<const AlignedVec<scalar_t, V>*>(x + ((n * H + ih) * W + iw) * C + cin0 + v * V);
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
    for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(a.relu ? relu_op(acc[e]) : acc[e]);
    *reinterpret_cast<AlignedVec<scalar_t, V>*>(out + ((n * a.Ho + oh) * a.Wo + ow) * K + k0 + kk0) = res;
  }
}

// ------------------------------------------------ forward, stride 1: staged planes

using opforge::cuda::copy_async;
using opforge::cuda::copy_async_wait_all;

__device__ __forceinline__ void zero_bytes(void* smem, int bytes) {
  if (bytes == 16) {
    *reinterpret_cast<uint4*>(smem) = make_uint4(0, 0, 0, 0);
  } else if (bytes == 8) {
    *reinterpret_cast<uint2*>(smem) = make_uint2(0, 0);
  } else {
    *reinterpret_cast<unsigned*>(smem) = 0u;
  }
}

// max(v, 0) that keeps NaN (one instruction on sm_80+).
__device__ __forceinline__ float relu_nan(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(r) : "f"(v));
  return r;
#else
  return relu_op(v);
#endif
}

// Four consecutive staged values (8-byte aligned) as float. bfloat16
// widens by bit operations on the two 32-bit words: the high value is its
// word with the low half cleared, one instruction where the element-wise
// conversion took two (a byte permute, then a shift).
template <typename scalar_t>
__device__ __forceinline__ void widen4(const scalar_t* p, float (&r)[4]) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    r[0] = __uint_as_float(w.x << 16);
    r[1] = __uint_as_float(w.x & 0xffff0000u);
    r[2] = __uint_as_float(w.y << 16);
    r[3] = __uint_as_float(w.y & 0xffff0000u);
  } else {
    const auto v = *reinterpret_cast<const AlignedVec<scalar_t, 4>*>(p);
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = static_cast<float>(v.val[e]);
  }
}

// Four results rounded to scalar_t, after relu_nan when relu. From sm_80 on
// the half types round two values per instruction (cvt ...x2, its .relu
// form keeping NaN as relu_nan does) instead of one value per conversion
// plus byte permutes to pair them.
template <typename scalar_t>
__device__ __forceinline__ AlignedVec<scalar_t, 4> narrow4(const float (&v)[4], bool relu) {
  AlignedVec<scalar_t, 4> out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(scalar_t) == 2) {
    uint32_t w[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (relu) {
          asm("cvt.rn.relu.bf16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(v[2 * k]), "f"(v[2 * k + 1]));
        } else {
          asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(v[2 * k]), "f"(v[2 * k + 1]));
        }
      } else {
        if (relu) {
          asm("cvt.rn.relu.f16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(v[2 * k]), "f"(v[2 * k + 1]));
        } else {
          asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(v[2 * k]), "f"(v[2 * k + 1]));
        }
      }
    }
    memcpy(&out, w, sizeof(out));
    return out;
  }
#endif
#pragma unroll
  for (int e = 0; e < 4; ++e) out.val[e] = static_cast<scalar_t>(relu ? relu_nan(v[e]) : v[e]);
  return out;
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
// One tile per block. (Blocks walking several tiles with two stage buffers,
// the next tile's copies in flight during the current one's compute, were
// measured 5-25% slower on the H200 at every blocks-per-SM setting: these
// kernels are bound by instruction issue more than by memory latency, and
// the second buffer cost resident blocks.)
struct DwS1Args {
  int64_t planes;      // N * C
  int64_t plane_step;  // between a tile's planes: 1, or C (planes of one channel)
  int C, H, W, Ho, Wo, mult;
  int P, ngw, R, runs, BH, bands, PB, SR, LB, lpr_shift;
  bool relu, store_vec;
};

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
        for (int e = 0; e < V; ++e) res.val[e] = static_cast<scalar_t>(a.relu ? relu_nan(accP[e]) : accP[e]);
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
__global__ void __launch_bounds__(kThreads) dw_fwd_nchw_s1(const scalar_t* __restrict__ x,
                                                           const scalar_t* __restrict__ w,
                                                           const scalar_t* __restrict__ b,
                                                           scalar_t* __restrict__ out, DwS1Args a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  scalar_t* stage = reinterpret_cast<scalar_t*>(smem_raw);
  const DwS1Tile tile = dw_s1_tile(a, blockIdx.x);
  dw_s1_stage<scalar_t, PAD>(x, stage, a, tile);
  copy_async_wait_all();
  __syncthreads();  // every thread's copies (and zeros) are in place
  dw_s1_compute<scalar_t, V, PAD>(stage, w, b, out, a, tile);
}

// NHWC, stride 1, multiplier 1, C % 4 == 0. A tile is (BH + 2) x (TW + 2)
// input pixels x CB channels staged in shared memory (input dtype, copies of
// LB bytes along C, zeros outside the image). Each thread owns 4 consecutive
// channels of one output column and slides down the tile's BH rows with the
// 36 weights, one staged row and two partial sums in registers (three 4-wide
// shared loads per output row), storing 4 channels at once. One tile per
// block, as in the NCHW kernel above.
struct DwS1NhwcArgs {
  int64_t N;
  int C, H, W, Ho, Wo;
  int CB, chunks, TW, BH, tiles_w, tiles_h, LB;
  bool relu;
};

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
  const int pitch = a.TW + HALO;     // staged pixels per tile row
  const int sw = tt.bw + HALO;       // staged columns
  const int rows = tt.bh + HALO;     // staged rows
  const int cpp = tt.cba / L;        // copies per pixel
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

template <typename scalar_t, int PAD, int LB>
__global__ void __launch_bounds__(kThreads) dw_fwd_nhwc_s1(const scalar_t* __restrict__ x,
                                                           const scalar_t* __restrict__ w,
                                                           const scalar_t* __restrict__ b,
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
  __syncthreads();         // and every thread's
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
    *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = narrow4<scalar_t>(accP, a.relu);
    o += ostep;
#pragma unroll
    for (int e = 0; e < V; ++e) accP[e] = accQ[e];
    fma_row(xr, 1, accP);
#pragma unroll
    for (int e = 0; e < V; ++e) accQ[e] = bv[e];
    fma_row(xr, 0, accQ);
  }
}

// ---------------------------------------------------------------- backward: grad x

// grad_out where the fused ReLU passed it, else 0: zero where result <= 0,
// as torch's ReLU backward (threshold_backward) and the add family's
// ReluBackward do (a NaN result passes the gradient); without a fused ReLU
// (res null) grad_out itself.
template <typename opmath_t, typename scalar_t, typename I>
__device__ __forceinline__ opmath_t masked_grad(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                                                I off) {
  const opmath_t v = static_cast<opmath_t>(g[off]);
  return res != nullptr && static_cast<opmath_t>(res[off]) <= opmath_t(0) ? opmath_t(0) : v;
}

// One thread per element of grad x (in x's layout order):
// gx[n,c,ih,iw] = sum_j sum_{kh,kw} g'[n, c*m+j, oh, ow] * w[c*m+j, kh, kw]
// where oh*S = ih + pad - kh, ow*S = iw + pad - kw, g' = g * (result > 0).
// IT is int32_t when every index fits (64-bit divisions are subroutine calls
// whose saved registers spill), else int64_t. At most 64 registers (four
// blocks per SM): ptxas's own choice of 32-48 spilled.
template <typename scalar_t, bool kNhwc, typename IT>
__global__ void __launch_bounds__(kThreads, 4) dw_bwd_input(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                                                         const scalar_t* __restrict__ w, scalar_t* __restrict__ gx,
                                                         DwArgs a, int S, IT total) {
  using opmath_t = at::opmath_type<scalar_t>;
  const IT C = static_cast<IT>(a.C), H = static_cast<IT>(a.H), W = static_cast<IT>(a.W);
  const IT K = static_cast<IT>(a.K), Ho = static_cast<IT>(a.Ho), Wo = static_cast<IT>(a.Wo);
  const IT pad = a.pad, mult = a.mult, stride = S;
  const IT step = static_cast<IT>(gridDim.x) * blockDim.x;
  for (IT idx = static_cast<IT>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += step) {
    IT n, c, ih, iw, rem = idx;
    if (kNhwc) {
      c = rem % C; rem /= C;
      iw = rem % W; rem /= W;
      ih = rem % H; n = rem / H;
    } else {
      iw = rem % W; rem /= W;
      ih = rem % H; rem /= H;
      c = rem % C; n = rem / C;
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
// arithmetic, which ran 3-5x slower than cuDNN's whole backward.
// NCHW: warps take the N * C * H rows of grad x in turn, lanes along iw
// (coalesced); the 9 taps read grad_out and result through L1.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) dw_bwd_input_s1_nchw(const scalar_t* __restrict__ g,
                                                                 const scalar_t* __restrict__ res,
                                                                 const scalar_t* __restrict__ w,
                                                                 scalar_t* __restrict__ gx, DwArgs a) {
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
__global__ void __launch_bounds__(kThreads, 2) dw_bwd_input_s1_nhwc(const scalar_t* __restrict__ g,
                                                                    const scalar_t* __restrict__ res,
                                                                    const scalar_t* __restrict__ w,
                                                                    scalar_t* __restrict__ gx, DwArgs a,
                                                                    int64_t rows_per_split) {
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

// ---------------------------------------------------------------- backward: grad weight / bias

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// out[t] = the block's sum of every thread's acc[t] (t < 10), in a fixed
// order: within warps, then over the warps. Every thread of the block (a
// multiple of 32, at most kThreads) must call it.
template <typename T>
__device__ __forceinline__ void block_sums10(const T (&acc)[10], T* __restrict__ out) {
  __shared__ T red[kThreads / 32][10];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int t = 0; t < 10; ++t) {
    const T v = warp_sum(acc[t]);
    if (lane == 0) red[warp][t] = v;
  }
  __syncthreads();
  if (threadIdx.x < 10) {
    T sum = T(0);
    for (int q = 0; q < static_cast<int>(blockDim.x / 32); ++q) sum += red[q][threadIdx.x];
    out[threadIdx.x] = sum;
  }
}

// Both weight kernels split the N * Ho output rows (of one channel) into
// `splits` runs of rows_per_split rows and find a row's (n, oh) with one
// division per row, not per element (64-bit divisions are subroutine calls).
// A thread's 10 sums (9 taps and the bias) go to part[(k * splits + split) *
// 10 + t] after a block reduction.

// NCHW: block (k, split); warp w takes rows w, w + 8, ... of the split, its
// lanes along ow (coalesced loads of grad_out, result and x).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) dw_bwd_weight_nchw(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                                                               const scalar_t* __restrict__ x,
                                                               at::opmath_type<scalar_t>* __restrict__ part, DwArgs a,
                                                               int S, int splits, int64_t rows_per_split) {
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
__global__ void __launch_bounds__(kThreads, 2) dw_bwd_weight_nhwc(const scalar_t* __restrict__ g, const scalar_t* __restrict__ res,
                                                               const scalar_t* __restrict__ x,
                                                               at::opmath_type<scalar_t>* __restrict__ part, DwArgs a,
                                                               int splits, int64_t rows_per_split) {
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
// tile's grad_out pixels (already masked) too (read from global memory in
// the row loop instead, the whole NHWC backward at bfloat16 N64 C128 112x112
// took 0.52 ms on the H200, staged 0.48). (The per-row kernels above index
// every tap with 64-bit arithmetic and bounds tests: with them the whole
// backward ran at 8-19% of its floor at that shape.)

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
__global__ void __launch_bounds__(kThreads) dw_bwd_weight_nchw_s1(const scalar_t* __restrict__ x,
                                                                  const scalar_t* __restrict__ g,
                                                                  const scalar_t* __restrict__ res,
                                                                  float* __restrict__ part, DwS1Args a, int splits,
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
      const int64_t goff = ((n0 + p) * a.C + c) * static_cast<int64_t>(a.Ho) * a.Wo +
                           static_cast<int64_t>(tt.oh0 + r0) * a.Wo + ow;
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

// The end of the NHWC weight-sum kernels: thread (cv, q) = threadIdx.x
// (cv < cvn, q < tw when `active`) holds 10 sums for 4 channels; they are
// added over q in a fixed order through `red` (the block's shared memory,
// 40 floats per thread: the host sizes it) into part[(c * splits + split) *
// 10 + t]. Every thread of the block must call it, after a barrier that
// follows the last use of the stage that red overwrites.
__device__ __forceinline__ void nhwc_block_sums(const float (&acc)[10][4], float* red, bool active, int cvn, int tw,
                                                int cin0, int split, int splits, float* __restrict__ part) {
  constexpr int V = 4;
  if (active) {
#pragma unroll
    for (int t = 0; t < 10; ++t)
#pragma unroll
      for (int e = 0; e < V; ++e) red[(threadIdx.x * 10 + t) * V + e] = acc[t][e];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cvn * V * 10; i += blockDim.x) {
    const int t = i % 10, cc = i / 10;  // channel cin0 + cc
    const int v = cc / V, e = cc % V;
    float sum = 0.f;
    for (int qq = 0; qq < tw; ++qq) sum += red[((qq * cvn + v) * 10 + t) * V + e];
    part[(static_cast<int64_t>(cin0 + cc) * splits + split) * 10 + t] = sum;
  }
}

// NHWC: block (chunk of CB channels, split); tiles are the forward's
// (image, BH x TW output pixels) of that chunk, and grad_out's pixels of the
// tile (already masked) are staged next to the input window. A thread item
// is 4 channels of one output column, as in the forward.
// (kThreads, 2): ptxas's own choice of 80 registers spilled the float32
// instantiations.
template <typename scalar_t, int PAD, int LB>
__global__ void __launch_bounds__(kThreads, 2) dw_bwd_weight_nhwc_s1(const scalar_t* __restrict__ x,
                                                                  const scalar_t* __restrict__ g,
                                                                  float* __restrict__ part, DwS1NhwcArgs a,
                                                                  int splits) {
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

// ---------------------------------------------------------------- backward: fused, NHWC, padding 1

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
__global__ void __launch_bounds__(kFusedThreads, 3) dw_bwd_fused_nhwc_s1(const scalar_t* __restrict__ g,
                                                                 const scalar_t* __restrict__ res,
                                                                 const scalar_t* __restrict__ x,
                                                                 const scalar_t* __restrict__ w,
                                                                 scalar_t* __restrict__ gx, float* __restrict__ part,
                                                                 DwS1NhwcArgs a, int splits) {
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
    for (int t = 0; t < 9; ++t) wf[t][e] = active ? static_cast<float>(w[static_cast<int64_t>(c0 + e) * 9 + 8 - t]) : 0.f;
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
      float accP[V], accQ[V];      // grad x rows ri - 2 and ri - 1 in progress
      float xp[3][V];              // the input row one step behind
      float gc1[V], gc2[V];        // grad_out centres of staged rows ri - 1, ri - 2 (0 off the tile)
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
            *reinterpret_cast<AlignedVec<scalar_t, V>*>(o) = narrow4<scalar_t>(accP, false);
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

template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

template <typename scalar_t, int V>
void launch_fwd_v(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* out, const DwArgs& a, int S,
                  bool nhwc, int64_t blocks, size_t smem, cudaStream_t stream) {
  if (nhwc) {
    auto kernel = S == 1 ? dw_fwd_nhwc<scalar_t, V, 1> : dw_fwd_nhwc<scalar_t, V, 2>;
    set_smem(kernel, smem);
    kernel<<<blocks, kThreads, smem, stream>>>(x, w, b, out, a);
  } else {
    auto kernel = S == 1 ? dw_fwd_nchw<scalar_t, V, 1> : dw_fwd_nchw<scalar_t, V, 2>;
    set_smem(kernel, smem);
    kernel<<<blocks, kThreads, smem, stream>>>(x, w, b, out, a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr size_t kStageBudget = 48 * 1024;  // shared bytes per block of the stride-1 kernels

int round_up(int v, int m) { return (v + m - 1) / m * m; }

// Tiling of the stride-1 NCHW kernels (forward, and the backward's weight
// gradient on the same stage), when the shape suits them: float32/float16/
// bfloat16 and three staged rows of one plane within the budget. V: output
// columns per thread item. `per_channel`: the planes of a tile are those of
// one channel (plane_step C, the weight gradient's), else consecutive ones.
struct NchwS1Plan {
  DwS1Args a;
  int V, threads;
};

template <typename scalar_t>
bool plan_nchw_s1(const Geometry& g, const scalar_t* xp, const scalar_t* op, bool per_channel, NchwS1Plan& plan) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if (s == 8 || g.stride != 1 || g.H > INT32_MAX / 4 || g.W > INT32_MAX / 4 || g.C > INT32_MAX || g.mult > INT32_MAX)
    return false;
  constexpr int E = 16 / s;
  const int W = static_cast<int>(g.W), Wo = static_cast<int>(g.Wo), Ho = static_cast<int>(g.Ho);
  // Output columns per thread: 16 bytes, or 8 when that divides Wo and 16 does not.
  int V = E;
  if (Wo % V != 0 && Wo % (V / 2) == 0) V /= 2;
  DwS1Args a{};
  a.planes = g.N * g.C;
  a.plane_step = per_channel ? g.C : 1;
  a.C = static_cast<int>(g.C);
  a.H = static_cast<int>(g.H);
  a.W = W;
  a.Ho = Ho;
  a.Wo = Wo;
  a.mult = static_cast<int>(g.mult);
  a.ngw = (Wo + V - 1) / V;
  a.P = E + round_up(std::max(W, a.ngw * V + 2), E);
  const size_t row_bytes = static_cast<size_t>(a.P) * s;
  const int max_rows = static_cast<int>(kStageBudget / row_bytes) - 2;  // output rows per block
  if (max_rows < 1) return false;
  a.LB = s;
  for (int lb : {16, 8, 4}) {
    if (lb >= s && (static_cast<int64_t>(W) * s) % lb == 0 && opforge::cuda::is_aligned(xp, lb)) {
      a.LB = lb;
      break;
    }
  }
  a.store_vec = Wo % V == 0 && opforge::cuda::is_aligned(op, static_cast<size_t>(V) * s);
  // Bands of output rows (balanced), runs of up to 12 rows per thread (on
  // the H200, bfloat16 N64 C128 112x112: 12 rows 0.127 ms, 8 rows 0.141,
  // 16 rows 0.135; within noise of the best on the other shapes measured).
  a.bands = (Ho + max_rows - 1) / max_rows;
  a.BH = (Ho + a.bands - 1) / a.bands;
  a.bands = (Ho + a.BH - 1) / a.BH;
  a.runs = (a.BH + 11) / 12;
  a.R = (a.BH + a.runs - 1) / a.runs;
  a.runs = (a.BH + a.R - 1) / a.R;
  a.SR = a.BH + 2;
  const int per_plane = a.runs * a.ngw;  // thread items per plane (band)
  a.PB = 1;
  if (a.bands == 1) {
    // Several small planes per block: up to kThreads items and the budget,
    // while keeping at least 4 tiles per SM (and, of one channel's planes,
    // at most N).
    const int64_t by_threads = std::max(1, kThreads / per_plane);
    const int64_t by_smem = static_cast<int64_t>(kStageBudget / (row_bytes * a.SR));
    const int64_t by_blocks = std::max<int64_t>(1, a.planes / (4LL * opforge::cuda::sm_count()));
    a.PB = static_cast<int>(std::max<int64_t>(1, std::min({by_threads, by_smem, by_blocks, per_channel ? g.N : a.planes})));
  }
  const int vec_per_row = W / (a.LB / s);
  // Lanes per staged row: enough for its copies (with 16-byte copies, for
  // all of its chunks, zeros included), at most a warp.
  const int per_row = a.LB == 16 ? a.P / E : vec_per_row;
  a.lpr_shift = 0;
  while ((1 << a.lpr_shift) < std::min(per_row, 32)) ++a.lpr_shift;
  plan.a = a;
  plan.V = V;
  plan.threads = std::min(kThreads, round_up(a.PB * per_plane, 32));
  return true;
}

template <typename scalar_t>
size_t nchw_s1_stage_bytes(const DwS1Args& a) {
  return static_cast<size_t>(a.P) * sizeof(scalar_t) * a.SR * a.PB;
}

// Calls f(std::integral_constant<int, V>, std::integral_constant<int, PAD>)
// for the plan's V (16 or 8 bytes of columns) and padding 0, 1 or 2.
template <typename scalar_t, typename F>
void with_nchw_s1_consts(int V, int64_t pad, F&& f) {
  constexpr int E = 16 / static_cast<int>(sizeof(scalar_t));
  auto with_pad = [&](auto v) {
    if (pad == 2) f(v, std::integral_constant<int, 2>{});
    else if (pad == 1) f(v, std::integral_constant<int, 1>{});
    else f(v, std::integral_constant<int, 0>{});
  };
  if (V == E) with_pad(std::integral_constant<int, E>{});
  else with_pad(std::integral_constant<int, E / 2>{});
}

// The stride-1 NCHW forward, when plan_nchw_s1 accepts the shape.
template <typename scalar_t>
bool try_forward_nchw_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         bool relu, cudaStream_t stream) {
  if constexpr (sizeof(scalar_t) == 8) {
    return false;
  } else {
    NchwS1Plan plan;
    if (!plan_nchw_s1<scalar_t>(g, xp, op, false, plan)) return false;
    plan.a.relu = relu;
    const int64_t blocks = (plan.a.planes + plan.a.PB - 1) / plan.a.PB * plan.a.bands;
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    const size_t smem = nchw_s1_stage_bytes<scalar_t>(plan.a);
    with_nchw_s1_consts<scalar_t>(plan.V, g.pad, [&](auto v, auto pad) {
      auto kernel = dw_fwd_nchw_s1<scalar_t, decltype(v)::value, decltype(pad)::value>;
      set_smem(kernel, smem);
      kernel<<<static_cast<unsigned>(blocks), plan.threads, smem, stream>>>(xp, wp, bp, op, plan.a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return true;
  }
}

// Tiling of the stride-1 NHWC kernels: multiplier 1, C % 4 == 0, x aligned
// for at least 4-byte copies and out for 4-channel accesses.
template <typename scalar_t>
bool plan_nhwc_s1(const Geometry& g, const scalar_t* xp, const scalar_t* op, int max_rows, DwS1NhwcArgs& a,
                  int& threads) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if (s == 8 || g.stride != 1 || g.mult != 1 || g.C % 4 != 0 || g.C > INT32_MAX / 2 || g.H > INT32_MAX / 4 ||
      g.W > INT32_MAX / 4 || !opforge::cuda::is_aligned(op, 4 * s))
    return false;
  a = DwS1NhwcArgs{};
  a.N = g.N;
  a.C = static_cast<int>(g.C);
  a.H = static_cast<int>(g.H);
  a.W = static_cast<int>(g.W);
  a.Ho = static_cast<int>(g.Ho);
  a.Wo = static_cast<int>(g.Wo);
  a.CB = std::min(32, a.C);
  a.LB = 0;
  for (int lb : {16, 8, 4}) {
    if ((a.C * s) % lb == 0 && (a.CB * s) % lb == 0 && opforge::cuda::is_aligned(xp, lb)) {
      a.LB = lb;
      break;
    }
  }
  if (a.LB == 0) return false;
  a.chunks = (a.C + a.CB - 1) / a.CB;
  // Tiles of up to 16 x 16 output pixels, balanced over the image.
  a.tiles_w = (a.Wo + 15) / 16;
  a.TW = (a.Wo + a.tiles_w - 1) / a.tiles_w;
  a.tiles_w = (a.Wo + a.TW - 1) / a.TW;
  // Tile rows: max_rows, halved down to 4 while that leaves fewer than 3
  // blocks per SM (small problems: more, shorter blocks in flight beat fewer
  // halo rows).
  int rows = max_rows;
  const int64_t want = 3LL * opforge::cuda::sm_count();
  while (rows > 4 && g.N * ((a.Ho + rows - 1) / rows) * a.tiles_w * a.chunks < want) rows /= 2;
  a.tiles_h = (a.Ho + rows - 1) / rows;
  a.BH = (a.Ho + a.tiles_h - 1) / a.tiles_h;
  a.tiles_h = (a.Ho + a.BH - 1) / a.BH;
  threads = round_up(a.CB / 4 * a.TW, 32);
  return true;
}

template <typename scalar_t>
size_t nhwc_s1_stage_bytes(const DwS1NhwcArgs& a) {
  return static_cast<size_t>(a.BH + 2) * (a.TW + 2) * a.CB * sizeof(scalar_t);
}

// Calls f(std::integral_constant<int, PAD>, std::integral_constant<int, LB>).
template <typename F>
void with_nhwc_s1_consts(int64_t pad, int LB, F&& f) {
  auto with_lb = [&](auto pd) {
    if (LB == 16) f(pd, std::integral_constant<int, 16>{});
    else if (LB == 8) f(pd, std::integral_constant<int, 8>{});
    else f(pd, std::integral_constant<int, 4>{});
  };
  if (pad == 2) with_lb(std::integral_constant<int, 2>{});
  else if (pad == 1) with_lb(std::integral_constant<int, 1>{});
  else with_lb(std::integral_constant<int, 0>{});
}

// The stride-1 NHWC forward, when plan_nhwc_s1 accepts the shape.
template <typename scalar_t>
bool try_forward_nhwc_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         bool relu, cudaStream_t stream) {
  if constexpr (sizeof(scalar_t) == 8) {
    return false;
  } else {
    DwS1NhwcArgs a;
    int threads;
    // 32 rows for the half types (their tile is half the bytes; on the H200
    // bfloat16 112x112 0.164 ms vs 0.170 with 16 rows, float32 0.251 vs
    // 0.237), 16 for float32.
    if (!plan_nhwc_s1<scalar_t>(g, xp, op, sizeof(scalar_t) == 2 ? 32 : 16, a, threads)) return false;
    a.relu = relu;
    const int64_t blocks = g.N * a.tiles_h * a.tiles_w * a.chunks;
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    const size_t smem = nhwc_s1_stage_bytes<scalar_t>(a);
    with_nhwc_s1_consts(g.pad, a.LB, [&](auto pad, auto lb) {
      auto kernel = dw_fwd_nhwc_s1<scalar_t, decltype(pad)::value, decltype(lb)::value>;
      set_smem(kernel, smem);
      kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(xp, wp, bp, op, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return true;
  }
}

// Rows per split of the backward kernels that split `rows` rows (over
// col_blocks blocks of columns or channels): about 8 blocks per SM in all,
// at least 8 rows per split (a warp or thread row each), at most 65535
// splits (grid.y).
int64_t rows_per_split_for(int64_t rows, int64_t col_blocks) {
  const int64_t want = std::min<int64_t>(65535, (8LL * opforge::cuda::sm_count() + col_blocks - 1) / col_blocks);
  return std::max<int64_t>(8, (rows + want - 1) / want);
}

// grad x of a stride-1, multiplier-1 convolution is the stride-1 depthwise
// convolution of the masked grad_out (N, C, Ho, Wo) with the kernel flipped
// and padding 2 - pad, whose output is (N, C, H, W): the forward's tiled
// kernels (staged with cp.async, at 70-90% of the H200's bandwidth) do it.
// False where they do not apply (float64, NHWC with C % 4 != 0, alignment).
template <typename scalar_t>
bool try_backward_input_as_forward(const scalar_t* gm, const scalar_t* wflip, scalar_t* gx, const Geometry& g,
                                   bool nhwc, cudaStream_t stream) {
  Geometry t = g;
  t.H = g.Ho;
  t.W = g.Wo;
  t.Ho = g.H;
  t.Wo = g.W;
  t.pad = 2 - g.pad;
  return nhwc ? try_forward_nhwc_s1<scalar_t>(gm, wflip, nullptr, gx, t, false, stream)
              : try_forward_nchw_s1<scalar_t>(gm, wflip, nullptr, gx, t, false, stream);
}

// Where the stride-1 tiled kernels may serve the backward (their planners
// still decline some shapes: very wide rows, misaligned pointers).
bool staged_s1_applies(const Geometry& g, bool nhwc, at::ScalarType dtype) {
  return g.stride == 1 && g.mult == 1 && dtype != at::kDouble && (!nhwc || g.C % 4 == 0);
}

DwArgs base_args(const Geometry& g) {
  DwArgs a{};
  a.N = g.N; a.C = g.C; a.H = g.H; a.W = g.W; a.K = g.K; a.Ho = g.Ho; a.Wo = g.Wo;
  a.pad = static_cast<int>(g.pad);
  a.mult = static_cast<int>(g.mult);
  return a;
}

}  // namespace

void depthwise_forward_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool relu,
                            at::Tensor& out, const Geometry& g, bool nhwc) {
  TORCH_CHECK(g.N <= INT32_MAX && g.Ho <= INT32_MAX / 2 && g.Wo <= INT32_MAX / 2,
              "opforge.conv2d_3x3: tensor too large for the depthwise CUDA kernel");
  auto stream = at::cuda::getCurrentCUDAStream();
  DwArgs a = base_args(g);
  a.relu = relu;
  const int S = static_cast<int>(g.stride);
  OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* xp = x.const_data_ptr<scalar_t>();
    const auto* wp = w.const_data_ptr<scalar_t>();
    const auto* bp = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    auto* op = out.mutable_data_ptr<scalar_t>();
    if (nhwc ? try_forward_nhwc_s1<scalar_t>(xp, wp, bp, op, g, relu, stream)
             : try_forward_nchw_s1<scalar_t>(xp, wp, bp, op, g, relu, stream)) {
      return;
    }
    int V;
    int64_t blocks;
    size_t smem;
    if (nhwc) {
      // V along the channels: C % V == 0 (then K = C * m too).
      V = opforge::cuda::pick_vec<scalar_t>(g.C, {xp, op});
      const int oh_t = S == 1 ? 8 : 4, ow_t = 8;
      const int ih_t = (oh_t - 1) * S + 3, iw_t = (ow_t - 1) * S + 3;
      const int base = sizeof(opmath_t) == 8 ? 32 : 64;
      int cb = static_cast<int>(std::min<int64_t>(g.C, std::max<int64_t>(V, base / std::max<int64_t>(1, g.mult))));
      cb = std::max(V, cb / V * V);
      a.cb = cb;
      a.chunks = static_cast<int>((g.C + cb - 1) / cb);
      a.tiles_h = static_cast<int>((g.Ho + oh_t - 1) / oh_t);
      a.tiles_w = static_cast<int>((g.Wo + ow_t - 1) / ow_t);
      blocks = g.N * a.tiles_h * a.tiles_w * a.chunks;
      smem = sizeof(opmath_t) * (static_cast<size_t>(ih_t) * iw_t * cb + 10 * static_cast<size_t>(cb) * g.mult);
    } else {
      // V along W: loads need W % V == 0, stores Wo % V == 0 (else scalar stores).
      V = opforge::cuda::pick_vec<scalar_t>(g.W, {xp});
      a.tow = static_cast<int>(g.Wo <= 128 ? g.Wo : 64);
      const int max_out = sizeof(opmath_t) == 8 ? 1024 : 2048;
      int toh = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(g.Ho, max_out / a.tow)));
      const int64_t th = (g.Ho + toh - 1) / toh;
      toh = static_cast<int>((g.Ho + th - 1) / th);  // balanced tiles
      a.toh = toh;
      a.tiles_h = static_cast<int>((g.Ho + toh - 1) / toh);
      a.tiles_w = static_cast<int>((g.Wo + a.tow - 1) / a.tow);
      a.tih = (toh - 1) * S + 3;
      const int ngw = (a.tow + V - 1) / V;
      const int nw = (V * S + 2 + V - 1) / V;
      // Row pitch: staged width, and every window read stays inside the row.
      const int need = std::max((a.tow - 1) * S + 3, (ngw - 1) * V * S + nw * V);
      a.pitch = (need + V - 1) / V * V;
      a.store_vec = V > 1 && g.Wo % V == 0 && opforge::cuda::is_aligned(op, V * sizeof(scalar_t));
      blocks = g.N * g.C * a.tiles_h * a.tiles_w;
      smem = sizeof(opmath_t) * (static_cast<size_t>(a.tih) * a.pitch + 10 * static_cast<size_t>(g.mult));
    }
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    TORCH_CHECK(smem <= 160 * 1024, "opforge.conv2d_3x3: channel multiplier ", g.mult,
                " needs more shared memory than the depthwise CUDA kernel supports");
    if constexpr (sizeof(scalar_t) == 2) {
      if (V == 8) return launch_fwd_v<scalar_t, 8>(xp, wp, bp, op, a, S, nhwc, blocks, smem, stream);
    }
    if constexpr (sizeof(scalar_t) <= 4) {
      if (V == 4) return launch_fwd_v<scalar_t, 4>(xp, wp, bp, op, a, S, nhwc, blocks, smem, stream);
    }
    if (V == 2) return launch_fwd_v<scalar_t, 2>(xp, wp, bp, op, a, S, nhwc, blocks, smem, stream);
    launch_fwd_v<scalar_t, 1>(xp, wp, bp, op, a, S, nhwc, blocks, smem, stream);
  });
}

namespace {

void depthwise_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& w,
                                   at::Tensor& grad_x, const Geometry& g, bool nhwc) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const DwArgs a = base_args(g);
  const int64_t total = grad_x.numel();
  if (total == 0) return;
  OPFORGE_DISPATCH_FLOATING_TYPES(grad_x.scalar_type(), "conv2d_3x3_depthwise_bwd_input", [&] {
    const auto* gp = grad_out.const_data_ptr<scalar_t>();
    const auto* rp = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
    const auto* wp = w.const_data_ptr<scalar_t>();
    auto* gxp = grad_x.mutable_data_ptr<scalar_t>();
    if (g.stride == 1 && g.mult == 1) {
      if (nhwc) {
        const int64_t rows = g.N * g.H, col_blocks = (g.C + 31) / 32;
        const int64_t rows_per_split = rows_per_split_for(rows, col_blocks);
        const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>((rows + rows_per_split - 1) / rows_per_split));
        dw_bwd_input_s1_nhwc<scalar_t><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, wp, gxp, a, rows_per_split);
      } else {
        const int64_t warps = g.N * g.C * g.H;
        const int64_t blocks = std::min<int64_t>((warps + kThreads / 32 - 1) / (kThreads / 32),
                                                 16LL * opforge::cuda::sm_count());
        dw_bwd_input_s1_nchw<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gp, rp, wp, gxp, a);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const int64_t blocks = opforge::cuda::grid_for(total, kThreads);
    const int S = static_cast<int>(g.stride);
    // int32 indices when every offset (and the grid-stride step past the end) fits.
    const int64_t largest = std::max(total, grad_out.numel()) + blocks * kThreads;
    if (largest <= INT32_MAX && g.K * 9 <= INT32_MAX) {
      const auto t32 = static_cast<int32_t>(total);
      if (nhwc) dw_bwd_input<scalar_t, true, int32_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, t32);
      else dw_bwd_input<scalar_t, false, int32_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, t32);
    } else {
      if (nhwc) dw_bwd_input<scalar_t, true, int64_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, total);
      else dw_bwd_input<scalar_t, false, int64_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, total);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// gw[k] / gb[k] (either may be null) from the splits' partial sums
// part[(k * splits + split) * 10 + t], added in a fixed order.
template <typename scalar_t>
void finish_weight_sums(const at::opmath_type<scalar_t>* part, scalar_t* gwp, scalar_t* gbp, int64_t K, int splits,
                        cudaStream_t stream) {
  const int64_t n = K * 10;
  dw_bwd_weight_finish<scalar_t><<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(part, gwp, gbp, K, splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Splits of the staged weight-gradient kernels: as many blocks as fit on
// the GPU at once (their blocks walk tiles), spread over `groups` channels
// or chunks, at most one per tile.
template <typename Kernel>
int resident_splits(Kernel kernel, int threads, size_t smem, int64_t groups, int64_t tiles) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t want = static_cast<int64_t>(std::max(1, per_sm)) * opforge::cuda::sm_count() / groups;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, tiles, 65535})));
}

// The staged stride-1 weight-gradient kernels (multiplier 1, not float64,
// shapes the forward's tiling accepts), with the splits' sums finished into
// gw / gb. NCHW masks grad_out by result (rp) as it reads it; NHWC stages
// grad_out, already masked (rp null). False where they do not apply.
template <typename scalar_t>
bool try_backward_weight_s1(const scalar_t* gp, const scalar_t* rp, const scalar_t* xp, scalar_t* gwp,
                            scalar_t* gbp, const Geometry& g, bool nhwc, const at::TensorOptions& opts,
                            cudaStream_t stream) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if constexpr (s == 8) {
    return false;
  } else {
    if (g.mult != 1) return false;
    at::Tensor part;
    int splits = 1;
    if (nhwc) {
      DwS1NhwcArgs a;
      int threads;
      // 16-row tiles: the grad_out tile doubles the shared memory per block.
      if (rp != nullptr || !plan_nhwc_s1<scalar_t>(g, xp, gp, 16, a, threads) || !opforge::cuda::is_aligned(gp, a.LB))
        return false;
      const size_t stage = nhwc_s1_stage_bytes<scalar_t>(a) + static_cast<size_t>(a.BH) * a.TW * a.CB * s;
      const size_t smem = std::max(stage, static_cast<size_t>(threads) * 10 * 4 * sizeof(float));
      with_nhwc_s1_consts(g.pad, a.LB, [&](auto pad, auto lb) {
        auto kernel = dw_bwd_weight_nhwc_s1<scalar_t, decltype(pad)::value, decltype(lb)::value>;
        set_smem(kernel, smem);
        splits = resident_splits(kernel, threads, smem, a.chunks, g.N * a.tiles_h * a.tiles_w);
        part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
        kernel<<<dim3(static_cast<unsigned>(a.chunks), static_cast<unsigned>(splits)), threads, smem, stream>>>(
            xp, gp, part.mutable_data_ptr<float>(), a, splits);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      NchwS1Plan plan;
      if (!plan_nchw_s1<scalar_t>(g, xp, gp, true, plan)) return false;
      const size_t vb = static_cast<size_t>(plan.V) * s;
      const bool vec_g = g.Wo % plan.V == 0 && opforge::cuda::is_aligned(gp, vb) &&
                         (rp == nullptr || opforge::cuda::is_aligned(rp, vb));
      const size_t smem = nchw_s1_stage_bytes<scalar_t>(plan.a);
      const int64_t tiles = (g.N + plan.a.PB - 1) / plan.a.PB * plan.a.bands;
      with_nchw_s1_consts<scalar_t>(plan.V, g.pad, [&](auto v, auto pad) {
        auto kernel = dw_bwd_weight_nchw_s1<scalar_t, decltype(v)::value, decltype(pad)::value>;
        set_smem(kernel, smem);
        splits = resident_splits(kernel, plan.threads, smem, g.C, tiles);
        part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
        kernel<<<dim3(static_cast<unsigned>(g.C), static_cast<unsigned>(splits)), plan.threads, smem, stream>>>(
            xp, gp, rp, part.mutable_data_ptr<float>(), plan.a, splits, vec_g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    finish_weight_sums<scalar_t>(part.const_data_ptr<float>(), gwp, gbp, g.C, splits, stream);
    return true;
  }
}

// The fused NHWC backward (stride 1, padding 1, multiplier 1, not float64)
// into grad x and the splits' sums, finished into gw / gb. rp: the fused
// ReLU's result, or null. False where it does not apply.
template <typename scalar_t>
bool try_backward_fused_nhwc(const scalar_t* gp, const scalar_t* rp, const scalar_t* xp, const scalar_t* wp,
                             scalar_t* gxp, scalar_t* gwp, scalar_t* gbp, const Geometry& g,
                             const at::TensorOptions& opts, cudaStream_t stream) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if constexpr (s == 8) {
    return false;
  } else {
    DwS1NhwcArgs a;
    int threads;
    // 16-row tiles for the half types, 8 for float32: three staged tensors
    // per block.
    if (g.pad != 1 || !plan_nhwc_s1<scalar_t>(g, xp, gxp, s == 2 ? 16 : 8, a, threads) ||
        !opforge::cuda::is_aligned(gp, a.LB) || (rp != nullptr && !opforge::cuda::is_aligned(rp, a.LB)))
      return false;
    TORCH_INTERNAL_ASSERT(threads <= kFusedThreads);
    const size_t stage = (rp != nullptr ? 3 : 2) * nhwc_s1_stage_bytes<scalar_t>(a);
    const size_t smem = std::max(stage, static_cast<size_t>(threads) * 10 * 4 * sizeof(float));
    at::Tensor part;
    int splits = 1;
    auto launch = [&](auto kernel) {
      set_smem(kernel, smem);
      splits = resident_splits(kernel, threads, smem, a.chunks, g.N * a.tiles_h * a.tiles_w);
      part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
      kernel<<<dim3(static_cast<unsigned>(a.chunks), static_cast<unsigned>(splits)), threads, smem, stream>>>(
          gp, rp, xp, wp, gxp, part.mutable_data_ptr<float>(), a, splits);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    with_nhwc_s1_consts(1, a.LB, [&](auto, auto lb) {
      constexpr int LB = decltype(lb)::value;
      if (rp != nullptr) launch(dw_bwd_fused_nhwc_s1<scalar_t, LB, true>);
      else launch(dw_bwd_fused_nhwc_s1<scalar_t, LB, false>);
    });
    finish_weight_sums<scalar_t>(part.const_data_ptr<float>(), gwp, gbp, g.C, splits, stream);
    return true;
  }
}

void depthwise_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                                    at::Tensor& grad_w, at::Tensor& grad_b, const Geometry& g, bool nhwc) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const DwArgs a = base_args(g);
  const int S = static_cast<int>(g.stride);
  OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_weight", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* gp = grad_out.const_data_ptr<scalar_t>();
    const auto* rp = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* gwp = grad_w.defined() ? grad_w.mutable_data_ptr<scalar_t>() : nullptr;
    auto* gbp = grad_b.defined() ? grad_b.mutable_data_ptr<scalar_t>() : nullptr;
    if (g.stride == 1 && try_backward_weight_s1<scalar_t>(gp, rp, xp, gwp, gbp, g, nhwc, x.options(), stream)) return;
    const int64_t rows = g.N * g.Ho;
    const int64_t col_blocks = nhwc ? (g.K + 31) / 32 : g.K;
    const int64_t rows_per_split = rows_per_split_for(rows, col_blocks);
    const int splits = static_cast<int>(std::max<int64_t>(1, (rows + rows_per_split - 1) / rows_per_split));
    at::Tensor part = at::empty({g.K, splits, 10}, x.options().dtype(at::toOpMathType(x.scalar_type())));
    auto* pp = part.mutable_data_ptr<opmath_t>();
    if (nhwc) {
      const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits));
      if (S == 1) dw_bwd_weight_nhwc<scalar_t, 1><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, xp, pp, a, splits, rows_per_split);
      else dw_bwd_weight_nhwc<scalar_t, 2><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, xp, pp, a, splits, rows_per_split);
    } else {
      TORCH_CHECK(g.K <= INT32_MAX, "opforge._conv2d_3x3_backward: too many channels");
      const dim3 grid(static_cast<unsigned>(g.K), static_cast<unsigned>(splits));
      dw_bwd_weight_nchw<scalar_t><<<grid, kThreads, 0, stream>>>(gp, rp, xp, pp, a, S, splits, rows_per_split);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finish_weight_sums<scalar_t>(pp, gwp, gbp, g.K, splits, stream);
  });
}

}  // namespace

void depthwise_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                             const at::Tensor& w, at::Tensor& grad_x, at::Tensor& grad_w, at::Tensor& grad_b,
                             const Geometry& g, bool nhwc) {
  at::Tensor gm = grad_out, res = result;
  const bool staged = staged_s1_applies(g, nhwc, x.scalar_type());
  if (staged && nhwc && grad_x.defined() && (grad_w.defined() || grad_b.defined())) {
    bool done = false;
    OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_fused", [&] {
      done = try_backward_fused_nhwc<scalar_t>(
          grad_out.const_data_ptr<scalar_t>(), result.defined() ? result.const_data_ptr<scalar_t>() : nullptr,
          x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), grad_x.mutable_data_ptr<scalar_t>(),
          grad_w.defined() ? grad_w.mutable_data_ptr<scalar_t>() : nullptr,
          grad_b.defined() ? grad_b.mutable_data_ptr<scalar_t>() : nullptr, g, x.options(),
          at::cuda::getCurrentCUDAStream());
    });
    if (done) return;
  }
  if (staged && result.defined() && (grad_x.defined() || nhwc)) {
    // One pass applies the ReLU mask for both gradients: the staged kernels
    // that copy grad_out into shared memory (grad x as a forward, the NHWC
    // weight gradient) take it as it is; the NCHW weight gradient, which
    // reads grad_out from global memory, masks it on the way when grad x is
    // not asked for. (On the H200 staging grad_out for the NCHW weight
    // gradient ran slower: the two stages halve the rows per block.)
    // The add family's fused ReLU-backward kernel (the CPU and dense paths'
    // mask too), kept in x's layout.
    gm = relu_masked_grad(grad_out, result)
             .contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    res = at::Tensor();
  }
  if (grad_x.defined()) {
    bool done = false;
    if (staged) {
      // grad x as a forward convolution of the masked grad_out.
      const at::Tensor wflip = w.flip({2, 3}).contiguous();
      OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_input", [&] {
        done = try_backward_input_as_forward<scalar_t>(gm.const_data_ptr<scalar_t>(),
                                                       wflip.const_data_ptr<scalar_t>(),
                                                       grad_x.mutable_data_ptr<scalar_t>(), g, nhwc,
                                                       at::cuda::getCurrentCUDAStream());
      });
    }
    if (!done) depthwise_backward_input_cuda(gm, res, w, grad_x, g, nhwc);
  }
  if (grad_w.defined() || grad_b.defined()) depthwise_backward_weight_cuda(gm, res, x, grad_w, grad_b, g, nhwc);
}

}  // namespace opforge::conv

// Dense 3x3 and 1x1 convolution forward (groups == 1) on tensor cores, as an
// implicit GEMM with the bias + activation epilogue fused.
//
// GEMM view: M = N*Ho*Wo output pixels, N_gemm = K output channels,
// K_gemm = R*R*C for an RxR kernel (R = 3 or 1). Activations are read as NHWC
// (channels_last) and the weights as (K, R, R, C), so that the reduction
// index kk = (r*R + s)*C + c is contiguous in memory for both operands:
//   A[m][kk] = x[n][ho*stride - pad + r][wo*stride - pad + s][c]   (0 outside)
//   B[k][kk] = w[k][r][s][c]
//   out[m][k] = act(sum_kk A[m][kk] * B[k][kk] + bias[k])
// A 1x1 kernel is the plain GEMM (N*Ho*Wo, C) x (C, K) over the strided pixels.
//
// Data movement: a contiguous (NCHW) input is converted to NHWC once by a
// tiled shared-memory transpose (one extra read + write of x, a few
// microseconds for the benchmark shapes; other strided inputs use ATen's
// copy); the weights are reordered to (K,R,R,C) on every call (tiny; none for
// R = 1). Both
// operands are then streamed into shared memory with 16-byte cp.async
// (sm_80+), STAGES-deep, one 16-byte chunk = 8 half values or 4 floats, which
// never straddles a filter tap because C is a multiple of the chunk. The zero
// halo (padding) and every tile edge (M, K, K_gemm) are handled by predicated
// cp.async with a source size of 0, which writes zeros.
//
// Compute: warps of 64x32 (or 32x32) output tiles with fp32 accumulators,
// K_gemm in stages of 64 bytes (32 half values / 16 floats). Three CTA tiles,
// picked by grid size in `launch`: 128x128 with 8 warps (3 stages, 60 KB,
// bfloat16/float16 with K > 64), 128x64 with 4 warps (3 stages, 45 KB, 4 CTAs
// per SM), 64x64 with 4 warps (4 stages, 40 KB) for small problems.
// bfloat16/float16 use mma.m16n8k16 fed by ldmatrix; float32
// uses TF32 mma.m16n8k8 (inputs rounded to TF32 with cvt.rna), only when
// torch allows TF32 for cuDNN convolutions, as F.conv2d does. Shared-memory
// rows are padded from 64 to 80 bytes, which makes the cp.async stores,
// ldmatrix reads and the 32-bit TF32 fragment reads bank-conflict free.
//
// Epilogue: bias (read in its dtype, added in fp32) and ReLU on the fp32
// accumulators, one rounding to the output dtype, then the tile is staged in
// shared memory and written coalesced: 16-byte stores along K for a
// channels_last output, runs along the pixels of one image for NCHW.
#include "cuda/conv_dense_mma.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <opforge/checks.h>
#include <opforge/cuda_async.cuh>
#include <opforge/cuda_launch.cuh>

// std::numeric_limits, std::optional, int64_t come with the ATen/c10 headers.

namespace {

// Every configuration moves kBKBytes of K_gemm per pipeline stage; the CTA
// tile (kBM pixels x kBN channels), the warp grid and the stage count are
// template parameters of the kernel (see `launch` for the ones used).
constexpr int kBKBytes = 64;
constexpr int kRowBytes = kBKBytes + 16;      // padded shared-memory row (conflict free)
constexpr int kChunksPerRow = kBKBytes / 16;  // 16-byte chunks per row: 4
static_assert(kRowBytes % 16 == 0, "cp.async and ldmatrix need 16-byte aligned rows");

// Shared memory of one configuration: kStages x (A tile + B tile).
template <int kBM, int kBN, int kStages>
constexpr int smem_bytes() {
  return kStages * (kBM + kBN) * kRowBytes;
}

struct Params {
  const void* x;     // NHWC, 16-byte aligned
  const void* w;     // (K, R, R, C), 16-byte aligned
  const void* bias;  // (K) or nullptr
  void* out;         // (N, K, Ho, Wo), NCHW or NHWC memory
  int N, C, H, W, K, Ho, Wo, stride, pad;
  int R;   // the kernel's size: 3 or 1
  int M;   // N * Ho * Wo
  int Kg;  // R * R * C
  int tiles_n;
  opforge::Activation act;
  bool out_nhwc;
  bool vec_store;  // NHWC output with K a multiple of the 16-byte chunk
};

// ---- PTX wrappers (sm_80+) --------------------------------------------------

using opforge::cuda::cp_async16;
using opforge::cuda::cp_async_commit;
using opforge::cuda::cp_async_wait;
using opforge::cuda::smem_u32;

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ uint32_t to_tf32(float f) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(f));
  return r;
}

template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  __device__ static __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Mma<__half> {
  __device__ static __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ float to_float(__half v) { return __half2float(v); }
  __device__ static __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Mma<float> {  // TF32, m16n8k8
  __device__ static __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ float to_float(float v) { return v; }
  __device__ static __forceinline__ float from_float(float v) { return v; }
};

// ---- the kernel ---------------------------------------------------------------

template <typename T, int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN) conv_dense_mma_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // never launched: the host side declines devices below sm_80
#else
  constexpr int kChunk = 16 / static_cast<int>(sizeof(T));     // elements per 16-byte chunk
  constexpr int kBK = kBKBytes / static_cast<int>(sizeof(T));  // K_gemm elements per stage
  constexpr bool kTF32 = sizeof(T) == 4;

  constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // tile rows filled per pass
  constexpr int kAIters = kBM / kRowsPerPass;             // A rows per thread per stage
  constexpr int kBIters = kBN / kRowsPerPass;             // B rows per thread per stage
  constexpr int kAStageBytes = kBM * kRowBytes;
  constexpr int kStageBytes = (kBM + kBN) * kRowBytes;
  constexpr int kSmemBytes = smem_bytes<kBM, kBN, kStages>();
  constexpr int kWarpM = kBM / kWarpsM;
  constexpr int kWarpN = kBN / kWarpsN;
  constexpr int kMI = kWarpM / 16;  // m16 tiles per warp
  constexpr int kNI = kWarpN / 8;   // n8 tiles per warp
  static_assert(kThreads % kChunksPerRow == 0 && kBM % kRowsPerPass == 0 && kBN % kRowsPerPass == 0);
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "B fragments are loaded in n16 pairs");

  extern __shared__ __align__(128) unsigned char smem[];  // kSmemBytes, dynamic

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_m = warp % kWarpsM;
  const int warp_n = warp / kWarpsM;

  const int tile_n = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.tiles_n));
  const int tile_m = static_cast<int>(blockIdx.x / static_cast<unsigned>(p.tiles_n));
  const int m0 = tile_m * kBM;
  const int n0 = tile_n * kBN;

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ w = static_cast<const T*>(p.w);

  // This thread's fixed 16-byte chunk column and rows within each tile.
  const int kc = tid % kChunksPerRow;
  const int row_base = tid / kChunksPerRow;

  // Per A row: the image's base offset and the top-left input coordinate of
  // the RxR window. Rows past M get a far-negative hi0 so no tap is in range.
  int64_t a_base[kAIters];
  int a_hi0[kAIters], a_wi0[kAIters];
  const int hw_out = p.Ho * p.Wo;
#pragma unroll
  for (int i = 0; i < kAIters; ++i) {
    const int m = m0 + row_base + i * kRowsPerPass;
    if (m < p.M) {
      const int img = m / hw_out;
      const int pix = m - img * hw_out;
      const int ho = pix / p.Wo;
      const int wo = pix - ho * p.Wo;
      a_base[i] = static_cast<int64_t>(img) * p.H * p.W * p.C;
      a_hi0[i] = ho * p.stride - p.pad;
      a_wi0[i] = wo * p.stride - p.pad;
    } else {
      a_base[i] = 0;
      a_hi0[i] = -(1 << 28);
      a_wi0[i] = -(1 << 28);
    }
  }

  const int num_k_tiles = (p.Kg + kBK - 1) / kBK;

  // Position of this thread's next chunk in K_gemm: index kk, filter tap
  // (r, s) and channel c. Stages are loaded strictly in order 0, 1, 2, ...,
  // so this advances by kBK per stage without a division.
  int ld_kk = kc * kChunk;
  int ld_c, ld_r, ld_s;
  {
    const int tap = ld_kk / p.C;
    ld_c = ld_kk - tap * p.C;
    ld_r = tap / p.R;
    ld_s = tap - ld_r * p.R;
  }

  auto load_stage = [&](int slot) {
    const uint32_t sA = smem_u32(smem + slot * kStageBytes);
    const uint32_t sB = sA + kAStageBytes;
    const int kk = ld_kk;
    const bool k_ok = kk < p.Kg;
    const int c = ld_c;
    const int r = ld_r;
    const int s = ld_s;
#pragma unroll
    for (int i = 0; i < kAIters; ++i) {
      const int hi = a_hi0[i] + r;
      const int wi = a_wi0[i] + s;
      const bool ok = k_ok && static_cast<unsigned>(hi) < static_cast<unsigned>(p.H) &&
                      static_cast<unsigned>(wi) < static_cast<unsigned>(p.W);
      const T* src = ok ? x + a_base[i] + (static_cast<int64_t>(hi) * p.W + wi) * p.C + c : x;
      cp_async16(sA + (row_base + i * kRowsPerPass) * kRowBytes + kc * 16, src, ok);
    }
#pragma unroll
    for (int i = 0; i < kBIters; ++i) {
      const int n = n0 + row_base + i * kRowsPerPass;
      const bool ok = k_ok && n < p.K;
      const T* src = ok ? w + static_cast<int64_t>(n) * p.Kg + kk : w;
      cp_async16(sB + (row_base + i * kRowsPerPass) * kRowBytes + kc * 16, src, ok);
    }
    ld_kk += kBK;
    ld_c += kBK;
    while (ld_c >= p.C) {  // once per stage for C >= kBK, kBK / C times below
      ld_c -= p.C;
      if (++ld_s == p.R) {
        ld_s = 0;
        ++ld_r;
      }
    }
  };

  float acc[kMI][kNI][4];
#pragma unroll
  for (int i = 0; i < kMI; ++i)
#pragma unroll
    for (int j = 0; j < kNI; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // Prologue: stages 0 .. kStages-2 in flight (one commit group each, empty
  // groups past the end keep the group count uniform).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s);
    cp_async_commit();
  }

  const int g = lane >> 2;  // mma fragment row group
  const int t = lane & 3;   // mma fragment thread-in-group

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (for this thread) ...
    __syncthreads();               // ... and for all; slot (kt-1) % kStages is free
    {
      const int next = kt + kStages - 1;
      if (next < num_k_tiles) load_stage(next % kStages);
      cp_async_commit();
    }
    const unsigned char* stage = smem + (kt % kStages) * kStageBytes;
    const uint32_t sA = smem_u32(stage);
    const uint32_t sB = sA + kAStageBytes;

    if constexpr (!kTF32) {
      // Two k16 steps of 32 bytes each.
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[kMI][4];
        uint32_t b[kNI][2];
        const int q = lane >> 3, rr = lane & 7;
#pragma unroll
        for (int i = 0; i < kMI; ++i) {
          const int row = warp_m * kWarpM + i * 16 + rr + (q & 1) * 8;
          const uint32_t addr = sA + row * kRowBytes + ks * 32 + (q >> 1) * 16;
          ldmatrix_x4(addr, a[i][0], a[i][1], a[i][2], a[i][3]);
        }
#pragma unroll
        for (int j = 0; j < kNI; j += 2) {
          const int nrow = warp_n * kWarpN + j * 8 + rr + (q >> 1) * 8;
          const uint32_t addr = sB + nrow * kRowBytes + ks * 32 + (q & 1) * 16;
          ldmatrix_x4(addr, b[j][0], b[j][1], b[j + 1][0], b[j + 1][1]);
        }
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
          for (int j = 0; j < kNI; ++j) Mma<T>::run(acc[i][j], a[i], b[j][0], b[j][1]);
      }
    } else {
      // Two k8 steps of 32 bytes each; 32-bit fragment reads, rounded to TF32.
      const float* fA = reinterpret_cast<const float*>(stage);
      const float* fB = reinterpret_cast<const float*>(stage + kAStageBytes);
      constexpr int kRowWords = kRowBytes / 4;
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[kMI][4];
        uint32_t b[kNI][2];
#pragma unroll
        for (int i = 0; i < kMI; ++i) {
          const float* base = fA + (warp_m * kWarpM + i * 16 + g) * kRowWords + ks * 8 + t;
          a[i][0] = to_tf32(base[0]);
          a[i][1] = to_tf32(base[8 * kRowWords]);
          a[i][2] = to_tf32(base[4]);
          a[i][3] = to_tf32(base[8 * kRowWords + 4]);
        }
#pragma unroll
        for (int j = 0; j < kNI; ++j) {
          const float* base = fB + (warp_n * kWarpN + j * 8 + g) * kRowWords + ks * 8 + t;
          b[j][0] = to_tf32(base[0]);
          b[j][1] = to_tf32(base[4]);
        }
#pragma unroll
        for (int i = 0; i < kMI; ++i)
#pragma unroll
          for (int j = 0; j < kNI; ++j) Mma<T>::run(acc[i][j], a[i], b[j][0], b[j][1]);
      }
    }
  }

  // ---- epilogue: bias + ReLU in fp32, one rounding, staged through smem ----
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading the pipeline buffers

  // Staged row stride in elements: 16 bytes of padding for channels_last (rows
  // stay 16-byte aligned for the vector reads), 4 bytes for NCHW (an odd
  // number of words: the column-wise reads below are bank-conflict free).
  constexpr int kCStrideMax = kBN + kChunk;
  static_assert(kBM * kCStrideMax * sizeof(T) <= kSmemBytes, "staged tile must fit");
  const int c_stride = p.out_nhwc ? kCStrideMax : kBN + 4 / static_cast<int>(sizeof(T));
  T* sC = reinterpret_cast<T*>(smem);
  const T* bias = static_cast<const T*>(p.bias);

#pragma unroll
  for (int j = 0; j < kNI; ++j) {
    // Fragments wholly past K (a tile wider than the layer's channels) are never stored: skip the
    // activation's arithmetic on them (warp-uniform).
    if (n0 + warp_n * kWarpN + j * 8 >= p.K) continue;
    const int col = warp_n * kWarpN + j * 8 + 2 * t;
    float b0 = 0.f, b1 = 0.f;
    if (bias != nullptr) {
      if (n0 + col < p.K) b0 = Mma<T>::to_float(bias[n0 + col]);
      if (n0 + col + 1 < p.K) b1 = Mma<T>::to_float(bias[n0 + col + 1]);
    }
#pragma unroll
    for (int i = 0; i < kMI; ++i) {
      const int row = warp_m * kWarpM + i * 16 + g;
      float v0 = acc[i][j][0] + b0, v1 = acc[i][j][1] + b1;
      float v2 = acc[i][j][2] + b0, v3 = acc[i][j][3] + b1;
      v0 = opforge::apply_activation(v0, p.act);
      v1 = opforge::apply_activation(v1, p.act);
      v2 = opforge::apply_activation(v2, p.act);
      v3 = opforge::apply_activation(v3, p.act);
      sC[row * c_stride + col] = Mma<T>::from_float(v0);
      sC[row * c_stride + col + 1] = Mma<T>::from_float(v1);
      sC[(row + 8) * c_stride + col] = Mma<T>::from_float(v2);
      sC[(row + 8) * c_stride + col + 1] = Mma<T>::from_float(v3);
    }
  }
  __syncthreads();

  T* __restrict__ out = static_cast<T*>(p.out);
  if (p.out_nhwc) {
    if (p.vec_store) {
      // K is a multiple of the chunk and n0 of kBN: a chunk is wholly in or out.
      constexpr int kCPR = kBN / kChunk;
#pragma unroll
      for (int it = 0; it < kBM * kCPR / kThreads; ++it) {
        const int idx = tid + it * kThreads;
        const int row = idx / kCPR;
        const int cc = idx - row * kCPR;
        const int m = m0 + row;
        const int n = n0 + cc * kChunk;
        if (m < p.M && n < p.K) {
          const uint4 v = *reinterpret_cast<const uint4*>(sC + row * c_stride + cc * kChunk);
          *reinterpret_cast<uint4*>(out + static_cast<int64_t>(m) * p.K + n) = v;
        }
      }
    } else {
      for (int idx = tid; idx < kBM * kBN; idx += kThreads) {
        const int row = idx / kBN;
        const int col = idx - row * kBN;
        const int m = m0 + row;
        const int n = n0 + col;
        if (m < p.M && n < p.K) out[static_cast<int64_t>(m) * p.K + n] = sC[row * c_stride + col];
      }
    }
  } else {
    // NCHW: consecutive threads take consecutive pixels of one channel.
    for (int idx = tid; idx < kBM * kBN; idx += kThreads) {
      const int col = idx / kBM;
      const int row = idx - col * kBM;
      const int m = m0 + row;
      const int n = n0 + col;
      if (m < p.M && n < p.K) {
        const int img = m / hw_out;
        const int pix = m - img * hw_out;
        out[(static_cast<int64_t>(img) * p.K + n) * hw_out + pix] = sC[row * c_stride + col];
      }
    }
  }
#endif
}

// ---- NCHW -> NHWC for a contiguous input --------------------------------------
// out[n][p][c] = in[n][c][p] (p = h*W + w) through a 64x64 shared-memory tile:
// reads run along p, writes along c, both coalesced; rows padded by 4 bytes so
// the column reads are bank-conflict free. U is a same-size bit type.
constexpr int kTrTile = 64;
constexpr int kTrThreads = 256;

template <typename U>
__global__ void __launch_bounds__(kTrThreads)
    nchw_to_nhwc_kernel(const U* __restrict__ in, U* __restrict__ out, int C, int HW) {
  constexpr int kPad = 4 / static_cast<int>(sizeof(U));
  __shared__ U tile[kTrTile][kTrTile + kPad];
  const int p0 = blockIdx.x * kTrTile;
  const int c0 = blockIdx.y * kTrTile;
  const int64_t image = static_cast<int64_t>(blockIdx.z) * C * HW;
  const U* src = in + image;
  U* dst = out + image;
  for (int i = threadIdx.x; i < kTrTile * kTrTile; i += kTrThreads) {
    const int cl = i / kTrTile, pl = i % kTrTile;
    const int c = c0 + cl, p = p0 + pl;
    if (c < C && p < HW) tile[cl][pl] = src[static_cast<int64_t>(c) * HW + p];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTrTile * kTrTile; i += kTrThreads) {
    const int pl = i / kTrTile, cl = i % kTrTile;
    const int c = c0 + cl, p = p0 + pl;
    if (c < C && p < HW) dst[static_cast<int64_t>(p) * C + c] = tile[cl][pl];
  }
}

// x as a contiguous NHWC tensor: a view for a channels_last x, the tiled
// transpose for a contiguous (NCHW) x, ATen's copy for anything else.
at::Tensor to_nhwc(const at::Tensor& x) {
  const at::Tensor xp = x.permute({0, 2, 3, 1});
  if (xp.is_contiguous()) return xp;
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  if (!x.is_contiguous() || N > 65535 || (C + kTrTile - 1) / kTrTile > 65535 ||
      (HW + kTrTile - 1) / kTrTile > std::numeric_limits<int>::max() || C * HW > std::numeric_limits<int>::max()) {
    return xp.contiguous();
  }
  at::Tensor out = at::empty(xp.sizes(), x.options());
  const dim3 grid(static_cast<unsigned>((HW + kTrTile - 1) / kTrTile),
                  static_cast<unsigned>((C + kTrTile - 1) / kTrTile), static_cast<unsigned>(N));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (x.element_size() == 2) {
    nchw_to_nhwc_kernel<uint16_t><<<grid, kTrThreads, 0, stream>>>(static_cast<const uint16_t*>(x.data_ptr()),
                                                                   static_cast<uint16_t*>(out.data_ptr()),
                                                                   static_cast<int>(C), static_cast<int>(HW));
  } else {
    nchw_to_nhwc_kernel<uint32_t><<<grid, kTrThreads, 0, stream>>>(static_cast<const uint32_t*>(x.data_ptr()),
                                                                   static_cast<uint32_t*>(out.data_ptr()),
                                                                   static_cast<int>(C), static_cast<int>(HW));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

template <typename T, int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages>
void launch_cfg(Params p) {
  constexpr int smem = smem_bytes<kBM, kBN, kStages>();
  constexpr int threads = 32 * kWarpsM * kWarpsN;
  auto* kernel = &conv_dense_mma_kernel<T, kBM, kBN, kWarpsM, kWarpsN, kStages>;
  if constexpr (smem > 48 * 1024) {
    // Above the default 48 KB of dynamic shared memory. A host-side attribute
    // (no stream work, allowed during graph capture), set on every launch so
    // that every device gets it; it costs well under a microsecond.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  p.tiles_n = (p.K + kBN - 1) / kBN;
  const int64_t tiles_m = (static_cast<int64_t>(p.M) + kBM - 1) / kBM;
  const int64_t blocks = tiles_m * p.tiles_n;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tile choice (all warps 64x32 or 32x32, fp32 accumulators):
// - 128x128, 8 warps, 3 stages (60 KB, 2 CTAs per SM) when K > 64 and the
//   grid still gives every SM two CTAs: the most reuse per byte loaded
//   (bfloat16/float16 only);
// - 128x64, 4 warps, 3 stages (45 KB, 4 CTAs per SM) when that grid gives
//   every SM four CTAs;
// - else 64x64, 4 warps, 4 stages (40 KB): twice the CTAs for small problems
//   (fewer idle SMs, less tail);
// - 128x32, 4 warps along M, 3 stages (37.5 KB) when K <= 32 and the grid
//   still gives every SM a CTA: a layer with few output channels (1x1
//   projections) would leave most of a wider tile's columns idle.
//
// OPFORGE_CONV_MMA_TILE=128x128|128x64|64x64|128x32 forces one tile (benchmarking
// the choice; 128x128 is ignored for float32); unset or anything else: the
// rule above.
int forced_tile() {
  const auto v = c10::utils::get_env("OPFORGE_CONV_MMA_TILE");
  if (!v.has_value()) return 0;
  if (*v == "128x128") return 1;
  if (*v == "128x64") return 2;
  if (*v == "64x64") return 3;
  if (*v == "128x32") return 4;
  return 0;
}

template <typename T>
void launch(const Params& p) {
  const int forced = forced_tile();
  if constexpr (sizeof(T) == 2) {
    if (forced == 1) return launch_cfg<T, 128, 128, 2, 4, 3>(p);
  }
  if (forced == 2) return launch_cfg<T, 128, 64, 2, 2, 3>(p);
  if (forced == 3) return launch_cfg<T, 64, 64, 2, 2, 4>(p);
  if (forced == 4) return launch_cfg<T, 128, 32, 4, 1, 3>(p);
  const int64_t sms = opforge::cuda::sm_count();
  const auto blocks = [&](int64_t bm, int64_t bn) { return ((p.M + bm - 1) / bm) * ((p.K + bn - 1) / bn); };
  if (p.K <= 32 && blocks(128, 32) >= sms) {
    launch_cfg<T, 128, 32, 4, 1, 3>(p);
    return;
  }
  if constexpr (sizeof(T) == 2) {  // a staged float32 128x128 tile would not fit
    if (p.K > 64 && blocks(128, 128) >= 2 * sms) {
      launch_cfg<T, 128, 128, 2, 4, 3>(p);
      return;
    }
  }
  if (blocks(128, 64) >= 4 * sms) {
    launch_cfg<T, 128, 64, 2, 2, 3>(p);
  } else {
    launch_cfg<T, 64, 64, 2, 2, 4>(p);
  }
}

// act(conv(x, w) + bias) for an RxR kernel (R = w.size(2)), or false where
// this kernel does not take the case.
bool dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                       int64_t padding, opforge::Activation act, at::Tensor& out) {
  // ---- what this kernel handles; anything else goes back to the caller ----
  if (!x.is_cuda() || !w.is_cuda() || !out.is_cuda()) return false;
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;
  if (w.scalar_type() != dtype || out.scalar_type() != dtype) return false;
  if (bias.defined() && (!bias.is_cuda() || bias.scalar_type() != dtype)) return false;
  if (dtype == at::kFloat && !at::globalContext().allowTF32CuDNN(at::Float32Op::CONV)) return false;
  if (x.dim() != 4 || w.dim() != 4 || out.dim() != 4) return false;
  const int64_t R = w.size(2);
  if (w.size(1) != x.size(1) || w.size(3) != R || (R != 3 && R != 1)) return false;
  if (stride < 1 || stride > 2 || padding < 0 || padding > R / 2) return false;
  if (at::cuda::getCurrentDeviceProperties()->major < 8) return false;  // cp.async, bf16 mma

  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = w.size(0);
  const int64_t chunk = 16 / static_cast<int64_t>(x.element_size());
  if (C % chunk != 0) return false;  // a 16-byte chunk must not straddle a filter tap
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != K)) return false;
  if (H + 2 * padding < R || W + 2 * padding < R) return false;
  const int64_t Ho = (H + 2 * padding - R) / stride + 1;
  const int64_t Wo = (W + 2 * padding - R) / stride + 1;
  if (out.size(0) != N || out.size(1) != K || out.size(2) != Ho || out.size(3) != Wo) return false;
  if (out.numel() == 0) return true;

  // 32-bit index limits (offsets into x, w and out are 64-bit).
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const int64_t M = N * Ho * Wo;
  if (M > kIntMax - 128 || K > kIntMax - 128 || R * R * C > kIntMax || N > kIntMax || H > kIntMax / 4 ||
      W > kIntMax / 4)
    return false;

  bool out_nhwc;
  if (out.is_contiguous()) {
    out_nhwc = false;
  } else if (out.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    out_nhwc = true;
  } else {
    return false;
  }

  // NHWC activations (free for a channels_last x, one transpose pass for
  // NCHW) and (K, R, R, C) weights (tiny; a view for R = 1).
  const at::Tensor xl = to_nhwc(x);
  const at::Tensor wl = w.permute({0, 2, 3, 1}).contiguous();
  const at::Tensor bl = bias.defined() ? bias.contiguous() : bias;
  if (!opforge::cuda::is_aligned(xl.data_ptr(), 16) || !opforge::cuda::is_aligned(wl.data_ptr(), 16)) return false;
  if (!opforge::cuda::is_aligned(out.data_ptr(), 16)) return false;

  Params p;
  p.x = xl.data_ptr();
  p.w = wl.data_ptr();
  p.bias = bl.defined() ? bl.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.N = static_cast<int>(N);
  p.C = static_cast<int>(C);
  p.H = static_cast<int>(H);
  p.W = static_cast<int>(W);
  p.K = static_cast<int>(K);
  p.Ho = static_cast<int>(Ho);
  p.Wo = static_cast<int>(Wo);
  p.stride = static_cast<int>(stride);
  p.pad = static_cast<int>(padding);
  p.R = static_cast<int>(R);
  p.M = static_cast<int>(M);
  p.Kg = static_cast<int>(R * R * C);
  p.tiles_n = 0;  // set per tile configuration
  p.act = act;
  p.out_nhwc = out_nhwc;
  p.vec_store = out_nhwc && (K % chunk == 0);
  if (((M + 63) / 64) * ((K + 63) / 64) > kIntMax) return false;  // grid.x of the smallest tiles

  switch (dtype) {
    case at::kBFloat16:
      launch<__nv_bfloat16>(p);
      break;
    case at::kHalf:
      launch<__half>(p);
      break;
    default:
      launch<float>(p);
      break;
  }
  return true;
}

}  // namespace

namespace opforge::conv {

bool conv3x3_dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                               int64_t padding, Activation act, at::Tensor& out) {
  if (w.dim() != 4 || w.size(2) != 3 || w.size(3) != 3) return false;
  return dense_forward_mma(x, w, bias, stride, padding, act, out);
}

bool conv1x1_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                         Activation act, at::Tensor& out) {
  if (w.dim() != 4 || w.size(2) != 1 || w.size(3) != 1) return false;
  return dense_forward_mma(x, w, bias, stride, 0, act, out);
}

}  // namespace opforge::conv

// ---- test / benchmark entry: opforge_bench.conv_dense_mma -----------------------
// Runs the tensor-core path alone and raises when it declines the case, so
// tests and benchmarks know they measured this kernel and not a fallback.
namespace {

at::Tensor conv3x3_dense_mma_entry(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                   int64_t stride, int64_t padding, bool relu) {
  constexpr const char* op = "opforge_bench.conv_dense_mma";
  // The checks and the output's shape, shared with the shape function (conv.cpp).
  const std::vector<c10::SymInt> sizes = opforge::conv::check_dense_mma_args(x, w, bias, stride, padding);
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();

  const c10::cuda::CUDAGuard guard(x.device());
  const auto fmt = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? at::MemoryFormat::ChannelsLast
                                                                               : at::MemoryFormat::Contiguous;
  at::Tensor out = at::empty_symint(sizes, x.options().memory_format(fmt));
  if (out.numel() == 0) return out;
  const bool done = opforge::conv::conv3x3_dense_forward_mma(
      x, w, b, stride, padding, relu ? opforge::Activation::Relu : opforge::Activation::None, out);
  TORCH_CHECK(done, op, ": the tensor-core path declines this case (dtype ", opforge::dtype_name(x.scalar_type()),
              ", C=", opforge::num(x.size(1)),
              "; it needs bfloat16/float16 with C % 8 == 0, or float32 with C % 4 == 0 and TF32 allowed for "
              "cuDNN convolutions, on sm_80 or newer)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge_bench, CUDA, m) { m.impl("conv_dense_mma", &conv3x3_dense_mma_entry); }

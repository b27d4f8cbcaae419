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
// K_gemm in stages of 64 bytes (32 half values / 16 floats). The CTA tiles,
// picked by grid size in conv_dense_mma.cu's `launch`: 128x128 with 8 warps
// (3 stages, 60 KB, bfloat16/float16 with K > 64), 128x64 with 4 warps
// (3 stages, 45 KB, 4 CTAs per SM), 64x64 with 4 warps (4 stages, 40 KB) for
// small problems, 128x32 with 4 warps for few output channels.
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
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <opforge/cuda_async.cuh>

#include "activation.h"

// Included by conv_dense_mma.cu alone, whose host side launches the kernel.
namespace opforge::conv::dense_mma {

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

}  // namespace opforge::conv::dense_mma

// Device helpers shared by the depthwise kernels (cuda/conv_depthwise/*.cuh):
// vector copies through shared memory, ReLU that keeps NaN, the half types'
// widening and rounding in fours, the ReLU mask of grad_out, and the
// deterministic block reductions of the weight sums.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <opforge/cuda_async.cuh>
#include <opforge/cuda_vec.cuh>

#include "cuda/conv_depthwise/conv_dw.h"

namespace opforge::conv {
// Internal linkage: each .cu that includes this header compiles its own copy
// of what it uses; only the launchers of conv_dw.h cross translation units.
namespace {

using opforge::cuda::AlignedVec;
using opforge::cuda::copy_async;
using opforge::cuda::copy_async_wait_all;

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

// act(v), the ReLU as relu_nan (one instruction).
__device__ __forceinline__ float activate(float v, Activation act) {
  return act == Activation::Relu ? relu_nan(v) : apply_activation(v, act);
}
__device__ __forceinline__ double activate(double v, Activation act) { return apply_activation(v, act); }

// Four results rounded to scalar_t, after act. From sm_80 on
// the half types round two values per instruction (cvt ...x2, its .relu
// form keeping NaN as relu_nan does) instead of one value per conversion
// plus byte permutes to pair them.
template <typename scalar_t>
__device__ __forceinline__ AlignedVec<scalar_t, 4> narrow4(const float (&v)[4], Activation act) {
  AlignedVec<scalar_t, 4> out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(scalar_t) == 2) {
    const bool relu = act == Activation::Relu;
    float a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = relu ? v[e] : apply_activation(v[e], act);
    uint32_t w[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (relu) {
          asm("cvt.rn.relu.bf16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(a[2 * k]), "f"(a[2 * k + 1]));
        } else {
          asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(a[2 * k]), "f"(a[2 * k + 1]));
        }
      } else {
        if (relu) {
          asm("cvt.rn.relu.f16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(a[2 * k]), "f"(a[2 * k + 1]));
        } else {
          asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(w[k]) : "f"(a[2 * k]), "f"(a[2 * k + 1]));
        }
      }
    }
    memcpy(&out, w, sizeof(out));
    return out;
  } else
#endif
  {
#pragma unroll
    for (int e = 0; e < 4; ++e) out.val[e] = static_cast<scalar_t>(activate(v[e], act));
    return out;
  }
}

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

}  // namespace
}  // namespace opforge::conv

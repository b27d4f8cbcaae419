// Device arithmetic of the softmax kernels: exps in opmath, NaN-propagating
// max, and reductions over a power-of-two group of threads.
#pragma once

#include <limits>

#include "config.h"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// The exp of an element where no row max is at hand (the outer-dim forward,
// the log_softmax backward's exp(y)): in float32 opmath (float32, float16,
// bfloat16) the hardware's exp2 approximation (__expf: relative error within
// 2 + 1.2|v| ulp, as torch.compile's generated kernels use); float64 stays
// exact. The row forward takes exp_from below.
__device__ __forceinline__ float elem_exp(float v) { return __expf(v); }
__device__ __forceinline__ double elem_exp(double v) { return exp(v); }

// The forward's exps of a row, e^(x - m) against the row's (or chunk's)
// max m. In float opmath they are taken in base 2 against the max scaled
// once, mk = m log2(e) (scaled_max, rounded once): e^(x - m) = 2^(x log2(e)
// - mk) is one FFMA and the MUFU ex2, where __expf(x - m) also takes a
// subtraction and ex2's handling of results below 2^-126 (here flushed to
// 0; the sum of a row is at least 1): fewer instructions for the packed
// half-type forward, which takes every exp twice. Every exp of a row and
// every rescale between chunk maxima (rebase) takes the same rounded mk,
// so that rounding shifts all of a row's terms alike and cancels in the
// quotient. float64 stays exact.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float scaled_max(float m) { return __fmul_rn(m, kLog2e); }
__device__ __forceinline__ double scaled_max(double m) { return m; }
__device__ __forceinline__ float exp_from(float x, float mk) {
  float r = 0;
#if defined(__CUDA_ARCH__)
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(x, kLog2e, -mk)));
#endif
  return r;
}
__device__ __forceinline__ double exp_from(double x, double m) { return exp(x - m); }
// e^(m - gm) for a chunk's max m and the row's gm, in the scaled terms of
// exp_from (NaN where both are +inf, as exp(inf - inf)).
__device__ __forceinline__ float rebase(float m, float gm) { return exp2f(scaled_max(m) - scaled_max(gm)); }
__device__ __forceinline__ double rebase(double m, double gm) { return exp(m - gm); }
__device__ __forceinline__ float dev_log(float v) { return logf(v); }
__device__ __forceinline__ double dev_log(double v) { return log(v); }
// log of the sum of e^(x - m) over a row, from the sum exp_from gave:
// log_softmax does not divide by the sum, so the rounding of mk would stay
// in it (sum = 2^(m log2(e) - mk) * the sum against m); the product's
// residual, exact by FMA, takes that factor out.
__device__ __forceinline__ float log_sum(float m, float sum) {
  return dev_log(sum) - fmaf(m, kLog2e, -scaled_max(m)) * 0.6931471805599453f;
}
__device__ __forceinline__ double log_sum(double, double sum) { return log(sum); }

// max that propagates NaN (as torch's reductions).
template <typename A>
__device__ __forceinline__ A max_nan(A a, A b) {
  return (a > b || a != a) ? a : b;
}
// float: one instruction from sm_80 on (max.NaN) instead of two compares and
// a select, which matters where every element goes through it.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}

// x / G and x % G for the group size G, always a power of two: shifts and
// masks rather than integer divisions by a runtime value.
__device__ __forceinline__ int div_group(int x, int G) { return x >> (__ffs(G) - 1); }
__device__ __forceinline__ int mod_group(int x, int G) { return x & (G - 1); }

struct MaxOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return max_nan(a, b);
  }
};
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
};

// Reduction over a group of G threads (G a power of two, consecutive thread
// ids). Every thread of the block must call it (it may synchronise the block
// when G > 32); every thread of the group gets the result. `smem` holds 32
// values.
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int G, Op op, A* smem) {
  const int width = G < 32 ? G : 32;
  for (int off = width / 2; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (G <= 32) return v;
  const int warp = threadIdx.x / 32;
  __syncthreads();  // smem may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) smem[warp] = v;
  __syncthreads();
  const int nw = G / 32;
  const int first = div_group(threadIdx.x, G) * nw;
  A r = smem[first];
  for (int i = 1; i < nw; ++i) r = op(r, smem[first + i]);
  return r;
}

}  // namespace
}  // namespace opforge::softmax::gpu

// Warp and block reductions for CUDA kernels that reduce along rows
// (softmax, norms): every thread of the block gets the reduced value.
//
//   acc_t m = -inf;
//   for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = MaxOp{}(m, acc_t(row[j]));
//   m = opforge::cuda::block_all_reduce(m, opforge::cuda::MaxOp{});
//
// Requirements: blockDim.x is a multiple of 32 (at most 1024) and every
// thread of the block calls it (it synchronises the block). It may be called
// several times in a row: it waits before reusing its shared memory. T is
// the accumulation type (float or double: at::opmath_type of the input).
#pragma once

#include <c10/macros/Macros.h>

namespace opforge::cuda {

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return a + b;
  }
};

// max that propagates NaN, as torch's max and softmax do.
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const {
    return (a != a || a > b) ? a : b;
  }
};

// Reduces over the 32 lanes of a warp; every lane gets the result.
template <typename T, typename Op>
__device__ __forceinline__ T warp_all_reduce(T v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces over the whole block; every thread gets the same result (the
// partials are combined in the same order by every thread).
template <typename T, typename Op>
__device__ __forceinline__ T block_all_reduce(T v, Op op) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
  v = warp_all_reduce(v, op);
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  T r = partial[0];
  for (int i = 1; i < warps; ++i) r = op(r, partial[i]);
  return r;
}

}  // namespace opforge::cuda

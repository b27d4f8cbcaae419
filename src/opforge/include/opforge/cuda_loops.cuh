// CUDA loop for binary elementwise ops over a TensorIterator.
//
// Contiguous operands take a 16-byte vectorized grid-stride kernel (several
// vectors in flight per thread); anything else (broadcast, strided, expanded)
// a general kernel that maps each linear index to byte offsets. Both compute
// in opmath_t (float for half types) and launch on the current stream.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>

namespace opforge::cuda {

constexpr int kMaxDims = 25;  // TensorIterator's own limit
constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors per thread per step: more bytes in flight

struct OffsetMeta {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[3][kMaxDims];  // bytes; operand 0 is the output
};

// Each block owns kThreads * kUnroll consecutive vectors per step; thread t
// handles vectors t, t + kThreads, ... of it, so every load instruction of a
// warp is coalesced and each thread has kUnroll loads per input in flight.
template <typename scalar_t, int N, typename Op>
__global__ void binary_contiguous_kernel(scalar_t* __restrict__ out, const scalar_t* __restrict__ a,
                                         const scalar_t* __restrict__ b, int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = AlignedVec<scalar_t, N>;
  const int64_t n_vec = n / N;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; base < n_vec;
       base += step) {
    V va[kUnroll], vb[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // issue every load before the first use
      const int64_t i = base + u * blockDim.x;
      if (i < n_vec) {
        va[u] = load_vec<scalar_t, N>(a, i);
        vb[u] = load_vec<scalar_t, N>(b, i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < n_vec) {
        V r;
#pragma unroll
        for (int k = 0; k < N; ++k)
          r.val[k] =
              static_cast<scalar_t>(op(static_cast<opmath_t>(va[u].val[k]), static_cast<opmath_t>(vb[u].val[k])));
        store_vec<scalar_t, N>(out, i, r);
      }
    }
  }
  // Tail of fewer than N elements.
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t t = n_vec * N + tid;
  if (t < n) out[t] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[t]), static_cast<opmath_t>(b[t])));
}

template <typename scalar_t, typename Op>
__global__ void binary_strided_kernel(char* out, const char* a, const char* b, int64_t n, OffsetMeta meta, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += stride) {
    int64_t rem = idx, off_o = 0, off_a = 0, off_b = 0;
    for (int d = 0; d < meta.ndim; ++d) {  // dim 0 is the fastest-moving
      const int64_t q = rem % meta.sizes[d];
      rem /= meta.sizes[d];
      off_o += q * meta.strides[0][d];
      off_a += q * meta.strides[1][d];
      off_b += q * meta.strides[2][d];
    }
    const opmath_t x = *reinterpret_cast<const scalar_t*>(a + off_a);
    const opmath_t y = *reinterpret_cast<const scalar_t*>(b + off_b);
    *reinterpret_cast<scalar_t*>(out + off_o) = static_cast<scalar_t>(op(x, y));
  }
}

// out[i] = op(a[i], b[i]) for i < n over flat arrays; 16-byte vectors when
// all three are aligned. The caller holds a device guard.
template <typename scalar_t, typename Op>
void binary_contiguous(scalar_t* out, const scalar_t* a, const scalar_t* b, int64_t n, Op op) {
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int N = vec_width<scalar_t>();
  // One step per thread (no grid-stride repeats) up to the grid limit: a
  // streaming kernel keeps the most memory traffic in flight that way.
  auto blocks_for = [](int64_t vectors) {
    const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
    return std::max<int64_t>(1, std::min<int64_t>((vectors + per_block - 1) / per_block, (1LL << 31) - 1));
  };
  if (is_aligned(out, 16) && is_aligned(a, 16) && is_aligned(b, 16)) {
    binary_contiguous_kernel<scalar_t, N><<<blocks_for(n / N), kThreads, 0, stream>>>(out, a, b, n, op);
  } else {
    binary_contiguous_kernel<scalar_t, 1><<<blocks_for(n), kThreads, 0, stream>>>(out, a, b, n, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = op(a, b) over the iterator (operand 0 is the output). The caller
// holds a device guard for the iterator's device.
template <typename scalar_t, typename Op>
void binary_kernel(at::TensorIteratorBase& iter, Op op) {
  const int64_t n = iter.numel();
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (iter.is_contiguous()) {
    binary_contiguous<scalar_t>(static_cast<scalar_t*>(iter.data_ptr(0)),
                                static_cast<const scalar_t*>(iter.data_ptr(1)),
                                static_cast<const scalar_t*>(iter.data_ptr(2)), n, op);
    return;
  }
  OffsetMeta meta{};
  meta.ndim = iter.ndim();
  TORCH_INTERNAL_ASSERT(meta.ndim <= kMaxDims);
  for (int d = 0; d < meta.ndim; ++d) {
    meta.sizes[d] = iter.shape()[d];
    for (int k = 0; k < 3; ++k) meta.strides[k][d] = iter.strides(k)[d];
  }
  binary_strided_kernel<scalar_t><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      static_cast<char*>(iter.data_ptr(0)), static_cast<const char*>(iter.data_ptr(1)),
      static_cast<const char*>(iter.data_ptr(2)), n, meta, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace opforge::cuda

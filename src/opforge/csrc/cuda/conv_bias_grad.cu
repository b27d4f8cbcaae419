// The dense conv backward's first pass on CUDA: the ReLU-masked gradient
// and the bias gradient (its per-channel sums) from one read of grad_out
// and the result. cuDNN's backward then runs without the bias. (Masking,
// then ATen's sum over N, H and W, took a second read of the gradient, and
// that sum ran at 430-660 GB/s on the H200: 31-39 us of a 0.11-0.27 ms
// backward.)
//
// Both layouts write per-block partial sums in opmath and one small kernel
// adds each channel's partials in a fixed order: deterministic, no atomics.
//  * NHWC: grad_out is a (rows, K) matrix. A block walks a range of rows,
//    each thread one vector of V channels (16 bytes where K and the
//    pointers allow) of every `rows_per_step`-th row; the block's threads
//    of one channel vector are then summed through shared memory.
//  * NCHW: grad_out is N * K planes of Ho * Wo. A warp sums one split of a
//    plane (planes are split until the GPU is full), with vector loads
//    along the plane.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_reduce.cuh>
#include <opforge/cuda_vec.cuh>
#include <opforge/dispatch.h>

#include <algorithm>
#include <type_traits>

#include "cuda/conv_bias_grad.h"

namespace opforge::conv {
namespace {

using opforge::cuda::AlignedVec;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// One vector of grad_out, masked where the result (null: no mask) is <= 0;
// written to `masked` when that is not null.
template <typename T, int V>
__device__ __forceinline__ AlignedVec<T, V> masked_vec(const T* __restrict__ go, const T* __restrict__ res,
                                                       T* __restrict__ masked, int64_t i) {
  AlignedVec<T, V> g = opforge::cuda::load_vec<T, V>(go, i);
  if (res != nullptr) {
    const AlignedVec<T, V> r = opforge::cuda::load_vec<T, V>(res, i);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if (r.val[v] <= T(0)) g.val[v] = T(0);
    }
    if (masked != nullptr) opforge::cuda::store_vec<T, V>(masked, i, g);
  }
  return g;
}

// NHWC: block b covers rows [b * rows_per_block, ...); its threads are
// `rows_per_step` rows of `lanes` channel vectors (lanes * rows_per_step
// <= kThreads), blockIdx.y picking which `lanes` vectors of the row.
// part[b * K + k]: the block's sum of channel k.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bias_grad_nhwc(const T* __restrict__ go, const T* __restrict__ res, T* __restrict__ masked,
                   at::opmath_type<T>* __restrict__ part, int64_t rows, int64_t cols, int lanes, int rows_per_step,
                   int64_t rows_per_block) {
  using A = at::opmath_type<T>;
  __shared__ A sums[kThreads * V];
  const int lane = threadIdx.x % lanes;
  const int step_row = threadIdx.x / lanes;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * lanes + lane;
  const bool active = step_row < rows_per_step && col < cols;
  A acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = A(0);
  const int64_t r_begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
  const int64_t r_end = min(rows, r_begin + rows_per_block);
  if (active) {
#pragma unroll 4
    for (int64_t r = r_begin + step_row; r < r_end; r += rows_per_step) {
      const AlignedVec<T, V> g = masked_vec<T, V>(go, res, masked, r * cols + col);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += static_cast<A>(g.val[v]);
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) sums[threadIdx.x * V + v] = acc[v];
  __syncthreads();
  if (active && step_row == 0) {
    for (int j = 1; j < rows_per_step; ++j) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += sums[(j * lanes + lane) * V + v];
    }
#pragma unroll
    for (int v = 0; v < V; ++v) part[blockIdx.x * cols * V + col * V + v] = acc[v];
  }
}

// NCHW: warp w of the grid sums split (w % splits) of plane (w / splits),
// `chunk` elements (a multiple of V) of its `plane` elements; part[w].
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    bias_grad_nchw(const T* __restrict__ go, const T* __restrict__ res, T* __restrict__ masked,
                   at::opmath_type<T>* __restrict__ part, int64_t items, int64_t plane, int splits, int64_t chunk) {
  using A = at::opmath_type<T>;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (item >= items) return;  // whole warps: no block barrier below
  const int lane = threadIdx.x % 32;
  const int64_t begin = item / splits * plane + item % splits * chunk;  // a multiple of V
  const int64_t end = item / splits * plane + min(plane, (item % splits + 1) * chunk);
  A acc = A(0);
#pragma unroll 4
  for (int64_t i = begin / V + lane; i < end / V; i += 32) {
    const AlignedVec<T, V> g = masked_vec<T, V>(go, res, masked, i);
#pragma unroll
    for (int v = 0; v < V; ++v) acc += static_cast<A>(g.val[v]);
  }
  acc = opforge::cuda::warp_all_reduce(acc, opforge::cuda::SumOp{});
  if (lane == 0) part[item] = acc;
}

// grad_bias[k] = sum over a < outer, b < inner of
// part[a * outer_stride + k * inner + b], one block per channel; every
// thread adds its share in a fixed order and the block's reduction is fixed.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    bias_grad_finish(const at::opmath_type<T>* __restrict__ part, T* __restrict__ gb, int64_t outer,
                     int64_t outer_stride, int64_t inner) {
  using A = at::opmath_type<T>;
  const int64_t k = blockIdx.x;
  A acc = A(0);
  for (int64_t i = threadIdx.x; i < outer * inner; i += kThreads) {
    acc += part[i / inner * outer_stride + k * inner + i % inner];
  }
  acc = opforge::cuda::block_all_reduce(acc, opforge::cuda::SumOp{});
  if (threadIdx.x == 0) gb[k] = static_cast<T>(acc);
}

// Blocks of kThreads that fill the GPU once.
int64_t resident_blocks() {
  return static_cast<int64_t>(opforge::cuda::sm_count()) *
         (at::cuda::getCurrentDeviceProperties()->maxThreadsPerMultiProcessor / kThreads);
}

template <typename T, int V>
void launch_nhwc(const T* go, const T* res, T* masked, T* gb, int64_t rows, int64_t K, const at::TensorOptions& opts,
                 cudaStream_t stream) {
  using A = at::opmath_type<T>;
  const int64_t cols = K / V;
  const int lanes = static_cast<int>(std::min<int64_t>(cols, kThreads));
  const int rows_per_step = kThreads / lanes;
  const int64_t col_blocks = (cols + lanes - 1) / lanes;
  // Enough row blocks to fill the GPU, each thread still walking a few rows.
  const int64_t want = std::max<int64_t>(1, resident_blocks() / col_blocks);
  const int64_t row_blocks = std::max<int64_t>(1, std::min(want, rows / (rows_per_step * 4)));
  const int64_t rows_per_block = (rows + row_blocks - 1) / row_blocks;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  at::Tensor part = at::empty({blocks * K}, opts.dtype(c10::CppTypeToScalarType<A>::value));
  bias_grad_nhwc<T, V><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(col_blocks)), kThreads, 0, stream>>>(
      go, res, masked, part.mutable_data_ptr<A>(), rows, cols, lanes, rows_per_step, rows_per_block);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (gb != nullptr) {
    bias_grad_finish<T><<<static_cast<unsigned>(K), kThreads, 0, stream>>>(part.const_data_ptr<A>(), gb, blocks, K, 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, int V>
void launch_nchw(const T* go, const T* res, T* masked, T* gb, int64_t N, int64_t K, int64_t plane,
                 const at::TensorOptions& opts, cudaStream_t stream) {
  using A = at::opmath_type<T>;
  const int64_t planes = N * K;
  // Split planes until the GPU's warps are all busy, each warp still
  // walking at least four vectors per lane.
  const int64_t want = (resident_blocks() * kWarps + planes - 1) / planes;
  const int64_t most = std::max<int64_t>(1, plane / (32 * V * 4));
  const int splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, 1 << 16})));
  int64_t chunk = (plane + splits - 1) / splits;
  chunk = (chunk + V - 1) / V * V;
  const int64_t items = planes * splits;
  at::Tensor part = at::empty({items}, opts.dtype(c10::CppTypeToScalarType<A>::value));
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  bias_grad_nchw<T, V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      go, res, masked, part.mutable_data_ptr<A>(), items, plane, splits, chunk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (gb != nullptr) {
    bias_grad_finish<T>
        <<<static_cast<unsigned>(K), kThreads, 0, stream>>>(part.const_data_ptr<A>(), gb, N, K * splits, splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Calls f(std::integral_constant<int, V>) for V from pick_vec (a power of
// two up to 16 bytes of T).
template <typename T, typename F>
void with_vec(int V, F&& f) {
  constexpr int kMax = opforge::cuda::vec_width<T>();
  if constexpr (kMax >= 8) {
    if (V == 8) return f(std::integral_constant<int, 8>{});
  }
  if constexpr (kMax >= 4) {
    if (V == 4) return f(std::integral_constant<int, 4>{});
  }
  if (V == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

}  // namespace

void masked_grad_bias_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& masked,
                           const at::Tensor& grad_bias, bool nhwc) {
  const int64_t N = grad_out.size(0), K = grad_out.size(1), plane = grad_out.size(2) * grad_out.size(3);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  OPFORGE_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "conv2d_3x3_dense_bias_grad", [&] {
    const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* res = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* mp = masked.defined() ? masked.mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* gb = grad_bias.defined() ? grad_bias.mutable_data_ptr<scalar_t>() : nullptr;
    // Vectors run along the channels (NHWC) or along a plane (NCHW).
    const int V = opforge::cuda::pick_vec<scalar_t>(nhwc ? K : plane, {go, res, mp});
    with_vec<scalar_t>(V, [&](auto vc) {
      constexpr int kV = decltype(vc)::value;
      if (nhwc) {
        launch_nhwc<scalar_t, kV>(go, res, mp, gb, N * plane, K, grad_out.options(), stream);
      } else {
        launch_nchw<scalar_t, kV>(go, res, mp, gb, N, K, plane, grad_out.options(), stream);
      }
    });
  });
}

}  // namespace opforge::conv

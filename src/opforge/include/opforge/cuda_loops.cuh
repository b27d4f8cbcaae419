// CUDA loops for elementwise ops of any number of inputs over a
// TensorIterator.
//
// Contiguous operands take a 16-byte vectorized grid-stride kernel (several
// vectors per input in flight per thread); anything else (broadcast,
// strided, expanded) a general kernel that maps each linear index to byte
// offsets. Both compute in opmath_t (float for half types) and launch on the
// current stream. `binary_*` are the N = 2 cases.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_like.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>
#include <opforge/dispatch.h>
#include <opforge/elementwise.h>

#include <utility>

namespace opforge::cuda {

constexpr int kMaxDims = 25;  // TensorIterator's own limit
constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors per input per thread per step: more bytes in flight

// Sizes and byte strides of NT operands (operand 0 is the output), passed
// to the strided kernel by value: (NT + 1) * 200 bytes of parameters.
template <int NT>
struct OffsetMeta {
  int ndim;
  int64_t sizes[kMaxDims];
  int64_t strides[NT][kMaxDims];
};

// The N input pointers, passed by value.
template <typename T, int N>
struct InputPtrs {
  const T* p[N];
};

// op(args[0], ..., args[N-1]), each converted to opmath_t.
template <typename opmath_t, typename Op, typename T, int N, size_t... I>
__device__ __forceinline__ opmath_t apply_n(Op& op, const T (&args)[N], std::index_sequence<I...>) {
  return op(static_cast<opmath_t>(args[I])...);
}

// Each block owns kThreads * kUnroll consecutive vectors per step; thread t
// handles vectors t, t + kThreads, ... of it, so every load instruction of a
// warp is coalesced and each thread has kUnroll loads per input in flight.
template <typename scalar_t, int N, int V, typename Op>
__global__ void elementwise_contiguous_kernel(scalar_t* __restrict__ out, InputPtrs<scalar_t, N> in, int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = AlignedVec<scalar_t, V>;
  constexpr auto idx = std::make_index_sequence<N>{};
  const int64_t n_vec = n / V;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; base < n_vec;
       base += step) {
    Vec v[kUnroll][N];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // issue every load before the first use
      const int64_t i = base + u * blockDim.x;
      if (i < n_vec) {
#pragma unroll
        for (int k = 0; k < N; ++k) v[u][k] = load_vec<scalar_t, V>(in.p[k], i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < n_vec) {
        Vec r;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          scalar_t x[N];
#pragma unroll
          for (int k = 0; k < N; ++k) x[k] = v[u][k].val[e];
          r.val[e] = static_cast<scalar_t>(apply_n<opmath_t>(op, x, idx));
        }
        store_vec<scalar_t, V>(out, i, r);
      }
    }
  }
  // Tail of fewer than V elements.
  const int64_t t = n_vec * V + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) {
    scalar_t x[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = in.p[k][t];
    out[t] = static_cast<scalar_t>(apply_n<opmath_t>(op, x, idx));
  }
}

template <typename scalar_t, int N, typename Op>
__global__ void elementwise_strided_kernel(char* out, InputPtrs<char, N> in, int64_t n, OffsetMeta<N + 1> meta, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr auto idx = std::make_index_sequence<N>{};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t linear = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; linear < n; linear += stride) {
    int64_t rem = linear, off[N + 1] = {};
    for (int d = 0; d < meta.ndim; ++d) {  // dim 0 is the fastest-moving
      const int64_t q = rem % meta.sizes[d];
      rem /= meta.sizes[d];
#pragma unroll
      for (int k = 0; k <= N; ++k) off[k] += q * meta.strides[k][d];
    }
    scalar_t x[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = *reinterpret_cast<const scalar_t*>(in.p[k] + off[k + 1]);
    *reinterpret_cast<scalar_t*>(out + off[0]) = static_cast<scalar_t>(apply_n<opmath_t>(op, x, idx));
  }
}

// out[i] = op(in[0][i], ..., in[N-1][i]) for i < n over flat arrays;
// 16-byte vectors when every pointer is aligned. The caller holds a device
// guard.
template <typename scalar_t, int N, typename Op>
void elementwise_contiguous(scalar_t* out, InputPtrs<scalar_t, N> in, int64_t n, Op op) {
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int V = vec_width<scalar_t>();
  // One step per thread (no grid-stride repeats) up to the grid limit: a
  // streaming kernel keeps the most memory traffic in flight that way.
  auto blocks_for = [](int64_t vectors) {
    const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
    return std::max<int64_t>(1, std::min<int64_t>((vectors + per_block - 1) / per_block, (1LL << 31) - 1));
  };
  bool aligned = is_aligned(out, 16);
  for (int k = 0; k < N; ++k) aligned = aligned && is_aligned(in.p[k], 16);
  if (aligned) {
    elementwise_contiguous_kernel<scalar_t, N, V><<<blocks_for(n / V), kThreads, 0, stream>>>(out, in, n, op);
  } else {
    elementwise_contiguous_kernel<scalar_t, N, 1><<<blocks_for(n), kThreads, 0, stream>>>(out, in, n, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename Op>
void binary_contiguous(scalar_t* out, const scalar_t* a, const scalar_t* b, int64_t n, Op op) {
  elementwise_contiguous<scalar_t, 2>(out, InputPtrs<scalar_t, 2>{{a, b}}, n, op);
}

// out = op(inputs...) over the iterator (operand 0 the output, then N
// inputs, all of dtype scalar_t: make_float_iter promotes them). The caller
// holds a device guard for the iterator's device.
template <typename scalar_t, int N, typename Op>
void elementwise_kernel(at::TensorIteratorBase& iter, Op op) {
  // Numbers through num(): see checks.h on streams in code nvcc compiles.
  TORCH_CHECK(iter.ninputs() == N && iter.noutputs() == 1, "opforge::cuda::elementwise_kernel<", num(N),
              ">: the iterator has ", num(iter.ninputs()), " inputs and ", num(iter.noutputs()), " outputs");
  const int64_t n = iter.numel();
  if (n == 0) return;
  if (iter.is_contiguous()) {
    InputPtrs<scalar_t, N> in;
    for (int k = 0; k < N; ++k) in.p[k] = static_cast<const scalar_t*>(iter.data_ptr(k + 1));
    elementwise_contiguous<scalar_t, N>(static_cast<scalar_t*>(iter.data_ptr(0)), in, n, op);
    return;
  }
  OffsetMeta<N + 1> meta{};
  meta.ndim = iter.ndim();
  TORCH_INTERNAL_ASSERT(meta.ndim <= kMaxDims);
  for (int d = 0; d < meta.ndim; ++d) {
    meta.sizes[d] = iter.shape()[d];
    for (int k = 0; k <= N; ++k) meta.strides[k][d] = iter.strides(k)[d];
  }
  InputPtrs<char, N> in;
  for (int k = 0; k < N; ++k) in.p[k] = static_cast<const char*>(iter.data_ptr(k + 1));
  auto stream = at::cuda::getCurrentCUDAStream();
  elementwise_strided_kernel<scalar_t, N>
      <<<grid_for(n, kThreads), kThreads, 0, stream>>>(static_cast<char*>(iter.data_ptr(0)), in, n, meta, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename Op>
void binary_kernel(at::TensorIteratorBase& iter, Op op) {
  elementwise_kernel<scalar_t, 2>(iter, op);
}

// The whole CUDA side of an elementwise op with one output: inputs of one
// dtype, shape and device, all contiguous, run as one flat vectorized kernel
// (no iterator to build); anything else is checked, promoted and broadcast
// through make_float_iter. `op` is a functor with a C10_HOST_DEVICE
// operator() over N opmath_t values; the device guard is taken here.
template <int N, typename Op>
at::Tensor run_elementwise(const char* op_name, at::ArrayRef<at::Tensor> inputs, at::ArrayRef<const char*> names,
                           Op op) {
  TORCH_CHECK(inputs.size() == N, op_name, ": the op's C++ code passes ", num(static_cast<int64_t>(inputs.size())),
              " inputs to opforge::cuda::run_elementwise<", num(N), ">");
  if (is_flat(inputs)) {
    const c10::cuda::CUDAGuard guard(inputs[0].device());
    auto out = at::empty_like(inputs[0], at::MemoryFormat::Contiguous);
    OPFORGE_DISPATCH_FLOATING_TYPES(inputs[0].scalar_type(), "opforge_elementwise", [&] {
      InputPtrs<scalar_t, N> in;
      for (int k = 0; k < N; ++k) in.p[k] = inputs[k].const_data_ptr<scalar_t>();
      elementwise_contiguous<scalar_t, N>(out.mutable_data_ptr<scalar_t>(), in, out.numel(), op);
    });
    return out;
  }
  auto iter = make_float_iter(op_name, inputs, names);
  const c10::cuda::CUDAGuard guard(iter.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(iter.dtype(0), "opforge_elementwise",
                                  [&] { elementwise_kernel<scalar_t, N>(iter, op); });
  return iter.output();
}

}  // namespace opforge::cuda

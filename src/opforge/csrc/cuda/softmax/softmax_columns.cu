// The softmax kernels over an outer dim (inner > 1) for every dtype, and
// their launches: a thread per column, 256 threads per block, the grid
// sized from the SM count.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <opforge/cuda_launch.cuh>

#include "columns.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace opforge::softmax::gpu {
namespace {

template <typename T>
void forward_columns_impl(sm::Mode mode, const sm::FwdArgs& a) {
  auto stream = at::cuda::getCurrentCUDAStream();
  with_mode(mode, [&](auto m) {
    constexpr sm::Mode MODE = decltype(m)::value;
    if constexpr (MODE != sm::Mode::ScaledMasked) {
      const int threads = 256;
      const auto blocks = opforge::cuda::grid_for(a.outer * a.inner, threads);
      fwd_cols_kernel<T, MODE><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

template <typename T>
void backward_columns_impl(sm::Mode mode, const sm::BwdArgs& a) {
  auto stream = at::cuda::getCurrentCUDAStream();
  with_mode(mode, [&](auto m) {
    constexpr sm::Mode MODE = decltype(m)::value;
    if constexpr (MODE != sm::Mode::ScaledMasked) {
      const int threads = 256;
      const auto blocks = opforge::cuda::grid_for(a.outer * a.inner, threads);
      bwd_cols_kernel<T, MODE><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace

template <>
void forward_columns<float>(Mode mode, const FwdArgs& a) {
  forward_columns_impl<float>(mode, a);
}
template <>
void forward_columns<double>(Mode mode, const FwdArgs& a) {
  forward_columns_impl<double>(mode, a);
}
template <>
void forward_columns<c10::Half>(Mode mode, const FwdArgs& a) {
  forward_columns_impl<c10::Half>(mode, a);
}
template <>
void forward_columns<c10::BFloat16>(Mode mode, const FwdArgs& a) {
  forward_columns_impl<c10::BFloat16>(mode, a);
}

template <>
void backward_columns<float>(Mode mode, const BwdArgs& a) {
  backward_columns_impl<float>(mode, a);
}
template <>
void backward_columns<double>(Mode mode, const BwdArgs& a) {
  backward_columns_impl<double>(mode, a);
}
template <>
void backward_columns<c10::Half>(Mode mode, const BwdArgs& a) {
  backward_columns_impl<c10::Half>(mode, a);
}
template <>
void backward_columns<c10::BFloat16>(Mode mode, const BwdArgs& a) {
  backward_columns_impl<c10::BFloat16>(mode, a);
}

}  // namespace opforge::softmax::gpu

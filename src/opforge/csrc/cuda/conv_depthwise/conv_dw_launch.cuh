// Host helpers of the depthwise launchers (the .cu files of this folder):
// shared-memory opt-in, occupancy-sized splits, and the compile-time
// constants a plan's runtime values select.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <opforge/cuda_launch.cuh>

#include "cuda/conv_depthwise/conv_dw.h"

namespace opforge::conv {

// Kernels whose shared memory passes 48 KiB must say so. The default limit
// counts the kernel's static shared memory (a block reduction's scratch)
// with the dynamic bytes: a 48 KiB stage plus 320 static bytes fails to
// launch without the opt-in.
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (bytes + attr.sharedSizeBytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

// Calls f(std::integral_constant<int, V>) for the general forward's V: 8
// (2-byte types), 4 (up to 4-byte types), 2 or 1.
template <typename scalar_t, typename F>
void with_forward_vec(int V, F&& f) {
  if constexpr (sizeof(scalar_t) == 2) {
    if (V == 8) return f(std::integral_constant<int, 8>{});
  }
  if constexpr (sizeof(scalar_t) <= 4) {
    if (V == 4) return f(std::integral_constant<int, 4>{});
  }
  if (V == 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// Calls f(std::integral_constant<int, V>, std::integral_constant<int, PAD>)
// for the plan's V (16 or 8 bytes of columns) and padding 0, 1 or 2.
template <typename scalar_t, typename F>
void with_nchw_s1_consts(int V, int64_t pad, F&& f) {
  constexpr int E = 16 / static_cast<int>(sizeof(scalar_t));
  auto with_pad = [&](auto v) {
    if (pad == 2)
      f(v, std::integral_constant<int, 2>{});
    else if (pad == 1)
      f(v, std::integral_constant<int, 1>{});
    else
      f(v, std::integral_constant<int, 0>{});
  };
  if (V == E)
    with_pad(std::integral_constant<int, E>{});
  else
    with_pad(std::integral_constant<int, E / 2>{});
}

// Calls f(std::integral_constant<int, PAD>, std::integral_constant<int, LB>).
template <typename F>
void with_nhwc_s1_consts(int64_t pad, int LB, F&& f) {
  auto with_lb = [&](auto pd) {
    if (LB == 16)
      f(pd, std::integral_constant<int, 16>{});
    else if (LB == 8)
      f(pd, std::integral_constant<int, 8>{});
    else
      f(pd, std::integral_constant<int, 4>{});
  };
  if (pad == 2)
    with_lb(std::integral_constant<int, 2>{});
  else if (pad == 1)
    with_lb(std::integral_constant<int, 1>{});
  else
    with_lb(std::integral_constant<int, 0>{});
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

}  // namespace opforge::conv

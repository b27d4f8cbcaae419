// Launch helpers for CUDA kernels: grid sizes from the device's SM count,
// and the stream/guard boilerplate every op needs.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace opforge::cuda {

// Number of SMs of the current device (cached by ATen).
inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Blocks for a grid-stride loop over `items` work items with `threads` per
// block: enough to fill every SM (`max_threads_per_sm / threads` blocks each)
// and never more than the work needs.
inline int64_t grid_for(int64_t items, int threads) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t per_sm = std::max(1, prop->maxThreadsPerMultiProcessor / threads);
  const int64_t needed = (items + threads - 1) / threads;
  return std::max<int64_t>(1, std::min<int64_t>(needed, per_sm * prop->multiProcessorCount));
}

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Largest V (elements per access, at most 16 bytes) dividing `multiple_of`
// with every pointer aligned to V elements: the vector width of a kernel
// that walks rows of `multiple_of` elements with AlignedVec<T, V>.
template <typename T>
int pick_vec(int64_t multiple_of, std::initializer_list<const void*> ptrs) {
  for (int v = static_cast<int>(16 / sizeof(T)); v > 1; v /= 2) {
    bool ok = multiple_of % v == 0;
    for (const void* p : ptrs) ok = ok && is_aligned(p, v * sizeof(T));  // (null counts as aligned)
    if (ok) return v;
  }
  return 1;
}

}  // namespace opforge::cuda

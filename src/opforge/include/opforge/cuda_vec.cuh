// 16-byte vector access for CUDA kernels: `AlignedVec<T, N>` is N values of
// T loaded or stored as one instruction when the address is aligned.
#pragma once

#include <cstdint>

namespace opforge::cuda {

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVec {
  T val[N];
};

// Values of T per 16-byte access (4 floats, 2 doubles, 8 halfs).
template <typename T>
constexpr int vec_width() {
  return 16 / sizeof(T) > 0 ? static_cast<int>(16 / sizeof(T)) : 1;
}

template <typename T, int N>
__device__ __forceinline__ AlignedVec<T, N> load_vec(const T* base, int64_t vec_index) {
  return reinterpret_cast<const AlignedVec<T, N>*>(base)[vec_index];
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* base, int64_t vec_index, const AlignedVec<T, N>& v) {
  reinterpret_cast<AlignedVec<T, N>*>(base)[vec_index] = v;
}

}  // namespace opforge::cuda

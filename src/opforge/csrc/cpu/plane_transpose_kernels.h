// NCHW <-> channels_last transposes of the conv family on the CPU, compiled
// once per ISA by conv_{default,avx2,avx512}.cpp; cpu/plane_transpose.h picks
// the ISA at run time.
//
// Per image, NCHW is a (C, H*W) matrix and channels_last its (H*W, C)
// transpose. Tiles go through at::vec::transpose_mxn, which transposes in
// registers where the ISA has a kernel for the type (AVX-512: 16x16 float,
// 32x32 bfloat16 / float16; AVX2: 16x16 float) and moves scalars otherwise.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

#include <opforge/dispatch.h>

namespace opforge::cpu::CPU_CAPABILITY {
namespace transpose_detail {

template <typename T>
constexpr int kTile = sizeof(T) == 2 ? 32 : 16;

// d (n rows of ldd) = s (m rows of lds)^T, m and n at most kTile<T>.
template <typename T>
inline void tile(const T* s, int64_t lds, T* d, int64_t ldd, int m, int n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<T, double>) {
    at::vec::transpose_mxn<T>(s, lds, d, ldd, m, n);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (m == 16 && n == 16) {
      at::vec::transpose_mxn<float, 16, 16>(s, lds, d, ldd);
      return;
    }
  }
#endif
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) d[j * ldd + i] = s[i * lds + j];
  }
}

// dst[n] = src[n]^T for N row-major (rows, cols) matrices.
template <typename T>
void transpose_matrices(const T* src, T* dst, int64_t N, int64_t rows, int64_t cols) {
  constexpr int64_t t = kTile<T>;
  const int64_t row_tiles = (rows + t - 1) / t, col_tiles = (cols + t - 1) / t;
  const int64_t per_matrix = row_tiles * col_tiles;
  const int64_t grain = std::max<int64_t>(1, 16384 / (t * t));  // about 16K elements a task
  at::parallel_for(0, N * per_matrix, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / per_matrix, k = i % per_matrix;
      const int64_t r0 = (k / col_tiles) * t, c0 = (k % col_tiles) * t;
      const int m = static_cast<int>(std::min(t, rows - r0)), w = static_cast<int>(std::min(t, cols - c0));
      const T* s = src + n * rows * cols + r0 * cols + c0;
      T* d = dst + n * rows * cols + c0 * rows + r0;
      tile(s, cols, d, rows, m, w);
    }
  });
}

}  // namespace transpose_detail

void plane_transpose(c10::ScalarType dtype, const void* src, void* dst, int64_t N, int64_t rows, int64_t cols) {
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "plane_transpose", [&] {
    transpose_detail::transpose_matrices(static_cast<const scalar_t*>(src), static_cast<scalar_t*>(dst), N, rows, cols);
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

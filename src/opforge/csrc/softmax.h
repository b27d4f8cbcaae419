// The softmax family's shared header, included by its CPU (cpu/softmax*)
// and CUDA (cuda/softmax/) kernels: the argument blocks the entry points
// fill in, and the row -> mask offset map of scaled_masked_softmax.
//
// Layout: the input is contiguous and viewed as (outer, K, inner); the
// reduction runs over K. inner == 1 is the inner-most dim (rows contiguous);
// inner > 1 a strided outer dim, reduced without a transpose copy.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#if defined(__CUDACC__)
#define OPFORGE_HD __host__ __device__ __forceinline__
#else
#define OPFORGE_HD inline
#endif

namespace opforge::softmax {

enum class Mode : int { Softmax = 0, LogSoftmax = 1, ScaledMasked = 2 };

// Maps a row index of x viewed as (rows, Lk) to the element offset of that
// row in the mask (expanded to x's shape, leading dims coalesced). The
// mask's last dim is contiguous (stride 1).
struct RowOffset {
  static constexpr int kMaxDims = 8;
  int ndim = 0;                    // 0: no mask
  int64_t sizes[kMaxDims] = {};    // leading dims, outer-most first
  int64_t strides[kMaxDims] = {};  // the mask's strides for them (0 = broadcast)

  OPFORGE_HD int64_t operator()(int64_t row) const {
    // Unrolled with constant indices, so a kernel argument is never
    // indexed dynamically (that would copy it to local memory).
    int64_t off = 0;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int d = kMaxDims - 1; d >= 0; --d) {
      if (d < ndim) {
        const int64_t s = sizes[d];
        off += (row % s) * strides[d];
        row /= s;
      }
    }
    return off;
  }
};

struct FwdArgs {
  c10::ScalarType dtype;
  Mode mode;
  const void* in;
  void* out;
  int64_t outer, K, inner;
  // scaled_masked_softmax only (inner == 1):
  double scale = 1.0;
  const void* mask = nullptr;  // bool (uint8) or x's dtype, last dim contiguous
  bool mask_is_bool = false;
  RowOffset mask_rows;
  bool causal = false;
  int64_t Lq = 1;  // rows are (..., Lq); query index = row % Lq
};

struct BwdArgs {
  c10::ScalarType dtype;
  Mode mode;  // Softmax / ScaledMasked: y * (dy - sum(dy * y)) [* scale]; LogSoftmax: dy - exp(y) * sum(dy)
  const void* grad;
  const void* out;  // the forward's output y
  void* grad_in;
  int64_t outer, K, inner;
  double scale = 1.0;
};

}  // namespace opforge::softmax

// NCHW <-> channels_last copies of a 4-d CPU tensor for the conv family's loops.
//
// Per image, NCHW is a (C, H*W) matrix and channels_last its (H*W, C)
// transpose: both copies are register-tiled transposes
// (cpu/plane_transpose_kernels.h). On depthwise layer shapes ATen's strided
// copy between the two formats takes about 3.5x a plain copy, these about 2x.
#pragma once

#include <ATen/Functions.h>

#include <opforge/cpu_isa.h>

OPFORGE_CPU_DECLARE(void, plane_transpose, c10::ScalarType, const void*, void*, int64_t, int64_t, int64_t)

namespace opforge::conv {

// t (4-d, contiguous in one of the two formats) as a tensor contiguous in fmt; t itself where
// it already is.
inline at::Tensor plane_transpose_copy(const at::Tensor& t, at::MemoryFormat fmt) {
  if (t.is_contiguous(fmt)) return t;
  const bool to_nhwc = fmt == at::MemoryFormat::ChannelsLast;
  const auto from = to_nhwc ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast;
  const auto dtype = t.scalar_type();
  const bool typed = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  if (t.dim() != 4 || !t.is_contiguous(from) || !typed) return t.contiguous(fmt);
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(fmt));
  const int64_t N = t.size(0), C = t.size(1), HW = t.size(2) * t.size(3);
  const int64_t rows = to_nhwc ? C : HW, cols = to_nhwc ? HW : C;
  OPFORGE_CPU_SELECT(plane_transpose)(dtype, t.const_data_ptr(), out.data_ptr(), N, rows, cols);
  return out;
}

}  // namespace opforge::conv

// The softmax CUDA launchers the entry points (softmax_ops.cpp) call, one
// set per dtype. Each is an explicit specialization defined in one .cu file
// (rows: softmax_{fwd,bwd}_<dtype>.cu; columns: softmax_columns.cu), so the
// kernels of each dtype compile in a translation unit of their own.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "plan.h"
#include "softmax.h"

namespace opforge::softmax::gpu {

// The rows of the inner-most dim (a.inner == 1); req: a requested plan (the
// `_plan` ops) or nullptr for the default. x / out: the contiguous input
// (forward) or y (backward), whose options the split's workspace takes.
template <typename T>
void forward_rows(Mode mode, const FwdArgs& a, const at::Tensor& x, const PlanRequest* req);
template <typename T>
void backward_rows(Mode mode, const BwdArgs& a, const at::Tensor& out, const PlanRequest* req);

// A thread per (outer, inner) column (a.inner > 1). Nothing for
// ScaledMasked, which reduces the last dim only.
template <typename T>
void forward_columns(Mode mode, const FwdArgs& a);
template <typename T>
void backward_columns(Mode mode, const BwdArgs& a);

#define OPFORGE_SOFTMAX_LAUNCHERS(T)                                                                 \
  template <>                                                                                        \
  void forward_rows<T>(Mode mode, const FwdArgs& a, const at::Tensor& x, const PlanRequest* req);    \
  template <>                                                                                        \
  void backward_rows<T>(Mode mode, const BwdArgs& a, const at::Tensor& out, const PlanRequest* req); \
  template <>                                                                                        \
  void forward_columns<T>(Mode mode, const FwdArgs& a);                                              \
  template <>                                                                                        \
  void backward_columns<T>(Mode mode, const BwdArgs& a);
OPFORGE_SOFTMAX_LAUNCHERS(float)
OPFORGE_SOFTMAX_LAUNCHERS(double)
OPFORGE_SOFTMAX_LAUNCHERS(c10::Half)
OPFORGE_SOFTMAX_LAUNCHERS(c10::BFloat16)
#undef OPFORGE_SOFTMAX_LAUNCHERS

}  // namespace opforge::softmax::gpu

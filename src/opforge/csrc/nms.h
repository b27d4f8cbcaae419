// The nms family's one argument contract, shared by the CPU and CUDA kernels,
// nms_padded's shape function and the check op that nms's and batched_nms's
// fake kernels run (csrc/nms.cpp); and the threshold conversion that makes a
// comparison in the IoU's own precision exact. Sizes are read as SymInts and
// numbers formatted with opforge::num (this header is compiled by nvcc too).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include <opforge/checks.h>

namespace opforge::nms {

// Checks every argument of nms / batched_nms / nms_padded but iou_threshold,
// which may be any float, as in torchvision. `idxs` is checked when given.
// Shapes and devices that do not fit raise RuntimeError (as torchvision's
// nms does), dtypes TypeError, unsupported option values ValueError.
inline void check_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                       const std::optional<at::Tensor>& idxs, std::optional<double> score_threshold,
                       std::optional<int64_t> max_output) {
  check_float_tensor(boxes, op, "boxes");
  check_float_tensor(scores, op, "scores");
  TORCH_CHECK(boxes.dim() == 2 && boxes.sym_size(1) == 4, op, ": boxes must have shape (N, 4), got ",
              shape(boxes.sym_sizes()));
  TORCH_CHECK(scores.dim() == 1, op, ": scores must have shape (N,), got ", shape(scores.sym_sizes()));
  // expect_true: lengths that come from data (unbacked sizes) become a
  // run-time assertion under torch.compile instead of a trace-time error.
  const c10::SymInt& n = boxes.sym_size(0);
  TORCH_SYM_CHECK(scores.sym_size(0).sym_eq(n), op, ": boxes and scores must have the same length, got boxes with ",
                  num(n), " and scores with ", num(scores.sym_size(0)));
  check_same_device(boxes, "boxes", scores, "scores", op);
  if (idxs.has_value()) {
    const at::Tensor& t = *idxs;
    TORCH_CHECK_TYPE(t.defined(), op, ": idxs must be a tensor, got an undefined tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == c10::kLong || t.scalar_type() == c10::kInt, op,
                     ": idxs must be an int64 or int32 tensor, got ", dtype_name(t.scalar_type()));
    TORCH_CHECK(t.dim() == 1, op, ": idxs must have shape (N,), got ", shape(t.sym_sizes()));
    TORCH_SYM_CHECK(t.sym_size(0).sym_eq(n), op, ": boxes and idxs must have the same length, got boxes with ", num(n),
                    " and idxs with ", num(t.sym_size(0)));
    check_same_device(boxes, "boxes", t, "idxs", op);
  }
  TORCH_CHECK_VALUE(!(score_threshold.has_value() && std::isnan(*score_threshold)), op,
                    ": score_threshold must not be NaN");
  TORCH_CHECK_VALUE(!(max_output.has_value() && *max_output < 0), op, ": max_output must be >= 0, got ",
                    num(max_output.value_or(0)));
}

// nms_padded's output has max_output entries: at most this many (the int32
// range), a length that can be allocated and indexed by every kernel.
inline constexpr int64_t kMaxPaddedOutput = (int64_t{1} << 31) - 1;

// check_args, then nms_padded's bound on max_output.
inline void check_padded_args(const at::Tensor& boxes, const at::Tensor& scores, const std::optional<at::Tensor>& idxs,
                              std::optional<double> score_threshold, int64_t max_output) {
  constexpr const char* op = "opforge.nms_padded";
  check_args(op, boxes, scores, idxs, score_threshold, max_output);
  TORCH_CHECK_VALUE(max_output <= kMaxPaddedOutput, op, ": max_output must be at most ", num(kMaxPaddedOutput),
                    " (the length of the padded output), got ", num(max_output));
}

// The largest T not above t (NaN for NaN). For a T value v,
// `v > threshold_for<T>(t)` equals the exact comparison `double(v) > t`
// (what torchvision's CPU kernel does), so comparing in T loses nothing.
// Thresholds beyond float's range are clamped here: a plain conversion of
// those is undefined behaviour.
template <typename T>
inline T threshold_for(double t) {
  if constexpr (std::is_same_v<T, double>) {
    return t;
  } else {
    constexpr float kMax = std::numeric_limits<float>::max();
    constexpr float kInf = std::numeric_limits<float>::infinity();
    if (std::isnan(t)) return std::numeric_limits<float>::quiet_NaN();
    if (t >= static_cast<double>(kMax)) return t == static_cast<double>(kInf) ? kInf : kMax;
    if (t < -static_cast<double>(kMax)) return -kInf;
    float f = static_cast<float>(t);
    if (static_cast<double>(f) > t) f = std::nextafter(f, -kInf);
    return f;
  }
}

}  // namespace opforge::nms

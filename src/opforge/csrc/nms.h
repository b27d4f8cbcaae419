// Shared pieces of the NMS family (cpu/nms_cpu.cpp, cuda/nms.cu): argument
// checks with the same words as ops/nms.py, and the threshold conversion that
// makes a comparison in the IoU's own precision exact.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include <opforge/checks.h>

namespace opforge::nms {

// Checks every argument of nms / batched_nms / nms_padded. `idxs` is checked
// only when given. The messages match ops/nms.py.
inline void check_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                       const std::optional<at::Tensor>& idxs, double iou_threshold,
                       std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  check_float_tensor(boxes, op, "boxes");
  check_float_tensor(scores, op, "scores");
  TORCH_CHECK_VALUE(boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must have shape (N, 4), got ", boxes.sizes());
  TORCH_CHECK_VALUE(scores.dim() == 1, op, ": scores must have shape (N,), got ", scores.sizes());
  TORCH_CHECK_VALUE(scores.size(0) == boxes.size(0), op,
                    ": boxes and scores must have the same length, got boxes with ", boxes.size(0), " and scores with ",
                    scores.size(0));
  check_same_device(boxes, "boxes", scores, "scores", op);
  if (idxs.has_value()) {
    const auto& t = *idxs;
    TORCH_CHECK_TYPE(t.defined(), op, ": idxs must be a tensor, got an undefined tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == c10::kLong || t.scalar_type() == c10::kInt, op,
                     ": idxs must be an int64 or int32 tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": idxs must have shape (N,), got ", t.sizes());
    TORCH_CHECK_VALUE(t.size(0) == boxes.size(0), op, ": boxes and idxs must have the same length, got boxes with ",
                      boxes.size(0), " and idxs with ", t.size(0));
    check_same_device(boxes, "boxes", t, "idxs", op);
  }
  TORCH_CHECK_VALUE(iou_threshold >= 0.0 && iou_threshold <= 1.0, op, ": iou_threshold must be in [0, 1], got ",
                    iou_threshold);
  if (score_threshold.has_value()) {
    TORCH_CHECK_VALUE(!std::isnan(*score_threshold), op, ": score_threshold must not be NaN");
  }
  if (max_output.has_value()) {
    TORCH_CHECK_VALUE(*max_output >= 0, op, ": max_output must be >= 0, got ", *max_output);
  }
}

// nms_padded's output has max_output entries: at most this many (the int32
// range), a length that can be allocated and indexed by every kernel.
inline constexpr int64_t kMaxPaddedOutput = (int64_t{1} << 31) - 1;

// check_args, then nms_padded's bound on max_output.
inline void check_padded_args(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                              const std::optional<at::Tensor>& idxs, double iou_threshold,
                              std::optional<double> score_threshold, int64_t max_output) {
  check_args(op, boxes, scores, idxs, iou_threshold, score_threshold, max_output);
  TORCH_CHECK_VALUE(max_output <= kMaxPaddedOutput, op, ": max_output must be at most ", kMaxPaddedOutput,
                    " (the length of the padded output), got ", max_output);
}

// The largest T not above t. For a T value v, `v > threshold_for<T>(t)`
// equals the exact comparison `double(v) > t` (what torchvision's CPU kernel
// does), so comparing in T loses nothing.
template <typename T>
inline T threshold_for(double t) {
  if constexpr (std::is_same_v<T, double>) {
    return t;
  } else {
    float f = static_cast<float>(t);
    if (static_cast<double>(f) > t) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
    return f;
  }
}

}  // namespace opforge::nms

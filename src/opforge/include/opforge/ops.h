// opforge's ops for C++ callers: each function calls the registered op
// through torch's dispatcher, so the device's kernel, autograd and every
// check run exactly as from Python (`torch.ops.opforge.<op>`).
//
// The kernels must be loaded first: link the program against opforge's
// library (`opforge/_C.abi3.so`, which needs libtorch and no Python) or
// dlopen it. A call before that throws c10::Error naming the missing op.
//
//   #include <opforge/ops.h>
//   at::Tensor y = opforge::add_relu(x, bias);   // relu(x + bias), one kernel
//   y.sum().backward();                          // gradients through opforge's backward ops
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>

namespace opforge {

namespace detail {

// The typed handle of a registered op; looked up once per call site.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name, const char* overload = "") {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload).typed<Signature>();
}

}  // namespace detail

#define OPFORGE_OP_HANDLE(name, overload, ...)                                    \
  static const auto handle = detail::op<__VA_ARGS__>("opforge::" name, overload); \
  return handle

// ---------------------------------------------------------------- add family

// a + b with broadcasting (torch.add without alpha).
inline at::Tensor add(const at::Tensor& a, const at::Tensor& b) {
  OPFORGE_OP_HANDLE("add", "", at::Tensor(const at::Tensor&, const at::Tensor&)).call(a, b);
}

// relu(a + b) in one pass.
inline at::Tensor add_relu(const at::Tensor& a, const at::Tensor& b) {
  OPFORGE_OP_HANDLE("add_relu", "", at::Tensor(const at::Tensor&, const at::Tensor&)).call(a, b);
}

// grad where result > 0 (or NaN), else 0: add_relu's backward.
inline at::Tensor _add_relu_backward(const at::Tensor& grad, const at::Tensor& result) {
  OPFORGE_OP_HANDLE("_add_relu_backward", "", at::Tensor(const at::Tensor&, const at::Tensor&)).call(grad, result);
}

// ------------------------------------------------------------ softmax family

// torch.softmax(x, dim, dtype).
inline at::Tensor softmax(const at::Tensor& x, int64_t dim = -1, std::optional<at::ScalarType> dtype = std::nullopt) {
  OPFORGE_OP_HANDLE("softmax", "", at::Tensor(const at::Tensor&, int64_t, std::optional<at::ScalarType>))
      .call(x, dim, dtype);
}

// torch.log_softmax(x, dim, dtype).
inline at::Tensor log_softmax(const at::Tensor& x, int64_t dim = -1,
                              std::optional<at::ScalarType> dtype = std::nullopt) {
  OPFORGE_OP_HANDLE("log_softmax", "", at::Tensor(const at::Tensor&, int64_t, std::optional<at::ScalarType>))
      .call(x, dim, dtype);
}

// softmax(x * scale + mask, -1); mask bool (True = masked out) or additive.
inline at::Tensor scaled_masked_softmax(const at::Tensor& x, const std::optional<at::Tensor>& mask = std::nullopt,
                                        double scale = 1.0, bool causal = false) {
  OPFORGE_OP_HANDLE("scaled_masked_softmax", "",
                    at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, double, bool))
      .call(x, mask, scale, causal);
}

inline at::Tensor _softmax_backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  OPFORGE_OP_HANDLE("_softmax_backward", "", at::Tensor(const at::Tensor&, const at::Tensor&, int64_t))
      .call(grad, output, dim);
}

inline at::Tensor _log_softmax_backward(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  OPFORGE_OP_HANDLE("_log_softmax_backward", "", at::Tensor(const at::Tensor&, const at::Tensor&, int64_t))
      .call(grad, output, dim);
}

inline at::Tensor _scaled_masked_softmax_backward(const at::Tensor& grad, const at::Tensor& output, double scale) {
  OPFORGE_OP_HANDLE("_scaled_masked_softmax_backward", "", at::Tensor(const at::Tensor&, const at::Tensor&, double))
      .call(grad, output, scale);
}

// --------------------------------------------------------------- conv family

// F.conv2d(x, weight, bias, stride, padding, groups=groups), then ReLU when
// activation is "relu"; x is (N, C, H, W) or unbatched (C, H, W).
inline at::Tensor conv2d_3x3(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias = std::nullopt, at::IntArrayRef stride = 1,
                             at::IntArrayRef padding = 0, int64_t groups = 1,
                             std::optional<std::string_view> activation = std::nullopt) {
  OPFORGE_OP_HANDLE("conv2d_3x3", "",
                    at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
                               at::IntArrayRef, int64_t, std::optional<std::string_view>))
      .call(x, weight, bias, stride, padding, groups, activation);
}

// The same with padding "same" or "valid" (1 or 0 for a 3x3 kernel at stride 1).
inline at::Tensor conv2d_3x3(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             at::IntArrayRef stride, std::string_view padding, int64_t groups = 1,
                             std::optional<std::string_view> activation = std::nullopt) {
  OPFORGE_OP_HANDLE("conv2d_3x3", "padding",
                    at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
                               std::string_view, int64_t, std::optional<std::string_view>))
      .call(x, weight, bias, stride, padding, groups, activation);
}

// Gradients (x, weight, bias) of conv2d_3x3. With an activation fused,
// `result` is what its derivative reads (the output for relu and relu6, the
// pre-activation for hardswish and silu) and `activation` names it; no
// result, no activation. Entries of output_mask that are false come back empty.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> _conv2d_3x3_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& result, const at::Tensor& x, const at::Tensor& weight,
    int64_t stride, int64_t padding, int64_t groups, std::array<bool, 3> output_mask,
    std::string_view activation = "relu") {
  OPFORGE_OP_HANDLE("_conv2d_3x3_backward", "",
                    std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                        const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                        int64_t, int64_t, int64_t, std::array<bool, 3>, std::string_view))
      .call(grad_out, result, x, weight, stride, padding, groups, output_mask, activation);
}

// act(conv1x1(x, weight) + bias), fused: F.conv2d with a (K, C, 1, 1) weight,
// groups 1, no padding, then the activation (None, "relu", "relu6",
// "hardswish", "silu").
inline at::Tensor conv2d_1x1(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias = std::nullopt, at::IntArrayRef stride = 1,
                             std::optional<std::string_view> activation = std::nullopt) {
  OPFORGE_OP_HANDLE("conv2d_1x1", "",
                    at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::IntArrayRef,
                               std::optional<std::string_view>))
      .call(x, weight, bias, stride, activation);
}

// ---------------------------------------------------------------- nms family

// Indices (int64) of the boxes kept, in decreasing score order (torchvision.ops.nms).
inline at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                      std::optional<double> score_threshold = std::nullopt,
                      std::optional<int64_t> max_output = std::nullopt) {
  OPFORGE_OP_HANDLE(
      "nms", "",
      at::Tensor(const at::Tensor&, const at::Tensor&, double, std::optional<double>, std::optional<int64_t>))
      .call(boxes, scores, iou_threshold, score_threshold, max_output);
}

// Per-category NMS (torchvision.ops.batched_nms).
inline at::Tensor batched_nms(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                              double iou_threshold, std::optional<double> score_threshold = std::nullopt,
                              std::optional<int64_t> max_output = std::nullopt) {
  OPFORGE_OP_HANDLE("batched_nms", "",
                    at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, std::optional<double>,
                               std::optional<int64_t>))
      .call(boxes, scores, idxs, iou_threshold, score_threshold, max_output);
}

// (indices padded with -1 to max_output, count): a data-independent shape.
inline std::tuple<at::Tensor, at::Tensor> nms_padded(const at::Tensor& boxes, const at::Tensor& scores,
                                                     double iou_threshold, int64_t max_output,
                                                     const std::optional<at::Tensor>& idxs = std::nullopt,
                                                     std::optional<double> score_threshold = std::nullopt) {
  OPFORGE_OP_HANDLE("nms_padded", "",
                    std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, int64_t,
                                                       const std::optional<at::Tensor>&, std::optional<double>))
      .call(boxes, scores, iou_threshold, max_output, idxs, score_threshold);
}

#undef OPFORGE_OP_HANDLE

}  // namespace opforge

// The conv family's device-neutral part, shared by its CPU and CUDA entries
// and its shape functions: the one argument contract (checks), the output
// geometry, operand layouts, and the ATen backward both backends fall back
// to (conv.cpp). Sizes are read as SymInts so that the shape functions run
// the same checks under torch.compile's dynamic shapes. .cu files include
// this header: messages stream strings only (opforge/checks.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include <opforge/checks.h>

#include "activation.h"

namespace opforge::conv {

inline constexpr const char* kOp = "opforge.conv2d_3x3";
inline constexpr const char* kBwdOp = "opforge._conv2d_3x3_backward";

// The kernels' geometry (concrete sizes; x as (N, C, H, W), N = 1 for an
// unbatched x).
struct Geometry {
  int64_t N, C, H, W, K, Ho, Wo, stride, pad, groups, mult;
  bool depthwise;
};

// What the checks establish; sizes may be symbolic (shape functions).
struct Shape {
  c10::SymInt N, C, H, W, K, Ho, Wo;
  int64_t stride, pad, groups;
  bool unbatched;  // x is (C, H, W), F.conv2d's unbatched input: output (K, Ho, Wo)
  bool depthwise;  // groups == C > 1 (groups 1 with C 1 is the dense path)
};

// stride / padding as int[2] gives them: one int, or a pair that must be
// equal (one value for H and W is all the kernels take).
inline int64_t check_pair(const char* op, const char* name, c10::IntArrayRef v) {
  TORCH_CHECK_VALUE(v.size() == 1 || (v.size() == 2 && v[0] == v[1]), op, ": ", name,
                    " must be an int or a pair of equal ints (the same value for H and W), got ", shape(v));
  return v[0];
}

// padding "same" / "valid" as F.conv2d takes it: for a 3x3 kernel 1 and 0.
// Like F.conv2d, "same" is refused for a strided convolution.
inline int64_t padding_from_string(const char* op, std::string_view padding, int64_t stride) {
  if (padding == "valid") return 0;
  TORCH_CHECK_VALUE(padding == "same", op, ": padding must be 'same', 'valid', 0 or 1, got '", std::string(padding),
                    "'");
  TORCH_CHECK_VALUE(stride == 1, op,
                    ": padding='same' is not supported for strided convolutions (as in F.conv2d), got stride ",
                    num(stride));
  return 1;
}

// A bias, when given: (K,) of x's dtype, on x's device.
inline void check_bias(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                       const c10::SymInt& K) {
  if (!bias.has_value() || !bias->defined()) return;
  check_float_tensor(*bias, op, "bias");
  check_same_device(x, "x", *bias, "bias", op);
  TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ",
                   dtype_name(x.scalar_type()), ", got ", dtype_name(bias->scalar_type()));
  TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == K, op, ": bias must have shape [", num(K), "], got ",
              shape(bias->sym_sizes()));
}

// What every op of the family checks first: float x (N, C, H, W) or (C, H, W)
// and a 4-d weight with an RxR kernel (`weight_shape` names the expected
// shape), of x's dtype and device. Returns the Shape with Ho and Wo still 0.
inline Shape check_x_and_weight(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t R,
                                const char* weight_shape, int64_t stride, int64_t padding, int64_t groups) {
  check_float_tensor(x, op, "x");
  check_float_tensor(w, op, "weight");
  TORCH_CHECK(x.dim() == 3 || x.dim() == 4, op, ": x must be a 3-d (C, H, W) or 4-d (N, C, H, W) tensor, got ",
              num(x.dim()), "-d with shape ", shape(x.sym_sizes()));
  check_dim(w, 4, op, "weight");
  const auto ws = w.sym_sizes();
  TORCH_CHECK_VALUE(ws[2] == R && ws[3] == R, op, ": weight must have a ", num(R), "x", num(R), " kernel (shape ",
                    weight_shape, "), got shape ", shape(ws));
  check_same_device(x, "x", w, "weight", op);
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type(), op, ": x and weight must have the same dtype, got x ",
                   dtype_name(x.scalar_type()), " and weight ", dtype_name(w.scalar_type()));
  const bool unbatched = x.dim() == 3;
  const auto xs = x.sym_sizes();
  const int64_t d = unbatched ? 1 : 0;  // x's dims are (N,) C, H, W
  return Shape{unbatched ? c10::SymInt(1) : xs[0],
               xs[1 - d],
               xs[2 - d],
               xs[3 - d],
               ws[0],
               c10::SymInt(0),
               c10::SymInt(0),
               stride,
               padding,
               groups,
               unbatched,
               groups > 1};
}

// The family's one argument contract (forward and backward): float x and
// weight of one dtype and device, x (N, C, H, W) or (C, H, W), weight
// (K, C / groups, 3, 3) with groups 1 or C, stride 1 or 2, padding 0 or 1,
// a bias (K,) of x's dtype, an input at least as large as the kernel.
// Exception types as F.conv2d's for what it refuses too (RuntimeError for
// shapes that do not fit), ValueError for what opforge does not support.
inline Shape check_conv_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                             const std::optional<at::Tensor>& bias, int64_t stride, int64_t padding, int64_t groups) {
  Shape s = check_x_and_weight(op, x, w, 3, "(K, C/groups, 3, 3)", stride, padding, groups);
  TORCH_CHECK_VALUE(stride == 1 || stride == 2, op, ": stride must be 1 or 2, got ", num(stride));
  TORCH_CHECK_VALUE(padding == 0 || padding == 1, op, ": padding must be 0 or 1, got ", num(padding));
  const auto ws = w.sym_sizes();
  TORCH_CHECK_VALUE(groups == 1 || (groups > 0 && s.C == groups), op,
                    ": groups must be 1 or the number of input channels (", num(s.C), "), got ", num(groups));
  TORCH_CHECK(ws[1] * groups == s.C, op, ": weight must have C/groups = ", num(s.C / groups),
              " input channels (dim 1) for x with ", num(s.C), " channels and groups=", num(groups),
              ", got weight shape ", shape(ws));
  TORCH_CHECK(s.K >= 1 && s.K % groups == 0, op, ": weight's output channels (", num(s.K),
              ") must be a positive multiple of groups (", num(groups), ")");
  check_bias(op, x, bias, s.K);
  TORCH_CHECK(s.H + 2 * padding >= 3 && s.W + 2 * padding >= 3, op, ": x's spatial size (", num(s.H), ", ", num(s.W),
              ") with padding ", num(padding), " is smaller than the 3x3 kernel");
  s.Ho = (s.H + 2 * padding - 3) / stride + 1;
  s.Wo = (s.W + 2 * padding - 3) / stride + 1;
  return s;
}

// The forward's contract with the schema's own types (int[2] pairs, the
// activation's name, returned in act).
inline Shape check_forward_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                                const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                c10::IntArrayRef padding, int64_t groups, std::optional<std::string_view> activation,
                                Activation& act) {
  const int64_t s = check_pair(op, "stride", stride), p = check_pair(op, "padding", padding);
  act = parse_activation(op, activation);
  return check_conv_args(op, x, w, bias, s, p, groups);
}

// Channels of the output: K, but none for an x without channels, as
// F.conv2d's empty-input rule gives ((N, 0, Ho, Wo), whatever the bias).
inline c10::SymInt out_channels(const Shape& s) { return s.C == 0 ? c10::SymInt(0) : s.K; }
inline int64_t out_channels(const Geometry& g) { return g.C == 0 ? 0 : g.K; }

// The output's shape: (N, K_out, Ho, Wo), or (K_out, Ho, Wo) for an unbatched x.
inline std::vector<c10::SymInt> out_sizes(const Shape& s) {
  if (s.unbatched) return {out_channels(s), s.Ho, s.Wo};
  return {s.N, out_channels(s), s.Ho, s.Wo};
}

inline void check_backward_args(const char* op, const at::Tensor& grad_out, const std::optional<at::Tensor>& result,
                                const at::Tensor& x, const Shape& s) {
  check_float_tensor(grad_out, op, "grad_out");
  check_same_device(x, "x", grad_out, "grad_out", op);
  TORCH_CHECK_TYPE(grad_out.scalar_type() == x.scalar_type(), op, ": grad_out must have x's dtype ",
                   dtype_name(x.scalar_type()), ", got ", dtype_name(grad_out.scalar_type()));
  const std::vector<c10::SymInt> expect = out_sizes(s);
  TORCH_CHECK(grad_out.sym_sizes().equals(expect), op, ": grad_out must have shape ",
              shape(c10::SymIntArrayRef(expect)), ", got ", shape(grad_out.sym_sizes()));
  if (result.has_value() && result->defined()) {
    check_float_tensor(*result, op, "result");
    check_same_device(x, "x", *result, "result", op);
    TORCH_CHECK(result->sym_sizes().equals(grad_out.sym_sizes()), op, ": result must have grad_out's shape ",
                shape(grad_out.sym_sizes()), ", got ", shape(result->sym_sizes()));
    TORCH_CHECK_TYPE(result->scalar_type() == x.scalar_type(), op, ": result must have x's dtype ",
                     dtype_name(x.scalar_type()), ", got ", dtype_name(result->scalar_type()));
  }
}

// The kernels' geometry from checked (concrete) sizes.
inline Geometry geometry(const Shape& s) {
  Geometry g{};
  g.N = s.N.expect_int();
  g.C = s.C.expect_int();
  g.H = s.H.expect_int();
  g.W = s.W.expect_int();
  g.K = s.K.expect_int();
  g.Ho = s.Ho.expect_int();
  g.Wo = s.Wo.expect_int();
  g.stride = s.stride;
  g.pad = s.pad;
  g.groups = s.groups;
  g.mult = g.K / s.groups;
  g.depthwise = s.depthwise;
  return g;
}

// The output follows x's memory format (channels_last stays channels_last;
// an unbatched x, 3-d, is contiguous as in F.conv2d).
inline at::MemoryFormat out_format(const at::Tensor& x) {
  return x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? at::MemoryFormat::ChannelsLast
                                                                     : at::MemoryFormat::Contiguous;
}

// A weight gradient's format: channels_last where the weight is channels_last and
// not contiguous too (a depthwise (C, 1, 3, 3) weight is both, and stays contiguous),
// as F.conv2d's is, so that autograd accumulates it without a copy into the
// parameter's strides.
inline at::MemoryFormat weight_grad_format(const at::Tensor& w) {
  return w.dim() == 4 && !w.is_contiguous() && w.is_contiguous(at::MemoryFormat::ChannelsLast)
             ? at::MemoryFormat::ChannelsLast
             : at::MemoryFormat::Contiguous;
}

// An unbatched tensor as a batch of one (a view), so the kernels see 4-d.
inline at::Tensor batched(const at::Tensor& t, bool unbatched) { return unbatched && t.defined() ? t.unsqueeze(0) : t; }
inline std::optional<at::Tensor> batched(const std::optional<at::Tensor>& t, bool unbatched) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return batched(*t, unbatched);
}
inline at::Tensor unbatch(const at::Tensor& t, bool unbatched) { return unbatched && t.dim() == 4 ? t.squeeze(0) : t; }

// The forward's operands as every backend's kernels read them: x (4-d) in
// the output's memory format, weight contiguous, bias contiguous (undefined
// when absent). With keep_channels_last_weight a channels_last weight stays
// so when x is channels_last too, for an engine that takes either format
// (oneDNN: a plain copy of it per call, then its own reorder, cost more than
// the convolution on large layers); such a caller makes it contiguous itself
// where it needs to. With an NCHW x the weight is made contiguous as before:
// oneDNN would otherwise run channels_last and copy x and the output.
struct ForwardOperands {
  at::MemoryFormat fmt;
  bool nhwc;
  at::Tensor x, w, bias;
};

inline ForwardOperands forward_operands(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                        bool unbatched, bool keep_channels_last_weight = false) {
  const auto fmt = out_format(x);
  const bool keep = keep_channels_last_weight && fmt == at::MemoryFormat::ChannelsLast &&
                    w.is_contiguous(at::MemoryFormat::ChannelsLast);
  return {fmt, fmt == at::MemoryFormat::ChannelsLast, batched(x, unbatched).contiguous(fmt), keep ? w : w.contiguous(),
          (bias.has_value() && bias->defined()) ? bias->contiguous() : at::Tensor()};
}

inline at::Tensor empty_output(const Geometry& g, const ForwardOperands& o) {
  return at::empty({g.N, out_channels(g), g.Ho, g.Wo}, o.x.options().memory_format(o.fmt));
}

// The direct backward kernels' operands (4-d): x, grad_out and the fused
// ReLU's result (undefined without one) in the output's memory format,
// weight contiguous.
struct BackwardOperands {
  at::MemoryFormat fmt;
  bool nhwc;
  at::Tensor x, w, grad_out, result;
};

inline BackwardOperands backward_operands(const at::Tensor& grad_out, const std::optional<at::Tensor>& result,
                                          const at::Tensor& x, const at::Tensor& w, bool unbatched) {
  const auto fmt = out_format(x);
  return {fmt,
          fmt == at::MemoryFormat::ChannelsLast,
          batched(x, unbatched).contiguous(fmt),
          w.contiguous(),
          batched(grad_out, unbatched).contiguous(fmt),
          (result.has_value() && result->defined()) ? batched(*result, unbatched).contiguous(fmt) : at::Tensor()};
}

// grad_out * (result > 0) as torch's ReLU backward computes it
// (threshold_backward: a NaN result passes the gradient), any device.
at::Tensor relu_masked_grad(const at::Tensor& grad_out, const at::Tensor& result);
// act(t) in place, as torch's own functions compute it (any device): for
// the paths whose convolution engine cannot fuse the activation.
void activation_inplace(at::Tensor& t, Activation act);
// The backward op's gradient and ReLU mask as the kernels take them. The
// backward kernels apply a ReLU mask (result > 0) themselves as they read
// grad_out; any other activation's derivative is applied here first, read
// from `result` (the output for relu6, the pre-activation for hardswish and
// silu), and no mask is left. Without a result there is no activation.
std::pair<at::Tensor, std::optional<at::Tensor>> grad_through_activation(const at::Tensor& grad_out,
                                                                         const std::optional<at::Tensor>& result,
                                                                         std::string_view activation);
// The backward through ATen's convolution_backward on the (masked) gradient,
// all operands 4-d (sizes may be symbolic): every CPU case but the direct
// depthwise one, the dense CUDA case (cuDNN), and conv2d_1x1's autograd.
// Masked-out entries are (0,) tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_via_aten(const at::Tensor& grad_out,
                                                                 const std::optional<at::Tensor>& result,
                                                                 const at::Tensor& x, const at::Tensor& w,
                                                                 int64_t stride, int64_t pad, int64_t groups,
                                                                 std::array<bool, 3> mask);

}  // namespace opforge::conv

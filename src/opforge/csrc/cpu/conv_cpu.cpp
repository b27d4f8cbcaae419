// CPU entry points of the conv family.
//
// Depthwise (groups == C): direct loops (cpu/conv_dw_{nchw,nhwc}_kernels.h), vectorised
// along W (NCHW) or along the channels (NHWC), parallel over planes / rows;
// NCHW layers of small output planes over many planes (onednn_depthwise_pays) go
// to oneDNN in float32, and in bfloat16 to the NHWC loops on transposed copies.
// Dense (groups == 1): cpu/conv_dense_cpu.cpp (oneDNN, or im2col + GEMM).
// Non-contiguous inputs take one .contiguous() in their suggested memory format.
// An unbatched (C, H, W) x runs as a batch of one.
//
// Backward: depthwise with multiplier 1, direct loops that apply the ReLU
// mask (result > 0) as they read grad_out: grad x is the depthwise forward
// loop run on it with the kernel flipped (stride 1) or
// cpu/conv_dw_dgrad_kernels.h (stride 2), the weight / bias sums
// cpu/conv_dw_grad_kernels.h. Dense at stride 1 in NCHW below
// oneDNN's size: GEMMs on the padded image's columns (cpu/conv_dense_cpu.cpp).
// Otherwise conv.cpp's backward_via_aten: the ReLU mask, then ATen's
// convolution_backward for grad x / weight / bias (oneDNN on the CPU).
#include <ATen/Functions.h>
#include <torch/library.h>

#include <opforge/cpu_isa.h>
#include <opforge/dispatch.h>

#include "conv.h"
#include "cpu/conv_dense_cpu.h"
#include "cpu/conv_params.h"
#include "cpu/plane_transpose.h"

OPFORGE_CPU_DECLARE(void, conv_dw_nchw, c10::ScalarType, const opforge::conv::DwParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_nhwc, c10::ScalarType, const opforge::conv::DwParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_wgrad_nchw, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_wgrad_nhwc, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_dgrad_nchw_s2, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_dgrad_nhwc_s2, c10::ScalarType, const opforge::conv::DwBackwardParams&)

namespace {

using opforge::conv::Geometry;

using opforge::conv::kBwdOp;
using opforge::conv::kOp;
// NCHW depthwise layers whose output rows have at most kOneDnnDwMaxWo columns, over
// at least kOneDnnDwMinPlanes planes: the per-plane loops fill at most that many lanes
// of each row vector, while oneDNN (after reordering to its channel-blocked layout)
// fills every lane, which outweighs its fixed cost per call from that many planes
// (float32 and bfloat16; tools/depthwise_sweep.py --device cpu, docs/ops/conv.md).
constexpr int64_t kOneDnnDwMaxWo = 14;
constexpr int64_t kOneDnnDwMinPlanes = 1536;
// NCHW depthwise backward with output rows this narrow runs the NHWC loops (depthwise_backward_direct).
constexpr int64_t kNhwcBackwardMaxWo = 7;

bool onednn_depthwise_pays(const Geometry& g, bool nhwc, at::ScalarType dtype, int64_t max_wo) {
  const bool dtype_ok = dtype == at::kFloat || dtype == at::kBFloat16;
  return g.depthwise && !nhwc && g.mult == 1 && dtype_ok && g.Wo <= max_wo && g.N * g.C >= kOneDnnDwMinPlanes;
}

at::Tensor forward(const opforge::conv::ForwardOperands& o, const Geometry& g, opforge::Activation act) {
  if (g.N * opforge::conv::out_channels(g) * g.Ho * g.Wo == 0) return opforge::conv::empty_output_cpu(g, o);
  if (!g.depthwise) return opforge::conv::dense_forward_cpu(o, g, act);
  const bool onednn = onednn_depthwise_pays(g, o.nhwc, o.x.scalar_type(), kOneDnnDwMaxWo);
  if (onednn && o.x.scalar_type() == at::kBFloat16) {
    // The NHWC loops on a channels_last copy of x, the output transposed back: they fill every
    // lane along the channels, where these planes' rows fill at most 14 (oneDNN's bfloat16
    // depthwise, which reorders too, measured 1.0-2.6x slower than this, its float32 up to
    // 1.5x faster).
    opforge::conv::ForwardOperands cl = o;
    cl.fmt = at::MemoryFormat::ChannelsLast;
    cl.nhwc = true;
    cl.x = opforge::conv::plane_transpose_copy(o.x, cl.fmt);
    return opforge::conv::plane_transpose_copy(forward(cl, g, act), at::MemoryFormat::Contiguous);
  }
  if (onednn && at::hasMKLDNN()) {
    // ATen's convolution, as F.conv2d calls it (its oneDNN depthwise path, the bias fused).
    const std::optional<at::Tensor> bias = o.bias.defined() ? std::optional<at::Tensor>(o.bias) : std::nullopt;
    at::Tensor out =
        at::convolution(o.x, o.w, bias, {g.stride, g.stride}, {g.pad, g.pad}, {1, 1}, false, {0, 0}, g.groups);
    opforge::conv::activation_inplace(out, act);
    return out.contiguous();
  }
  at::Tensor out = opforge::conv::empty_output_cpu(g, o);
  opforge::conv::DwParams p{g.N,
                            g.C,
                            g.H,
                            g.W,
                            g.K,
                            g.Ho,
                            g.Wo,
                            g.stride,
                            g.pad,
                            g.mult,
                            act,
                            o.x.const_data_ptr(),
                            o.w.const_data_ptr(),
                            o.bias.defined() ? o.bias.const_data_ptr() : nullptr,
                            out.data_ptr()};
  if (o.nhwc) {
    OPFORGE_CPU_SELECT(conv_dw_nhwc)(o.x.scalar_type(), p);
  } else {
    OPFORGE_CPU_SELECT(conv_dw_nchw)(o.x.scalar_type(), p);
  }
  return out;
}

at::Tensor conv2d_3x3_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                          c10::IntArrayRef stride, c10::IntArrayRef padding, int64_t groups,
                          std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_forward_args(kOp, x, w, bias, stride, padding, groups, activation, act);
  const Geometry g = opforge::conv::geometry(s);
  // A dense layer's channels_last weight goes to oneDNN as it is with a channels_last x (dense_forward_cpu).
  const auto o = opforge::conv::forward_operands(x, w, bias, s.unbatched, !g.depthwise);
  return opforge::conv::unbatch(forward(o, g, act), s.unbatched);
}

// Depthwise, multiplier 1 (see direct_depthwise_backward): grad x is, for stride
// 1, the forward's loop run on grad_out (masked by the ReLU's result as it is
// staged) with the kernel flipped and padding 2 - padding (its output has x's
// shape), for stride 2 conv_dw_dgrad_*_s2; the weight and bias sums come from
// conv_dw_wgrad_* (masking as they read).
// No masked copy of grad_out is written. All in opmath, rounded once.
// (Through ATen, oneDNN's CPU depthwise backward ran at a quarter of the
// forward's bandwidth at stride 1, and its stride-2 NCHW grad x took 11x
// the forward.)
// float32 NCHW layers of 7-column outputs over many planes stay with oneDNN
// (the forward's rule; there oneDNN's backward beat these loops, the NHWC
// ones on transposed copies included, by up to 2x at batch 64).
bool direct_depthwise_backward(const Geometry& g, const at::Tensor& x) {
  const bool nhwc = opforge::conv::out_format(x) == at::MemoryFormat::ChannelsLast;
  const auto dtype = x.scalar_type();
  if (onednn_depthwise_pays(g, nhwc, dtype, 7) && dtype == at::kFloat) return false;
  return g.depthwise && g.mult == 1;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_backward_direct(const at::Tensor& grad_out,
                                                                         const std::optional<at::Tensor>& result,
                                                                         const at::Tensor& x_in, const at::Tensor& w_in,
                                                                         const Geometry& g, bool unbatched,
                                                                         std::array<bool, 3> want) {
  auto o = opforge::conv::backward_operands(grad_out, result, x_in, w_in, unbatched);
  // NCHW planes of at most 7 output columns fill under half of a row vector, while the NHWC
  // loops fill every lane along the channels: they run on channels_last copies of the operands,
  // and grad x comes back in NCHW (the copies cost less than the lanes they fill). Not float32
  // at stride 2, where the NCHW loops measured faster than the copies and the NHWC loops.
  const bool via_nhwc = !o.nhwc && g.Wo <= kNhwcBackwardMaxWo && !(g.stride == 2 && o.x.scalar_type() == at::kFloat);
  if (via_nhwc) {
    constexpr auto cl = at::MemoryFormat::ChannelsLast;
    o.x = opforge::conv::plane_transpose_copy(o.x, cl);
    o.grad_out = opforge::conv::plane_transpose_copy(o.grad_out, cl);
    if (o.result.defined()) o.result = opforge::conv::plane_transpose_copy(o.result, cl);
    o.fmt = cl;
    o.nhwc = true;
  }
  const at::MemoryFormat fmt = o.fmt;
  const bool nhwc = o.nhwc;
  const at::Tensor &x = o.x, &w = o.w, &go = o.grad_out;
  // The ReLU mask is applied by the loops as they read grad_out.
  const void* mask = o.result.defined() ? o.result.const_data_ptr() : nullptr;
  const auto dtype = x.scalar_type();
  auto empty = [&] { return at::empty({0}, x.options()); };
  at::Tensor gx = want[0] ? at::empty(x.sizes(), x.options().memory_format(fmt)) : empty();
  at::Tensor gw = want[1] ? at::empty(w.sizes(), w.options()) : empty();
  at::Tensor gb = want[2] ? at::empty({g.K}, x.options()) : empty();
  const opforge::conv::DwBackwardParams p{g.N,
                                          g.C,
                                          g.H,
                                          g.W,
                                          g.Ho,
                                          g.Wo,
                                          g.pad,
                                          g.stride,
                                          go.const_data_ptr(),
                                          mask,
                                          x.const_data_ptr(),
                                          w.const_data_ptr(),
                                          want[0] ? gx.data_ptr() : nullptr,
                                          want[1] ? gw.data_ptr() : nullptr,
                                          want[2] ? gb.data_ptr() : nullptr};
  if (want[0] && g.stride == 2) {
    (nhwc ? OPFORGE_CPU_SELECT(conv_dw_dgrad_nhwc_s2) : OPFORGE_CPU_SELECT(conv_dw_dgrad_nchw_s2))(dtype, p);
  } else if (want[0]) {
    const at::Tensor wflip = w.flip({2, 3}).contiguous();
    const opforge::conv::DwParams fp{g.N,
                                     g.C,
                                     g.Ho,
                                     g.Wo,
                                     g.C,
                                     g.H,
                                     g.W,
                                     1,
                                     2 - g.pad,
                                     1,
                                     opforge::Activation::None,
                                     go.const_data_ptr(),
                                     wflip.const_data_ptr(),
                                     nullptr,
                                     gx.data_ptr(),
                                     mask};
    (nhwc ? OPFORGE_CPU_SELECT(conv_dw_nhwc) : OPFORGE_CPU_SELECT(conv_dw_nchw))(dtype, fp);
  }
  if (want[1] || want[2]) {
    (nhwc ? OPFORGE_CPU_SELECT(conv_dw_wgrad_nhwc) : OPFORGE_CPU_SELECT(conv_dw_wgrad_nchw))(dtype, p);
  }
  if (via_nhwc && want[0]) gx = opforge::conv::plane_transpose_copy(gx, at::MemoryFormat::Contiguous);
  return {gx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_3x3_backward_cpu(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& result_in, const at::Tensor& x, const at::Tensor& w,
    int64_t stride, int64_t padding, int64_t groups, std::array<bool, 3> mask, std::string_view activation) {
  const auto s = opforge::conv::check_conv_args(kBwdOp, x, w, std::nullopt, stride, padding, groups);
  opforge::conv::check_backward_args(kBwdOp, grad_out_in, result_in, x, s);
  const auto [grad_out, result] = opforge::conv::grad_through_activation(grad_out_in, result_in, activation);
  const Geometry g = opforge::conv::geometry(s);
  at::Tensor gx, gw, gb;
  const bool u = s.unbatched, work = x.numel() > 0 && grad_out.numel() > 0;
  if (direct_depthwise_backward(g, x) && work) {
    std::tie(gx, gw, gb) = depthwise_backward_direct(grad_out, result, x, w, g, u, mask);
  } else {
    // 4-d views; an unbatched x as the contiguous batch of one its gradient is.
    const at::Tensor x4 = u ? x.unsqueeze(0).contiguous() : x;
    const at::Tensor g4 = opforge::conv::batched(grad_out, u);
    const auto r4 = opforge::conv::batched(result, u);
    auto small = work ? opforge::conv::dense_backward_small_cpu(g4, r4, x4, w, g, mask) : std::nullopt;
    std::tie(gx, gw, gb) =
        small.has_value() ? *small : opforge::conv::backward_via_aten(g4, r4, x4, w, g.stride, g.pad, g.groups, mask);
  }
  if (mask[1] && gw.dim() == 4) gw = gw.contiguous(opforge::conv::weight_grad_format(w));
  return {opforge::conv::unbatch(gx, s.unbatched), gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_cpu);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_cpu);
}

// CPU entry points of the conv family.
//
// Depthwise (groups == C): direct loops (cpu/conv_kernels.h), vectorised
// along W (NCHW) or along the channels (NHWC), parallel over planes / rows.
// Dense (groups == 1): per (image, tile of output pixels), in parallel:
// im2col of the tile into a packed buffer, one GEMM (at::mm_out), then the
// bias + ReLU epilogue as the tile's single write to the output.
// Non-contiguous inputs take one .contiguous() in their suggested memory format.
//
// Backward: depthwise with multiplier 1 (but float32 channels_last at
// stride 2), direct loops that apply the ReLU mask (result > 0) as they read
// grad_out: grad x is the depthwise forward loop run on it with the kernel
// flipped (stride 1) or cpu/conv_dw_dgrad_kernels.h (stride 2), the weight /
// bias sums cpu/conv_dw_grad_kernels.h. Otherwise conv.cpp's
// backward_via_aten: the ReLU mask, then ATen's convolution_backward for
// grad x / weight / bias (oneDNN on the CPU).
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>

#include <opforge/cpu_isa.h>
#include <opforge/dispatch.h>

#include "conv.h"
#include "cpu/conv_params.h"

OPFORGE_CPU_DECLARE(void, conv_dw_nchw, c10::ScalarType, const opforge::conv::DwParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_nhwc, c10::ScalarType, const opforge::conv::DwParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_wgrad_nchw, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_wgrad_nhwc, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_dgrad_nchw_s2, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_dw_dgrad_nhwc_s2, c10::ScalarType, const opforge::conv::DwBackwardParams&)
OPFORGE_CPU_DECLARE(void, conv_bias_act, c10::ScalarType, const void*, void*, const void*, int64_t, int64_t, int64_t,
                    bool, bool)

namespace {

using opforge::conv::Geometry;

constexpr const char* kOp = "opforge.conv2d_3x3";
constexpr const char* kBwdOp = "opforge._conv2d_3x3_backward";
// Packed-columns bytes per dense work item (see dense_forward).
constexpr int64_t kTileBytes = 1 << 20;

// Packs output pixels [p0, p0 + np) of one image: cols (9C, np), row (c, kh, kw)
// holding x[c, oh*s - p + kh, ow*s - p + kw] (zeros in the padding).
template <typename scalar_t, typename dst_t>
void im2col_nchw_tile(const scalar_t* x, dst_t* cols, const Geometry& g, int64_t p0, int64_t np) {
  for (int64_t r = 0; r < g.C * 9; ++r) {
    const int64_t c = r / 9, kh = (r % 9) / 3, kw = r % 3;
    const scalar_t* xc = x + c * g.H * g.W;
    for (int64_t p = p0; p < p0 + np;) {
      const int64_t oh = p / g.Wo, ow0 = p % g.Wo;
      const int64_t ow1 = std::min<int64_t>(g.Wo, ow0 + (p0 + np - p));
      dst_t* d = cols + r * np + (p - p0) - ow0;  // d[ow] for ow in [ow0, ow1)
      p += ow1 - ow0;
      const int64_t ih = oh * g.stride - g.pad + kh;
      if (ih < 0 || ih >= g.H) {
        std::fill(d + ow0, d + ow1, dst_t(0));
        continue;
      }
      const scalar_t* xr = xc + ih * g.W;
      if (g.stride == 1) {
        // iw = ow - p + kw is inside the row for ow in [lo, hi).
        const int64_t lo = std::min(ow1, std::max<int64_t>(ow0, g.pad - kw));
        const int64_t hi = std::max(lo, std::min<int64_t>(ow1, g.W + g.pad - kw));
        std::fill(d + ow0, d + lo, dst_t(0));
        const scalar_t* xs = xr - g.pad + kw;
        if constexpr (std::is_same_v<scalar_t, dst_t>) {
          if (hi > lo) std::memcpy(d + lo, xs + lo, (hi - lo) * sizeof(scalar_t));
        } else {
          for (int64_t ow = lo; ow < hi; ++ow) d[ow] = static_cast<dst_t>(xs[ow]);
        }
        std::fill(d + hi, d + ow1, dst_t(0));
      } else {
        for (int64_t ow = ow0; ow < ow1; ++ow) {
          const int64_t iw = ow * g.stride - g.pad + kw;
          d[ow] = (iw >= 0 && iw < g.W) ? static_cast<dst_t>(xr[iw]) : dst_t(0);
        }
      }
    }
  }
}

// Packs output pixels [p0, p0 + np) of one NHWC image: cols (np, 9C), column
// (kh, kw, c) holding x[oh*s - p + kh, ow*s - p + kw, c].
template <typename scalar_t, typename dst_t>
void im2col_nhwc_tile(const scalar_t* x, dst_t* cols, const Geometry& g, int64_t p0, int64_t np) {
  const int64_t C = g.C;
  for (int64_t p = p0; p < p0 + np; ++p) {
    const int64_t oh = p / g.Wo, ow = p % g.Wo;
    dst_t* d = cols + (p - p0) * 9 * C;
    for (int64_t kh = 0; kh < 3; ++kh) {
      const int64_t ih = oh * g.stride - g.pad + kh;
      for (int64_t kw = 0; kw < 3; ++kw) {
        const int64_t iw = ow * g.stride - g.pad + kw;
        dst_t* dd = d + (kh * 3 + kw) * C;
        if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) {
          std::fill(dd, dd + C, dst_t(0));
        } else if constexpr (std::is_same_v<scalar_t, dst_t>) {
          std::memcpy(dd, x + (ih * g.W + iw) * C, C * sizeof(scalar_t));
        } else {
          const scalar_t* xs = x + (ih * g.W + iw) * C;
          for (int64_t c = 0; c < C; ++c) dd[c] = static_cast<dst_t>(xs[c]);
        }
      }
    }
  }
}

// Work items are (image, tile of output pixels), in parallel; each packs its
// tile (about 256 KiB, so packing, GEMM and epilogue stay in cache), runs one
// GEMM (at::mm_out, single-threaded inside the parallel region) into an
// opmath tile, and the epilogue adds the bias, applies ReLU, rounds once and
// writes the tile to the output (its final and only write). NCHW computes
// W(K, 9C) @ cols(9C, np); NHWC cols(np, 9C) @ W(9C, K). Half types pack and
// multiply in float32.
void dense_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool relu, at::Tensor& out,
                   const Geometry& g, bool nhwc) {
  const auto bias_act = OPFORGE_CPU_SELECT(conv_bias_act);
  const int64_t HoWo = g.Ho * g.Wo, CK = 9 * g.C, K = g.K;
  const auto dtype = x.scalar_type();
  const auto op_dtype = at::toOpMathType(dtype);
  const auto op_opts = x.options().dtype(op_dtype);
  const at::Tensor w_op = w.to(op_dtype);
  const at::Tensor wmat =
      nhwc ? w_op.permute({2, 3, 1, 0}).reshape({CK, K}).contiguous() : w_op.reshape({K, CK}).contiguous();
  const int64_t esize = static_cast<int64_t>(c10::elementSize(op_dtype));
  int64_t tp = std::max<int64_t>(16, (kTileBytes / esize) / std::max<int64_t>(1, CK));
  tp = std::min<int64_t>(HoWo, (tp + 15) / 16 * 16);
  const int64_t tiles = (HoWo + tp - 1) / tp;
  const void* bptr = bias.defined() ? bias.const_data_ptr() : nullptr;
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv2d_3x3_dense_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, g.N * tiles, 1, [&](int64_t begin, int64_t end) {
      // OpenMP worker threads start with default thread-local state: without
      // this guard at::mm_out would dispatch through autograd again there.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::vector<opmath_t> cols_buf(CK * tp), acc_buf(K * tp);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / tiles, p0 = (item % tiles) * tp, np = std::min(tp, HoWo - p0);
        const scalar_t* xn = xp + n * g.C * g.H * g.W;
        if (nhwc) {
          im2col_nhwc_tile<scalar_t, opmath_t>(xn, cols_buf.data(), g, p0, np);
          at::Tensor cols = at::from_blob(cols_buf.data(), {np, CK}, op_opts);
          at::Tensor acc = at::from_blob(acc_buf.data(), {np, K}, op_opts);
          at::mm_out(acc, cols, wmat);
          bias_act(dtype, acc_buf.data(), op + (n * HoWo + p0) * K, bptr, np, K, K, false, relu);
        } else {
          im2col_nchw_tile<scalar_t, opmath_t>(xn, cols_buf.data(), g, p0, np);
          at::Tensor cols = at::from_blob(cols_buf.data(), {CK, np}, op_opts);
          at::Tensor acc = at::from_blob(acc_buf.data(), {K, np}, op_opts);
          at::mm_out(acc, wmat, cols);
          bias_act(dtype, acc_buf.data(), op + n * K * HoWo + p0, bptr, K, np, HoWo, true, relu);
        }
      }
    });
  });
}

// Dense float32/bfloat16/float16 convolutions go to oneDNN (shipped inside
// torch) with the bias fused, and oneDNN's direct 3x3 kernels beat the
// im2col + GEMM path below by 2-3x on these CPUs. Returns an undefined
// tensor when oneDNN is not built in or refuses the dtype on this CPU (its
// half-precision paths need AVX-512 BF16/FP16 or AVX-NE-CONVERT): the first
// refusal turns oneDNN off for that dtype for the rest of the process.
// The ReLU is not oneDNN's post-op: that one maps NaN to 0 where torch.relu
// keeps it (hiding a diverging model), so it runs as one in-place pass over
// the output (a few percent of a compute-bound convolution).
at::Tensor dense_forward_onednn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool relu,
                                const Geometry& g) {
  static std::atomic<bool> refused[3] = {false, false, false};  // float32, bfloat16, float16
  const auto dtype = x.scalar_type();
  const int slot = dtype == at::kFloat ? 0 : dtype == at::kBFloat16 ? 1 : dtype == at::kHalf ? 2 : -1;
  if (slot < 0 || refused[slot].load() || !at::hasMKLDNN()) return {};
  static const auto handle = c10::Dispatcher::singleton().findOp({"mkldnn::_convolution_pointwise", ""});
  if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return {};
  c10::impl::GenericList no_scalars(c10::OptionalType::create(c10::NumberType::get()));
  torch::jit::Stack stack{x,
                          w,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          c10::IValue(std::vector<int64_t>{g.pad, g.pad}),
                          c10::IValue(std::vector<int64_t>{g.stride, g.stride}),
                          c10::IValue(std::vector<int64_t>{1, 1}),
                          c10::IValue(int64_t{1}),
                          c10::IValue(std::string("none")),
                          c10::IValue(no_scalars),
                          c10::IValue()};
  try {
    handle->callBoxed(&stack);
  } catch (const c10::Error&) {
    refused[slot].store(true);
    return {};
  }
  at::Tensor out = stack.at(0).toTensor();
  if (relu) out.relu_();
  return out;
}

at::Tensor conv2d_3x3_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias_in,
                          int64_t stride, int64_t padding, int64_t groups, bool relu) {
  const Geometry g = opforge::conv::check_conv_args(kOp, x_in, w_in, bias_in, stride, padding, groups);
  const auto o = opforge::conv::forward_operands(x_in, w_in, bias_in);
  if (g.N * opforge::conv::out_channels(g) * g.Ho * g.Wo == 0) return opforge::conv::empty_output(g, o);
  if (!g.depthwise) {
    const at::Tensor fused = dense_forward_onednn(o.x, o.w, o.bias, relu, g);
    if (fused.defined()) return fused.contiguous(o.fmt);
  }
  at::Tensor out = opforge::conv::empty_output(g, o);
  if (g.depthwise) {
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
                              relu,
                              o.x.const_data_ptr(),
                              o.w.const_data_ptr(),
                              o.bias.defined() ? o.bias.const_data_ptr() : nullptr,
                              out.data_ptr()};
    if (o.nhwc) {
      OPFORGE_CPU_SELECT(conv_dw_nhwc)(o.x.scalar_type(), p);
    } else {
      OPFORGE_CPU_SELECT(conv_dw_nchw)(o.x.scalar_type(), p);
    }
  } else {
    dense_forward(o.x, o.w, o.bias, relu, out, g, o.nhwc);
  }
  return out;
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
// float32 NHWC at stride 2 stays with oneDNN, up to 1.5x faster than these
// loops there (0.87-1.52x over three shapes; its half-type and float64
// paths were 10-35x slower).
bool direct_depthwise_backward(const Geometry& g, const at::Tensor& x) {
  const bool nhwc = opforge::conv::out_format(x) == at::MemoryFormat::ChannelsLast;
  return g.depthwise && g.mult == 1 && !(g.stride == 2 && nhwc && x.scalar_type() == at::kFloat);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_backward_direct(const at::Tensor& grad_out,
                                                                         const c10::optional<at::Tensor>& result,
                                                                         const at::Tensor& x_in, const at::Tensor& w_in,
                                                                         const Geometry& g, std::array<bool, 3> want) {
  const auto o = opforge::conv::backward_operands(grad_out, result, x_in, w_in);
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
                                     false,
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
  return {gx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_3x3_backward_cpu(const at::Tensor& grad_out,
                                                                       const c10::optional<at::Tensor>& result,
                                                                       const at::Tensor& x, const at::Tensor& w,
                                                                       int64_t stride, int64_t padding, int64_t groups,
                                                                       std::array<bool, 3> mask) {
  const Geometry g = opforge::conv::check_conv_args(kBwdOp, x, w, c10::nullopt, stride, padding, groups);
  opforge::conv::check_backward_args(kBwdOp, grad_out, result, x, g);
  if (direct_depthwise_backward(g, x) && x.numel() > 0 && grad_out.numel() > 0) {
    return depthwise_backward_direct(grad_out, result, x, w, g, mask);
  }
  return opforge::conv::backward_via_aten(grad_out, result, x, w, g, mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_cpu);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_cpu);
}

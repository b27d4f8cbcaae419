// CPU entry points of the conv family.
//
// Depthwise (groups == C): direct loops (cpu/conv_kernels.h), vectorised
// along W (NCHW) or along the channels (NHWC), parallel over planes / rows.
// Dense (groups == 1): from 2^20 multiply-adds oneDNN (use_onednn); below,
// per (image, tile of output pixels), in parallel: im2col of the tile into a
// packed buffer (at stride 1 in NCHW the whole image's columns, taken over
// the zero-padded image: dense_forward_wide), one GEMM (at::cpu::mm_out),
// then the bias + ReLU epilogue as the tile's single write to the output.
// Non-contiguous inputs take one .contiguous() in their suggested memory format.
// An unbatched (C, H, W) x runs as a batch of one.
//
// Backward: depthwise with multiplier 1 (but float32 channels_last at
// stride 2), direct loops that apply the ReLU mask (result > 0) as they read
// grad_out: grad x is the depthwise forward loop run on it with the kernel
// flipped (stride 1) or cpu/conv_dw_dgrad_kernels.h (stride 2), the weight /
// bias sums cpu/conv_dw_grad_kernels.h. Otherwise conv.cpp's
// backward_via_aten: the ReLU mask, then ATen's convolution_backward for
// grad x / weight / bias (oneDNN on the CPU).
#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <memory>

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

using opforge::conv::kBwdOp;
using opforge::conv::kOp;
// Packed-columns bytes per dense work item (see dense_forward).
constexpr int64_t kTileBytes = 1 << 20;

// Packs output pixels [p0, p0 + np) of one image: cols (9C, np), row (c, kh, kw)
// holding x[c, oh*s - p + kh, ow*s - p + kw] (zeros in the padding). The
// tile is walked output row by output row (no division per row: at small
// sizes those dominated the packing), each row in plain loops.
template <typename scalar_t, typename dst_t>
void im2col_nchw_tile(const scalar_t* x, dst_t* cols, const Geometry& g, int64_t p0, int64_t np) {
  const int64_t oh_first = p0 / g.Wo, ow_first = p0 % g.Wo, S = g.stride, P = g.pad;
  for (int64_t c = 0; c < g.C; ++c) {
    const scalar_t* xc = x + c * g.H * g.W;
    for (int64_t kh = 0; kh < 3; ++kh) {
      for (int64_t kw = 0; kw < 3; ++kw) {
        dst_t* d = cols + ((c * 3 + kh) * 3 + kw) * np - ow_first;  // d[ow] for the first output row
        int64_t oh = oh_first, ow0 = ow_first;
        for (int64_t left = np; left > 0; ++oh, ow0 = 0) {
          const int64_t ow1 = std::min<int64_t>(g.Wo, ow0 + left);
          left -= ow1 - ow0;
          const int64_t ih = oh * S - P + kh;
          if (ih < 0 || ih >= g.H) {
            for (int64_t ow = ow0; ow < ow1; ++ow) d[ow] = dst_t(0);
          } else {
            // iw = ow * S - P + kw is inside the row for ow in [lo, hi).
            const int64_t lo = std::min(ow1, std::max<int64_t>(ow0, (P - kw + S - 1) / S));
            const int64_t hi = std::max(lo, std::min<int64_t>(ow1, (g.W + P - kw + S - 1) / S));
            const scalar_t* xs = xc + ih * g.W - P + kw;  // xs[ow * S]
            for (int64_t ow = ow0; ow < lo; ++ow) d[ow] = dst_t(0);
            if (S == 1) {
              for (int64_t ow = lo; ow < hi; ++ow) d[ow] = static_cast<dst_t>(xs[ow]);
            } else {
              for (int64_t ow = lo; ow < hi; ++ow) d[ow] = static_cast<dst_t>(xs[ow * S]);
            }
            for (int64_t ow = hi; ow < ow1; ++ow) d[ow] = dst_t(0);
          }
          d += g.Wo;
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

// Stride 1 in NCHW, an image's columns within the tile budget: the columns
// are taken over the zero-padded image (C, Hp, Wp) with its row pitch, so
// that column row (c, kh, kw) is ONE contiguous run of the padded plane
// (M = (Ho - 1) * Wp + Wo values from offset kh * Wp + kw) rather than Ho
// runs of Wo: at small sizes the runs' set-up cost more than the whole GEMM.
// The GEMM then computes Wp - Wo extra columns per output row (2 of Wo + 2),
// dropped as the tile is compacted to (K, Ho * Wo) before the epilogue.
bool wide_columns_apply(const Geometry& g, bool nhwc, int64_t esize) {
  const int64_t Wp = g.W + 2 * g.pad;
  return g.stride == 1 && !nhwc && 9 * g.C * ((g.Ho - 1) * Wp + g.Wo) * esize <= kTileBytes;
}

template <typename scalar_t, typename opmath_t>
void dense_forward_wide(const scalar_t* xp, const at::Tensor& wmat, const void* bias, bool relu, scalar_t* op,
                        const Geometry& g, const at::TensorOptions& op_opts) {
  const auto bias_act = OPFORGE_CPU_SELECT(conv_bias_act);
  const int64_t P = g.pad, Hp = g.H + 2 * P, Wp = g.W + 2 * P, HoWo = g.Ho * g.Wo, CK = 9 * g.C, K = g.K;
  const int64_t M = (g.Ho - 1) * Wp + g.Wo;
  // x itself is the padded image when there is no padding to add and nothing to convert.
  const bool copy_x = P != 0 || !std::is_same_v<scalar_t, opmath_t>;
  at::parallel_for(0, g.N, 1, [&](int64_t begin, int64_t end) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see dense_forward
    // Written before they are read: the padded image (borders zeroed here),
    // the columns (copied), the GEMM's tile.
    const int64_t pad_size = copy_x ? g.C * Hp * Wp : 0;
    const std::unique_ptr<opmath_t[]> buf(new opmath_t[CK * M + K * M + pad_size]);
    opmath_t *const cols_ptr = buf.get(), *const acc_ptr = cols_ptr + CK * M, *const pad_ptr = acc_ptr + K * M;
    const at::Tensor cols = at::from_blob(cols_ptr, {CK, M}, op_opts);
    at::Tensor acc = at::from_blob(acc_ptr, {K, M}, op_opts);
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* xn = xp + n * g.C * g.H * g.W;
      const opmath_t* src;
      if (copy_x) {
        opmath_t* d = pad_ptr;
        for (int64_t c = 0; c < g.C; ++c) {
          std::fill(d, d + P * Wp, opmath_t(0));
          d += P * Wp;
          for (int64_t h = 0; h < g.H; ++h, d += Wp) {
            const scalar_t* s = xn + (c * g.H + h) * g.W;
            for (int64_t i = 0; i < P; ++i) d[i] = d[P + g.W + i] = opmath_t(0);
            for (int64_t i = 0; i < g.W; ++i) d[P + i] = static_cast<opmath_t>(s[i]);
          }
          std::fill(d, d + P * Wp, opmath_t(0));
          d += P * Wp;
        }
        src = pad_ptr;
      } else {
        src = reinterpret_cast<const opmath_t*>(xn);
      }
      for (int64_t c = 0; c < g.C; ++c) {
        for (int64_t t = 0; t < 9; ++t) {
          std::memcpy(cols_ptr + (c * 9 + t) * M, src + c * Hp * Wp + (t / 3) * Wp + t % 3, M * sizeof(opmath_t));
        }
      }
      at::cpu::mm_out(acc, wmat, cols);
      // (K, M) with row pitch Wp -> (K, Ho * Wo): each run moves to a lower
      // or equal offset, past every run already moved.
      opmath_t* a = acc_ptr;
      if (Wp != g.Wo) {
        for (int64_t k = 0; k < K; ++k) {
          for (int64_t oh = 0; oh < g.Ho; ++oh) {
            std::memmove(a + (k * g.Ho + oh) * g.Wo, a + k * M + oh * Wp, g.Wo * sizeof(opmath_t));
          }
        }
      }
      bias_act(c10::CppTypeToScalarType<scalar_t>::value, a, op + n * K * HoWo, bias, K, HoWo, HoWo, true, relu);
    }
  });
}

// Work items are (image, tile of output pixels), in parallel; each packs its
// tile (about 256 KiB, so packing, GEMM and epilogue stay in cache), runs one
// GEMM (at::cpu::mm_out, single-threaded inside the parallel region) into an
// opmath tile, and the epilogue adds the bias, applies ReLU, rounds once and
// writes the tile to the output (its final and only write). NCHW computes
// W(K, 9C) @ cols(9C, np); NHWC cols(np, 9C) @ W(9C, K). Half types pack and
// multiply in float32. At small sizes this path's cost is its set-up: the
// operands are wrapped without copies or dispatcher calls where they can be
// (the weight is already (K, 9C) contiguous for NCHW), the buffers are not
// zero-filled, and the GEMM is called below the dispatcher.
void dense_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool relu, at::Tensor& out,
                   const Geometry& g, bool nhwc) {
  const auto bias_act = OPFORGE_CPU_SELECT(conv_bias_act);
  const int64_t HoWo = g.Ho * g.Wo, CK = 9 * g.C, K = g.K;
  const auto dtype = x.scalar_type();
  const auto op_dtype = at::toOpMathType(dtype);
  const auto op_opts = x.options().dtype(op_dtype);
  const at::Tensor w_op = dtype == op_dtype ? w : w.to(op_dtype);
  const at::Tensor wmat = nhwc ? w_op.permute({2, 3, 1, 0}).reshape({CK, K}).contiguous()
                               : at::from_blob(w_op.data_ptr(), {K, CK}, op_opts);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(op_dtype));
  int64_t tp = std::max<int64_t>(16, (kTileBytes / esize) / std::max<int64_t>(1, CK));
  tp = std::min<int64_t>(HoWo, (tp + 15) / 16 * 16);
  const int64_t tiles = (HoWo + tp - 1) / tp;
  const void* bptr = bias.defined() ? bias.const_data_ptr() : nullptr;
  const bool wide = wide_columns_apply(g, nhwc, esize);
  OPFORGE_DISPATCH_FLOATING_TYPES(dtype, "conv2d_3x3_dense_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* op = out.mutable_data_ptr<scalar_t>();
    if (wide) {
      dense_forward_wide<scalar_t, opmath_t>(xp, wmat, bptr, relu, op, g, op_opts);
      return;
    }
    at::parallel_for(0, g.N * tiles, 1, [&](int64_t begin, int64_t end) {
      // OpenMP worker threads start with default thread-local state: without
      // this guard an ATen call inside the GEMM could dispatch through autograd.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      // Every element is written before it is read (packing, then the GEMM).
      const std::unique_ptr<opmath_t[]> cols_buf(new opmath_t[CK * tp]), acc_buf(new opmath_t[K * tp]);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / tiles, p0 = (item % tiles) * tp, np = std::min(tp, HoWo - p0);
        const scalar_t* xn = xp + n * g.C * g.H * g.W;
        if (nhwc) {
          im2col_nhwc_tile<scalar_t, opmath_t>(xn, cols_buf.get(), g, p0, np);
          at::Tensor cols = at::from_blob(cols_buf.get(), {np, CK}, op_opts);
          at::Tensor acc = at::from_blob(acc_buf.get(), {np, K}, op_opts);
          at::cpu::mm_out(acc, cols, wmat);
          bias_act(dtype, acc_buf.get(), op + (n * HoWo + p0) * K, bptr, np, K, K, false, relu);
        } else {
          im2col_nchw_tile<scalar_t, opmath_t>(xn, cols_buf.get(), g, p0, np);
          at::Tensor cols = at::from_blob(cols_buf.get(), {CK, np}, op_opts);
          at::Tensor acc = at::from_blob(acc_buf.get(), {K, np}, op_opts);
          at::cpu::mm_out(acc, wmat, cols);
          bias_act(dtype, acc_buf.get(), op + n * K * HoWo + p0, bptr, K, np, HoWo, true, relu);
        }
      }
    });
  });
}

// Dense float32/bfloat16/float16 convolutions from kOneDnnMinMacs go to
// oneDNN (shipped inside torch) with the bias fused, and oneDNN's direct 3x3
// kernels beat the im2col + GEMM path by 2-3x there. Returns an undefined
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

// oneDNN's fixed cost per call: it creates the convolution's primitive
// descriptor (trying its implementations in turn) and reorders the weight
// and the output on every call, ~30-50 us on this 2-core machine at one
// thread, where its convolution itself takes 1-5 us at these sizes. Below
// 2^20 multiply-adds the im2col + GEMM path takes less than that fixed cost
// (float32 / bfloat16, both layouts and strides, 1 thread: 0.1-0.9x of
// oneDNN's time); above 2^21 oneDNN's direct kernels are faster (1.3-3.7x).
constexpr int64_t kOneDnnMinMacs = int64_t{1} << 20;

bool use_onednn(const Geometry& g) { return g.N * g.K * g.C * 9 * g.Ho * g.Wo >= kOneDnnMinMacs; }

// The output as empty_output allocates it, without a trip through the
// dispatcher (a tenth of a small call's host time).
at::Tensor empty_output_cpu(const Geometry& g, const opforge::conv::ForwardOperands& o) {
  return at::detail::empty_cpu({g.N, opforge::conv::out_channels(g), g.Ho, g.Wo}, o.x.scalar_type(), false, o.fmt);
}

at::Tensor forward(const opforge::conv::ForwardOperands& o, const Geometry& g, bool relu) {
  if (g.N * opforge::conv::out_channels(g) * g.Ho * g.Wo == 0) return empty_output_cpu(g, o);
  if (!g.depthwise && use_onednn(g)) {
    const at::Tensor fused = dense_forward_onednn(o.x, o.w, o.bias, relu, g);
    if (fused.defined()) return fused.contiguous(o.fmt);
  }
  at::Tensor out = empty_output_cpu(g, o);
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

at::Tensor conv2d_3x3_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                          c10::IntArrayRef stride, c10::IntArrayRef padding, int64_t groups,
                          std::optional<std::string_view> activation) {
  bool relu = false;
  const auto s = opforge::conv::check_forward_args(kOp, x, w, bias, stride, padding, groups, activation, relu);
  const Geometry g = opforge::conv::geometry(s);
  return opforge::conv::unbatch(forward(opforge::conv::forward_operands(x, w, bias, s.unbatched), g, relu),
                                s.unbatched);
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
                                                                         const std::optional<at::Tensor>& result,
                                                                         const at::Tensor& x_in, const at::Tensor& w_in,
                                                                         const Geometry& g, bool unbatched,
                                                                         std::array<bool, 3> want) {
  const auto o = opforge::conv::backward_operands(grad_out, result, x_in, w_in, unbatched);
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
                                                                       const std::optional<at::Tensor>& result,
                                                                       const at::Tensor& x, const at::Tensor& w,
                                                                       int64_t stride, int64_t padding, int64_t groups,
                                                                       std::array<bool, 3> mask) {
  const auto s = opforge::conv::check_conv_args(kBwdOp, x, w, std::nullopt, stride, padding, groups);
  opforge::conv::check_backward_args(kBwdOp, grad_out, result, x, s);
  const Geometry g = opforge::conv::geometry(s);
  at::Tensor gx, gw, gb;
  if (direct_depthwise_backward(g, x) && x.numel() > 0 && grad_out.numel() > 0) {
    std::tie(gx, gw, gb) = depthwise_backward_direct(grad_out, result, x, w, g, s.unbatched, mask);
  } else {
    const bool u = s.unbatched;
    std::tie(gx, gw, gb) =
        opforge::conv::backward_via_aten(opforge::conv::batched(grad_out, u), opforge::conv::batched(result, u),
                                         opforge::conv::batched(x, u), w, g, mask);
  }
  return {opforge::conv::unbatch(gx, s.unbatched), gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_cpu);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_cpu);
}

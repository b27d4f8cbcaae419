// The conv family's dense (groups == 1) CPU path, forward and backward.
//
// Forward: from kOneDnnMinMacs multiply-adds oneDNN (shipped inside torch)
// with the bias fused; below, per (image, tile of output pixels), in
// parallel: im2col of the tile into a packed buffer (at stride 1 in NCHW the
// whole image's columns, taken over the zero-padded image: dense_forward_wide),
// one GEMM (at::cpu::mm_out), then the bias + ReLU epilogue as the tile's
// single write to the output.
// Backward, at stride 1 in NCHW below kOneDnnMinMacs: the same columns
// (dense_backward_small); otherwise ATen's (conv.cpp backward_via_aten).
#include "cpu/conv_dense_cpu.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mm_cpu_dispatch.h>

#include <atomic>
#include <cstring>
#include <memory>

#include <opforge/cpu_isa.h>
#include <opforge/dispatch.h>

OPFORGE_CPU_DECLARE(void, conv_bias_act, c10::ScalarType, const void*, void*, const void*, int64_t, int64_t, int64_t,
                    bool, opforge::Activation)

namespace opforge::conv {
namespace {

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

// Whether x is its own padded image: nothing to add, nothing to convert.
template <typename scalar_t, typename opmath_t>
bool copies_image(const Geometry& g) {
  return g.pad != 0 || !std::is_same_v<scalar_t, opmath_t>;
}

// One image's columns over its zero-padded form: row (c, kh, kw) of `cols`
// (row pitch ld) is the padded plane's M values from offset kh * Wp + kw.
// `pad` holds the padded image (C, Hp, Wp) in opmath where copies_image.
template <typename scalar_t, typename opmath_t>
void wide_columns(const scalar_t* xn, const Geometry& g, opmath_t* pad, opmath_t* cols, int64_t ld) {
  const int64_t P = g.pad, Hp = g.H + 2 * P, Wp = g.W + 2 * P, M = (g.Ho - 1) * Wp + g.Wo;
  const opmath_t* src = reinterpret_cast<const opmath_t*>(xn);
  if (copies_image<scalar_t, opmath_t>(g)) {
    opmath_t* d = pad;
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
    src = pad;
  }
  for (int64_t c = 0; c < g.C; ++c) {
    for (int64_t t = 0; t < 9; ++t) {
      std::memcpy(cols + (c * 9 + t) * ld, src + c * Hp * Wp + (t / 3) * Wp + t % 3, M * sizeof(opmath_t));
    }
  }
}

template <typename scalar_t, typename opmath_t>
void dense_forward_wide(const scalar_t* xp, const at::Tensor& wmat, const void* bias, Activation act, scalar_t* op,
                        const Geometry& g, const at::TensorOptions& op_opts) {
  const auto bias_act = OPFORGE_CPU_SELECT(conv_bias_act);
  const int64_t Wp = g.W + 2 * g.pad, HoWo = g.Ho * g.Wo, CK = 9 * g.C, K = g.K;
  const int64_t M = (g.Ho - 1) * Wp + g.Wo;
  const int64_t pad_size = copies_image<scalar_t, opmath_t>(g) ? g.C * (g.H + 2 * g.pad) * Wp : 0;
  at::parallel_for(0, g.N, 1, [&](int64_t begin, int64_t end) {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // see dense_forward
    // Written before they are read: the columns, the GEMM's tile, the padded image.
    const std::unique_ptr<opmath_t[]> buf(new opmath_t[CK * M + K * M + pad_size]);
    opmath_t *const cols_ptr = buf.get(), *const acc_ptr = cols_ptr + CK * M, *const pad_ptr = acc_ptr + K * M;
    const at::Tensor cols = at::from_blob(cols_ptr, {CK, M}, op_opts);
    at::Tensor acc = at::from_blob(acc_ptr, {K, M}, op_opts);
    for (int64_t n = begin; n < end; ++n) {
      wide_columns<scalar_t, opmath_t>(xp + n * g.C * g.H * g.W, g, pad_ptr, cols_ptr, M);
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
      bias_act(c10::CppTypeToScalarType<scalar_t>::value, a, op + n * K * HoWo, bias, K, HoWo, HoWo, true, act);
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
void dense_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Activation act, at::Tensor& out,
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
      dense_forward_wide<scalar_t, opmath_t>(xp, wmat, bptr, act, op, g, op_opts);
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
          bias_act(dtype, acc_buf.get(), op + (n * HoWo + p0) * K, bptr, np, K, K, false, act);
        } else {
          im2col_nchw_tile<scalar_t, opmath_t>(xn, cols_buf.get(), g, p0, np);
          at::Tensor cols = at::from_blob(cols_buf.get(), {CK, np}, op_opts);
          at::Tensor acc = at::from_blob(acc_buf.get(), {K, np}, op_opts);
          at::cpu::mm_out(acc, wmat, cols);
          bias_act(dtype, acc_buf.get(), op + n * K * HoWo + p0, bptr, K, np, HoWo, true, act);
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
// The activation is not oneDNN's post-op (its ReLU maps NaN to 0 where
// torch.relu keeps it, hiding a diverging model): it runs as one in-place
// pass over the output (a few percent of a compute-bound convolution).
at::Tensor dense_forward_onednn(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Activation act,
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
  activation_inplace(out, act);
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

// ------------------------------------------------------------------ backward

// The backward's buffers (columns, the padded gradient, the padded image,
// the masked gradient) stay below this; larger problems take ATen's path.
constexpr int64_t kSmallBackwardBytes = int64_t{4} << 20;

// At stride 1 in NCHW below oneDNN's sizes, ATen's backward (thnn's for one
// image, oneDNN's from two) costs 15-50 us of set-up where the work takes a
// few. Here, from one pass over grad_out (read through its strides: an
// expanded gradient is not copied) that applies the ReLU mask:
//  * grad bias: the per-channel sums, in opmath, in a fixed order;
//  * grad weight (K, 9C) = g (K, N*M) @ cols(9C, N*M)^T with each image's
//    columns over its padded image (wide_columns) and g laid out with the
//    same row pitch Wp (zeros between the rows);
//  * grad x: the forward's path on the masked gradient with the kernel
//    transposed and flipped, padding 2 - padding (its output is x's shape).
template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> small_backward(const at::Tensor& grad_out, const at::Tensor& result,
                                                              const at::Tensor& x, const at::Tensor& w,
                                                              const Geometry& g, std::array<bool, 3> mask) {
  using opmath_t = at::opmath_type<scalar_t>;
  const auto dtype = x.scalar_type();
  const auto op_opts = x.options().dtype(at::toOpMathType(dtype));
  const int64_t N = g.N, C = g.C, K = g.K, Ho = g.Ho, Wo = g.Wo, P = g.pad;
  const int64_t Wp = g.W + 2 * P, M = (Ho - 1) * Wp + Wo, NM = N * M;
  at::Tensor gm = mask[0] ? at::Tensor(at::detail::empty_cpu({N, K, Ho, Wo}, dtype)) : at::Tensor();
  // Written before they are read: the padded gradient (its gaps zeroed below).
  const std::unique_ptr<opmath_t[]> gwide(mask[1] ? new opmath_t[K * NM] : nullptr);
  std::vector<opmath_t> gsum(K, opmath_t(0));
  const scalar_t* gp = grad_out.const_data_ptr<scalar_t>();
  const scalar_t* rp = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
  const int64_t g0 = grad_out.stride(0), g1 = grad_out.stride(1), g2 = grad_out.stride(2), g3 = grad_out.stride(3);
  const int64_t r0 = rp ? result.stride(0) : 0, r1 = rp ? result.stride(1) : 0, r2 = rp ? result.stride(2) : 0,
                r3 = rp ? result.stride(3) : 0;
  scalar_t* gmp = mask[0] ? gm.mutable_data_ptr<scalar_t>() : nullptr;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      opmath_t* row = mask[1] ? gwide.get() + k * NM + n * M : nullptr;
      opmath_t sum = 0;
      for (int64_t oh = 0; oh < Ho; ++oh) {
        const scalar_t* gr = gp + n * g0 + k * g1 + oh * g2;
        const scalar_t* rr = rp ? rp + n * r0 + k * r1 + oh * r2 : nullptr;
        scalar_t* mr = gmp ? gmp + ((n * K + k) * Ho + oh) * Wo : nullptr;
        opmath_t* wr = row ? row + oh * Wp : nullptr;
        for (int64_t ow = 0; ow < Wo; ++ow) {
          // threshold_backward's mask: zero where the ReLU's result is <= 0 (NaN passes).
          const scalar_t v = (rr && rr[ow * r3] <= scalar_t(0)) ? scalar_t(0) : gr[ow * g3];
          if (mr) mr[ow] = v;
          if (wr) wr[ow] = static_cast<opmath_t>(v);
          sum += static_cast<opmath_t>(v);
        }
        if (wr && oh + 1 < Ho) std::fill(wr + Wo, wr + Wp, opmath_t(0));
      }
      gsum[k] += sum;
    }
  }
  auto empty = [&] { return at::Tensor(at::detail::empty_cpu({0}, dtype)); };
  at::Tensor gb;
  if (mask[2]) {
    gb = at::detail::empty_cpu({K}, dtype);
    scalar_t* gbp = gb.mutable_data_ptr<scalar_t>();
    for (int64_t k = 0; k < K; ++k) gbp[k] = static_cast<scalar_t>(gsum[k]);
  } else {
    gb = empty();
  }
  at::Tensor gw;
  if (mask[1]) {
    gw = at::detail::empty_cpu({K, C, 3, 3}, dtype);
    const int64_t pad_size = copies_image<scalar_t, opmath_t>(g) ? C * (g.H + 2 * P) * Wp : 0;
    const bool direct = std::is_same_v<scalar_t, opmath_t>;  // the GEMM writes grad weight itself
    // Written before they are read: the columns, the padded image, the GEMM's result.
    const std::unique_ptr<opmath_t[]> buf(new opmath_t[9 * C * NM + pad_size + (direct ? 0 : K * 9 * C)]);
    opmath_t *const cols = buf.get(), *const pad = cols + 9 * C * NM;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    for (int64_t n = 0; n < N; ++n) wide_columns<scalar_t, opmath_t>(xp + n * C * g.H * g.W, g, pad, cols + n * M, NM);
    opmath_t* acc_ptr = direct ? reinterpret_cast<opmath_t*>(gw.mutable_data_ptr<scalar_t>()) : pad + pad_size;
    at::Tensor acc = at::from_blob(acc_ptr, {K, 9 * C}, op_opts);
    at::cpu::mm_out(acc, at::from_blob(gwide.get(), {K, NM}, op_opts),
                    at::from_blob(cols, {NM, 9 * C}, {1, NM}, op_opts));
    if (!direct) {
      scalar_t* gwp = gw.mutable_data_ptr<scalar_t>();
      for (int64_t i = 0; i < K * 9 * C; ++i) gwp[i] = static_cast<scalar_t>(acc_ptr[i]);
    }
  } else {
    gw = empty();
  }
  at::Tensor gx;
  if (mask[0]) {
    // wt[c][k][kh][kw] = w[k][c][2 - kh][2 - kw]
    at::Tensor wt = at::detail::empty_cpu({C, K, 3, 3}, dtype);
    const scalar_t* wp = w.const_data_ptr<scalar_t>();
    scalar_t* wtp = wt.mutable_data_ptr<scalar_t>();
    for (int64_t c = 0; c < C; ++c) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t t = 0; t < 9; ++t) wtp[(c * K + k) * 9 + t] = wp[(k * C + c) * 9 + 8 - t];
      }
    }
    const Geometry t{N, K, Ho, Wo, C, g.H, g.W, 1, 2 - P, 1, C, false};
    gx = at::detail::empty_cpu({N, C, g.H, g.W}, dtype);
    dense_forward(gm, wt, at::Tensor(), Activation::None, gx, t, false);
  } else {
    gx = empty();
  }
  return {gx, gw, gb};
}

}  // namespace

at::Tensor dense_forward_cpu(const ForwardOperands& o, const Geometry& g, Activation act) {
  // o.w may be channels_last, as x is (forward_operands): oneDNN takes it so, without a plain copy.
  if (use_onednn(g)) {
    const at::Tensor fused = dense_forward_onednn(o.x, o.w, o.bias, act, g);
    if (fused.defined()) return fused.contiguous(o.fmt);
  }
  at::Tensor out = empty_output_cpu(g, o);
  dense_forward(o.x, o.w.contiguous(), o.bias, act, out, g, o.nhwc);
  return out;
}

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> dense_backward_small_cpu(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& result, const at::Tensor& x, const at::Tensor& w,
    const Geometry& g, std::array<bool, 3> mask) {
  if (g.depthwise || g.stride != 1 || use_onednn(g) || out_format(x) != at::MemoryFormat::Contiguous) {
    return std::nullopt;
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(at::toOpMathType(x.scalar_type())));
  const int64_t Wp = g.W + 2 * g.pad, NM = g.N * ((g.Ho - 1) * Wp + g.Wo);
  const int64_t bytes = esize * (9 * g.C * NM + g.K * NM + g.C * (g.H + 2 * g.pad) * Wp + 9 * g.C * g.K) +
                        x.element_size() * g.N * g.K * g.Ho * g.Wo;
  if (bytes > kSmallBackwardBytes) return std::nullopt;
  const at::Tensor res = result.has_value() && result->defined() ? *result : at::Tensor();
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_dense_backward_cpu", [&] {
    out = small_backward<scalar_t>(grad_out, res, x.contiguous(), w.contiguous(), g, mask);
  });
  return out;
}

}  // namespace opforge::conv

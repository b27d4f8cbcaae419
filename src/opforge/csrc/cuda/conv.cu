// CUDA entry points of the conv family.
//
// Depthwise (groups == C): the direct kernels of cuda/conv_depthwise/,
// forward and backward (grad x, grad weight, grad bias with the ReLU mask
// applied as grad_out is read).
// Dense (groups == 1) with ReLU: cuDNN's fused convolution + bias + ReLU
// (at::cudnn_convolution_relu: one tensor-core kernel with the epilogue
// fused, from the cuDNN that torch ships) where cuDNN takes the case: on the
// H200 it runs the benchmark shapes 2-2.7x faster than this library's own
// kernel. Without ReLU there is nothing to fuse: cuDNN's convolution with
// bias (F.conv2d's call). With OPFORGE_CONV_DENSE_ENGINE=opforge, for
// float64, or where cuDNN refuses: the tensor-core implicit GEMM of
// cuda/conv_dense_mma.cu when it takes the case; otherwise (fallback)
// ATen's convolution (cuDNN, honouring
// torch.backends.cudnn.allow_tf32 for float32 exactly like F.conv2d)
// followed by ONE fused bias + ReLU epilogue kernel, in place on cuDNN's
// output (16-byte vectors when aligned). Dense backward: one pass writes
// the masked gradient and the bias gradient's sums (cuda/conv_bias_grad.cu),
// then ATen's convolution_backward (cuDNN) gives grad x and grad weight.
// Inputs take one .contiguous() in x's memory format (a no-op for contiguous
// and channels_last tensors).
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/env.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>
#include <opforge/dispatch.h>

#include "conv.h"
#include "cuda/conv_dense_mma.h"
#include "cuda/conv_bias_act.h"
#include "cuda/conv_bias_grad.h"
#include "cuda/conv_depthwise.h"

namespace {

using opforge::conv::Geometry;
using opforge::cuda::AlignedVec;

using opforge::conv::kBwdOp;
using opforge::conv::kOp;
constexpr int kThreads = 256;

// y = act(y + bias[channel]) in place over (N, K, Ho, Wo) stored NCHW (channel
// of flat index i: (i / HoWo) % K) or NHWC (i % K). V elements per thread step.
template <typename scalar_t, int V, bool kNhwc>
__global__ void __launch_bounds__(kThreads)
    bias_act_kernel(scalar_t* __restrict__ y, const scalar_t* __restrict__ bias, int64_t n, int64_t K, int64_t HoWo,
                    opforge::Activation act) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t nv = n / V;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += step) {
    const int64_t i0 = v * V;
    auto val = reinterpret_cast<AlignedVec<scalar_t, V>*>(y)[v];
    int64_t k, r = 0;
    if (kNhwc) {
      k = i0 % K;
    } else {
      k = (i0 / HoWo) % K;
      r = i0 % HoWo;
    }
#pragma unroll
    for (int e = 0; e < V; ++e) {
      opmath_t a = static_cast<opmath_t>(val.val[e]);
      if (bias != nullptr) a += static_cast<opmath_t>(bias[k]);
      a = opforge::apply_activation(a, act);
      val.val[e] = static_cast<scalar_t>(a);
      if (kNhwc) {
        if (++k == K) k = 0;
      } else if (++r == HoWo) {
        r = 0;
        if (++k == K) k = 0;
      }
    }
    reinterpret_cast<AlignedVec<scalar_t, V>*>(y)[v] = val;
  }
  // Tail of fewer than V elements.
  const int64_t t = nv * V + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) {
    const int64_t k = kNhwc ? t % K : (t / HoWo) % K;
    opmath_t a = static_cast<opmath_t>(y[t]);
    if (bias != nullptr) a += static_cast<opmath_t>(bias[k]);
    a = opforge::apply_activation(a, act);
    y[t] = static_cast<scalar_t>(a);
  }
}

template <typename scalar_t, int V>
void launch_bias_act(scalar_t* y, const scalar_t* b, int64_t n, int64_t K, int64_t HoWo, opforge::Activation act,
                     bool nhwc) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = opforge::cuda::grid_for(std::max<int64_t>(n / V, n % V), kThreads);
  if (nhwc) {
    bias_act_kernel<scalar_t, V, true><<<blocks, kThreads, 0, stream>>>(y, b, n, K, HoWo, act);
  } else {
    bias_act_kernel<scalar_t, V, false><<<blocks, kThreads, 0, stream>>>(y, b, n, K, HoWo, act);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

namespace opforge::conv {

void bias_act_cuda(at::Tensor& y, const at::Tensor& bias, Activation act, bool nhwc, const Geometry& g) {
  const int64_t n = y.numel();
  if (n == 0) return;
  OPFORGE_DISPATCH_FLOATING_TYPES(y.scalar_type(), "conv2d_3x3_bias_act", [&] {
    auto* yp = y.mutable_data_ptr<scalar_t>();
    const auto* bp = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    constexpr int V = opforge::cuda::vec_width<scalar_t>();
    if (opforge::cuda::is_aligned(yp, 16)) {
      launch_bias_act<scalar_t, V>(yp, bp, n, g.K, g.Ho * g.Wo, act, nhwc);
    } else {
      launch_bias_act<scalar_t, 1>(yp, bp, n, g.K, g.Ho * g.Wo, act, nhwc);
    }
  });
}

}  // namespace opforge::conv

namespace {

using opforge::conv::bias_act_cuda;

// Which engine runs dense convolutions with ReLU first: "cudnn" (default) or
// "opforge" (this library's tensor-core kernel), from OPFORGE_CONV_DENSE_ENGINE.
bool prefer_cudnn_fused() {
  const auto v = c10::utils::get_env("OPFORGE_CONV_DENSE_ENGINE");
  if (!v.has_value() || v->empty() || *v == "cudnn") return true;
  TORCH_CHECK_VALUE(*v == "opforge", kOp, ": OPFORGE_CONV_DENSE_ENGINE must be \"cudnn\" or \"opforge\", got \"", *v,
                    "\"");
  return false;
}

// relu(conv(x, w) + bias) by cuDNN's fused kernel; nullopt where cuDNN is
// absent, disabled, or refuses the case (float64 is left to the others).
std::optional<at::Tensor> cudnn_conv_bias_relu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                                               int64_t stride, int64_t padding, at::MemoryFormat fmt) {
  if (x.scalar_type() == at::kDouble || !at::globalContext().userEnabledCuDNN() ||
      !at::detail::getCUDAHooks().compiledWithCuDNN()) {
    return std::nullopt;
  }
  try {
    // In x's own layout: the two layout conversions around cuDNN cost more
    // than its faster channels_last kernel saves (docs/ops/conv.md, Design notes).
    at::Tensor y = at::cudnn_convolution_relu(x, w, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                                              {stride, stride}, {padding, padding}, {1, 1}, 1);
    if (!y.is_contiguous(fmt)) y = y.contiguous(fmt);
    return y;
  } catch (const c10::Error&) {
    return std::nullopt;  // no cuDNN engine for this case: the other paths take it
  }
}

at::Tensor forward_cuda(const opforge::conv::ForwardOperands& o, const Geometry& g, opforge::Activation act) {
  const at::MemoryFormat fmt = o.fmt;
  const bool nhwc = o.nhwc;
  const at::Tensor &x = o.x, &w = o.w, &bias = o.bias;
  at::Tensor out = opforge::conv::empty_output(g, o);
  if (out.numel() == 0) return out;
  if (g.depthwise) {
    opforge::conv::depthwise_forward_cuda(x, w, bias, act, out, g, nhwc);
    return out;
  }
  const int64_t stride = g.stride, padding = g.pad;
  if (prefer_cudnn_fused() && x.scalar_type() != at::kDouble) {
    if (act == opforge::Activation::Relu) {
      if (auto y = cudnn_conv_bias_relu(x, w, bias, stride, padding, fmt)) return *y;
    } else {
      // cuDNN's convolution with its bias, F.conv2d's own call; an
      // activation other than ReLU (which cuDNN does not fuse) as one
      // in-place pass, as F.conv2d followed by it would run.
      at::Tensor y = at::convolution(x, w, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                                     {stride, stride}, {padding, padding}, {1, 1}, false, {0, 0}, 1);
      if (!y.is_contiguous(fmt)) y = y.contiguous(fmt);
      opforge::conv::activation_inplace(y, act);
      return y;
    }
  }
  if (opforge::conv::conv3x3_dense_forward_mma(x, w, bias, stride, padding, act, out)) return out;
  // Fallback: cuDNN, then one fused bias + activation pass.
  at::Tensor y = at::convolution(x, w, std::nullopt, {stride, stride}, {padding, padding}, {1, 1}, false, {0, 0}, 1);
  if (!y.is_contiguous(fmt)) y = y.contiguous(fmt);
  if (bias.defined() || act != opforge::Activation::None) bias_act_cuda(y, bias, act, nhwc, g);
  return y;
}

at::Tensor conv2d_3x3_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, c10::IntArrayRef padding, int64_t groups,
                           std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_forward_args(kOp, x, w, bias, stride, padding, groups, activation, act);
  const Geometry g = opforge::conv::geometry(s);
  const c10::cuda::CUDAGuard guard(x.device());
  return opforge::conv::unbatch(forward_cuda(opforge::conv::forward_operands(x, w, bias, s.unbatched), g, act),
                                s.unbatched);
}

// Dense backward (and depthwise, where depthwise_backward_prefers_cudnn):
// the masked gradient and grad bias from one pass over grad_out and the
// result, then cuDNN for grad x and grad weight without the bias (its sums over N, H and W, a second read of the
// gradient in ATen, ran at a sixth of the H200's bandwidth). Without a bias gradient to compute, or with nothing to
// read, ATen's path is as good.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cudnn_backward(const at::Tensor& grad_out,
                                                              const std::optional<at::Tensor>& result,
                                                              const at::Tensor& x_in, const at::Tensor& w_in,
                                                              const Geometry& g, bool unbatched,
                                                              std::array<bool, 3> mask) {
  if (!mask[2] || grad_out.numel() == 0 || x_in.numel() == 0) {
    // 4-d views; an unbatched x as the contiguous batch of one its gradient is.
    return opforge::conv::backward_via_aten(
        opforge::conv::batched(grad_out, unbatched), opforge::conv::batched(result, unbatched),
        unbatched ? x_in.unsqueeze(0).contiguous() : x_in, w_in, g.stride, g.pad, g.groups, mask);
  }
  const auto o = opforge::conv::backward_operands(grad_out, result, x_in, w_in, unbatched);
  const bool conv_grads = mask[0] || mask[1];
  at::Tensor masked = o.result.defined() && conv_grads
                          ? at::empty(o.grad_out.sizes(), o.grad_out.options().memory_format(o.fmt))
                          : at::Tensor();
  at::Tensor gb = at::empty({g.K}, o.x.options());
  opforge::conv::masked_grad_bias_cuda(o.grad_out, o.result, masked, gb, o.nhwc);
  auto empty = [&] { return at::empty({0}, o.x.options()); };
  if (!conv_grads) return {empty(), empty(), gb};
  at::Tensor gx, gw;
  std::tie(gx, gw, std::ignore) =
      at::convolution_backward(o.result.defined() ? masked : o.grad_out, o.x, o.w, std::nullopt, {g.stride, g.stride},
                               {g.pad, g.pad}, {1, 1}, false, {0, 0}, g.groups, {mask[0], mask[1], false});
  // Layouts as the shape function states: grad x in x's format, grad weight in weight_grad_format.
  return {mask[0] ? gx.contiguous(o.fmt) : empty(),
          mask[1] ? gw.contiguous(opforge::conv::weight_grad_format(w_in)) : empty(), gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> depthwise_backward(const at::Tensor& grad_out,
                                                                  const std::optional<at::Tensor>& result,
                                                                  const at::Tensor& x_in, const at::Tensor& w_in,
                                                                  const Geometry& g, bool unbatched,
                                                                  std::array<bool, 3> mask) {
  const auto o = opforge::conv::backward_operands(grad_out, result, x_in, w_in, unbatched);
  const at::MemoryFormat fmt = o.fmt;
  const bool nhwc = o.nhwc;
  const at::Tensor &x = o.x, &w = o.w, &go = o.grad_out, &res = o.result;
  auto empty = [&] { return at::empty({0}, x.options()); };
  at::Tensor gx = mask[0] ? at::empty(x.sizes(), x.options().memory_format(fmt)) : empty();
  at::Tensor gw = mask[1] ? at::empty(w.sizes(), w.options()) : at::Tensor();
  at::Tensor gb = mask[2] ? at::empty({g.K}, x.options()) : at::Tensor();
  if (go.numel() == 0) {
    if (mask[0]) gx.zero_();
    if (mask[1]) gw.zero_();
    if (mask[2]) gb.zero_();
  } else {
    at::Tensor gx_out = mask[0] ? gx : at::Tensor();
    opforge::conv::depthwise_backward_cuda(go, res, x, w, gx_out, gw, gb, g, nhwc);
  }
  return {gx, mask[1] ? gw : empty(), mask[2] ? gb : empty()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv2d_3x3_backward_cuda(
    const at::Tensor& grad_out_in, const std::optional<at::Tensor>& result_in, const at::Tensor& x, const at::Tensor& w,
    int64_t stride, int64_t padding, int64_t groups, std::array<bool, 3> mask, std::string_view activation) {
  const auto s = opforge::conv::check_conv_args(kBwdOp, x, w, std::nullopt, stride, padding, groups);
  opforge::conv::check_backward_args(kBwdOp, grad_out_in, result_in, x, s);
  const Geometry g = opforge::conv::geometry(s);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto [grad_out, result] = opforge::conv::grad_through_activation(grad_out_in, result_in, activation);
  at::Tensor gx, gw, gb;
  const bool own = g.depthwise && !opforge::conv::depthwise_backward_prefers_cudnn(
                                      g, opforge::conv::out_format(x) == at::MemoryFormat::ChannelsLast);
  std::tie(gx, gw, gb) = own ? depthwise_backward(grad_out, result, x, w, g, s.unbatched, mask)
                             : cudnn_backward(grad_out, result, x, w, g, s.unbatched, mask);
  if (mask[1] && gw.dim() == 4) gw = gw.contiguous(opforge::conv::weight_grad_format(w));
  return {opforge::conv::unbatch(gx, s.unbatched), gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("conv2d_3x3", &conv2d_3x3_cuda);
  m.impl("_conv2d_3x3_backward", &conv2d_3x3_backward_cuda);
}

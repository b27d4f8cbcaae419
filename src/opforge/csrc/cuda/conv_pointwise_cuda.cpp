// conv2d_1x1's CUDA kernel. A channels_last input goes to the tensor-core
// GEMM with the bias and activation fused into its epilogue
// (cuda/conv_dense_mma.cu: bfloat16, float16, and float32 as TF32 where
// torch allows TF32 for cuDNN convolutions, as F.conv2d does), except
// float32 with more than 512 input channels, where cuDNN's Hopper kernels
// are ahead on that compute-bound GEMM. A contiguous (NCHW) input, float64,
// and every case that kernel declines go to cuDNN's convolution (with the
// bias when there is no activation), then the bias and activation as one
// pass over its output.
// OPFORGE_CONV_1X1_ENGINE=opforge sends NCHW inputs to the tensor-core kernel
// too (one transpose pass first), =aten sends everything to ATen (both for
// benchmarking the choice).
#include <ATen/Functions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/env.h>
#include <torch/library.h>

#include "conv_pointwise.h"
#include "cuda/conv_bias_act.h"
#include "cuda/conv_dense_mma.h"

namespace {

using opforge::conv::kPointwiseOp;

enum class Engine { Auto, Opforge, Aten };

Engine engine() {
  const auto v = c10::utils::get_env("OPFORGE_CONV_1X1_ENGINE");
  if (!v.has_value() || v->empty() || *v == "auto") return Engine::Auto;
  if (*v == "opforge") return Engine::Opforge;
  TORCH_CHECK_VALUE(*v == "aten", kPointwiseOp,
                    ": OPFORGE_CONV_1X1_ENGINE must be \"auto\", \"opforge\" or \"aten\", got \"", *v, "\"");
  return Engine::Aten;
}

at::Tensor conv2d_1x1_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           c10::IntArrayRef stride, std::optional<std::string_view> activation) {
  opforge::Activation act{};
  const auto s = opforge::conv::check_pointwise_args(kPointwiseOp, x, w, bias, stride, activation, act);
  const auto g = opforge::conv::geometry(s);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto o = opforge::conv::forward_operands(x, w, bias, s.unbatched);
  const Engine e = engine();
  const bool compute_bound_tf32 = o.x.scalar_type() == at::kFloat && g.C > 512;
  if (e == Engine::Opforge || (e == Engine::Auto && o.nhwc && !compute_bound_tf32)) {
    at::Tensor out = opforge::conv::empty_output(g, o);
    if (out.numel() == 0) return opforge::conv::unbatch(out, s.unbatched);
    if (opforge::conv::conv1x1_forward_mma(o.x, o.w, o.bias, g.stride, act, out)) {
      return opforge::conv::unbatch(out, s.unbatched);
    }
  }
  if (g.C == 0 || g.N == 0) return opforge::conv::unbatch(opforge::conv::empty_output(g, o), s.unbatched);
  // Without an activation the bias goes to ATen's convolution: that is F.conv2d's own call, which the
  // pointwise sweep found faster than the bias as a pass of ours after a bias-less convolution.
  const bool bias_in_conv = act == opforge::Activation::None && o.bias.defined();
  at::Tensor y = at::convolution(o.x, o.w, bias_in_conv ? std::optional<at::Tensor>(o.bias) : std::nullopt,
                                 {g.stride, g.stride}, {0, 0}, {1, 1}, false, {0, 0}, 1);
  if (!y.is_contiguous(o.fmt)) y = y.contiguous(o.fmt);
  if (!bias_in_conv && (o.bias.defined() || act != opforge::Activation::None)) {
    opforge::conv::bias_act_cuda(y, o.bias, act, o.nhwc, g);
  }
  return opforge::conv::unbatch(y, s.unbatched);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) { m.impl("conv2d_1x1", &conv2d_1x1_cuda); }

// Depthwise 3x3 convolution on CUDA: direct kernels, memory-bound by design.
//
// Forward, stride 2 (NCHW; NHWC with multiplier 1) and NCHW planes of up to
// 14x14 outputs: unstaged kernels, a thread per V outputs along W (NCHW) or
// C (NHWC), reading its window from global memory through L1.
// Forward, stride 1 otherwise: the staged kernels (conv_dw_forward_*.cuh).
// Forward, NCHW, general: one block per (image, input channel, tile of
// output rows x columns). The input tile with its halo is staged in shared memory (opmath)
// with 16-byte global loads along W where the row is aligned (scalar loads
// for the halo and unaligned rows); each thread then computes V consecutive
// outputs of a row for every channel multiplier from a window read with
// vector shared-memory loads, adds the bias, applies ReLU and stores V
// values at once (16 bytes when aligned).
// Forward, NHWC: one block per (image, tile of 8x8 or 4x8 output pixels,
// chunk of input channels); the tile is staged with 16-byte loads along C and
// each thread computes V consecutive output channels of one pixel.
// Backward: at stride 2 from 2^21 (NCHW) or 2^22 (NHWC) input elements,
// cuDNN's after one mask-and-bias pass (cuda/conv.cu). For stride 1 and
// multiplier 1, NHWC with padding 1 runs one fused kernel (grad x and the weight sums from one stage of grad_out,
// result and x per tile); otherwise one pass masks grad_out by the fused
// ReLU's result and grad x is the forward kernel run on it with the kernel
// flipped (padding 2 - pad), the weight sums coming from staged kernels on
// the forward's tiles; other strides and multipliers: grad x is a gather (the
// flipped kernel, stride-aware) with the ReLU mask applied as grad_out is
// read (row kernels for stride 1 when the forward's do not apply); grad
// weight and grad bias are per-channel reductions: block reductions into a
// (K, splits, 10) partial buffer, then one small kernel sums the splits in a
// fixed order (deterministic, no atomics).
//
// Files (cuda/conv_depthwise/): kernel bodies in .cuh headers, each compiled
// by the thin .cu of the same name with its launchers; conv_dw.h declares
// what crosses files; conv_dw_plan.cpp plans; this file drives.
#include <ATen/Functions.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <climits>

#include <opforge/cuda_launch.cuh>
#include <opforge/dispatch.h>

#include "cuda/conv_depthwise.h"
#include "cuda/conv_depthwise/conv_dw.h"

namespace opforge::conv {
namespace {

// grad x of a stride-1, multiplier-1 convolution is the stride-1 depthwise
// convolution of the masked grad_out (N, C, Ho, Wo) with the kernel flipped
// and padding 2 - pad, whose output is (N, C, H, W): the forward's staged
// kernels (cp.async) do it (the unstaged NCHW one measured no faster here).
// False where they do not apply (float64, NHWC with C % 4 != 0, alignment).
template <typename scalar_t>
bool try_backward_input_as_forward(const scalar_t* gm, const scalar_t* wflip, scalar_t* gx, const Geometry& g,
                                   bool nhwc, cudaStream_t stream) {
  Geometry t = g;
  t.H = g.Ho;
  t.W = g.Wo;
  t.Ho = g.H;
  t.Wo = g.W;
  t.pad = 2 - g.pad;
  return nhwc ? try_forward_nhwc_s1<scalar_t>(gm, wflip, nullptr, gx, t, Activation::None, stream)
              : try_forward_nchw_s1<scalar_t>(gm, wflip, nullptr, gx, t, Activation::None, stream);
}

}  // namespace

void depthwise_forward_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, Activation act,
                            at::Tensor& out, const Geometry& g, bool nhwc) {
  TORCH_CHECK(g.N <= INT32_MAX && g.Ho <= INT32_MAX / 2 && g.Wo <= INT32_MAX / 2,
              "opforge.conv2d_3x3: tensor too large for the depthwise CUDA kernel");
  auto stream = at::cuda::getCurrentCUDAStream();
  DwArgs a = base_args(g);
  a.act = act;
  const int S = static_cast<int>(g.stride);
  OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* xp = x.const_data_ptr<scalar_t>();
    const auto* wp = w.const_data_ptr<scalar_t>();
    const auto* bp = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    auto* op = out.mutable_data_ptr<scalar_t>();
    if (nhwc ? try_forward_nhwc_direct<scalar_t>(xp, wp, bp, op, g, act, stream) ||
                   try_forward_nhwc_s1<scalar_t>(xp, wp, bp, op, g, act, stream)
             : try_forward_nchw_direct<scalar_t>(xp, wp, bp, op, g, act, stream) ||
                   try_forward_nchw_s1<scalar_t>(xp, wp, bp, op, g, act, stream)) {
      return;
    }
    int V;
    int64_t blocks;
    size_t smem;
    if (nhwc) {
      V = opforge::cuda::pick_vec<scalar_t>(g.C, {xp, op});
      plan_forward_nhwc(g, V, S, sizeof(opmath_t), a, blocks, smem);
    } else {
      V = opforge::cuda::pick_vec<scalar_t>(g.W, {xp});
      plan_forward_nchw(g, V, S, sizeof(scalar_t), sizeof(opmath_t), op, a, blocks, smem);
    }
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    TORCH_CHECK(smem <= 160 * 1024, "opforge.conv2d_3x3: channel multiplier ", g.mult,
                " needs more shared memory than the depthwise CUDA kernel supports");
    if (nhwc) {
      launch_forward_nhwc<scalar_t>(xp, wp, bp, op, a, V, S, blocks, smem, stream);
    } else {
      launch_forward_nchw<scalar_t>(xp, wp, bp, op, a, V, S, blocks, smem, stream);
    }
  });
}

void depthwise_backward_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                             const at::Tensor& w, at::Tensor& grad_x, at::Tensor& grad_w, at::Tensor& grad_b,
                             const Geometry& g, bool nhwc) {
  at::Tensor gm = grad_out, res = result;
  const bool staged = staged_s1_applies(g, nhwc, x.scalar_type());
  if (staged && nhwc && grad_x.defined() && (grad_w.defined() || grad_b.defined())) {
    bool done = false;
    OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_fused", [&] {
      done = try_backward_fused_nhwc<scalar_t>(
          grad_out.const_data_ptr<scalar_t>(), result.defined() ? result.const_data_ptr<scalar_t>() : nullptr,
          x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), grad_x.mutable_data_ptr<scalar_t>(),
          grad_w.defined() ? grad_w.mutable_data_ptr<scalar_t>() : nullptr,
          grad_b.defined() ? grad_b.mutable_data_ptr<scalar_t>() : nullptr, g, x.options(),
          at::cuda::getCurrentCUDAStream());
    });
    if (done) return;
  }
  if (staged && result.defined() && (grad_x.defined() || nhwc)) {
    // One pass applies the ReLU mask for both gradients: the staged kernels
    // that copy grad_out into shared memory (grad x as a forward, the NHWC
    // weight gradient) take it as it is; the NCHW weight gradient, which
    // reads grad_out from global memory, masks it on the way when grad x is
    // not asked for. (Staging grad_out for the NCHW weight gradient too
    // would halve the rows per block: slower.)
    // The CPU and dense paths' mask too (conv.cpp), kept in x's layout.
    gm = relu_masked_grad(grad_out, result)
             .contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    res = at::Tensor();
  }
  if (grad_x.defined()) {
    bool done = false;
    if (staged) {
      // grad x as a forward convolution of the masked grad_out.
      const at::Tensor wflip = w.flip({2, 3}).contiguous();
      OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_input", [&] {
        done = try_backward_input_as_forward<scalar_t>(gm.const_data_ptr<scalar_t>(), wflip.const_data_ptr<scalar_t>(),
                                                       grad_x.mutable_data_ptr<scalar_t>(), g, nhwc,
                                                       at::cuda::getCurrentCUDAStream());
      });
    }
    if (!done) depthwise_backward_input_cuda(gm, res, w, grad_x, g, nhwc);
  }
  if (grad_w.defined() || grad_b.defined()) depthwise_backward_weight_cuda(gm, res, x, grad_w, grad_b, g, nhwc);
}

}  // namespace opforge::conv

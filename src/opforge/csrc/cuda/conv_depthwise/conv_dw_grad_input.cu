// The depthwise grad x by the gather and row kernels (conv_dw_grad_input.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "cuda/conv_depthwise/conv_dw_launch.cuh"

#include <opforge/dispatch.h>

#include "cuda/conv_depthwise/conv_dw_grad_input.cuh"

namespace opforge::conv {

void depthwise_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& w,
                                   at::Tensor& grad_x, const Geometry& g, bool nhwc) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const DwArgs a = base_args(g);
  const int64_t total = grad_x.numel();
  if (total == 0) return;
  OPFORGE_DISPATCH_FLOATING_TYPES(grad_x.scalar_type(), "conv2d_3x3_depthwise_bwd_input", [&] {
    const auto* gp = grad_out.const_data_ptr<scalar_t>();
    const auto* rp = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
    const auto* wp = w.const_data_ptr<scalar_t>();
    auto* gxp = grad_x.mutable_data_ptr<scalar_t>();
    if (g.stride == 1 && g.mult == 1) {
      if (nhwc) {
        const int64_t rows = g.N * g.H, col_blocks = (g.C + 31) / 32;
        const int64_t rows_per_split = rows_per_split_for(rows, col_blocks);
        const dim3 grid(static_cast<unsigned>(col_blocks),
                        static_cast<unsigned>((rows + rows_per_split - 1) / rows_per_split));
        dw_bwd_input_s1_nhwc<scalar_t><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, wp, gxp, a, rows_per_split);
      } else {
        const int64_t warps = g.N * g.C * g.H;
        const int64_t blocks =
            std::min<int64_t>((warps + kThreads / 32 - 1) / (kThreads / 32), 16LL * opforge::cuda::sm_count());
        dw_bwd_input_s1_nchw<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gp, rp, wp, gxp, a);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    const int64_t blocks = opforge::cuda::grid_for(total, kThreads);
    const int S = static_cast<int>(g.stride);
    // int32 indices when every offset (and the grid-stride step past the end) fits.
    const int64_t largest = std::max(total, grad_out.numel()) + blocks * kThreads;
    if (largest <= INT32_MAX && g.K * 9 <= INT32_MAX) {
      const auto t32 = static_cast<int32_t>(total);
      if (nhwc)
        dw_bwd_input<scalar_t, true, int32_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, t32);
      else
        dw_bwd_input<scalar_t, false, int32_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, t32);
    } else {
      if (nhwc)
        dw_bwd_input<scalar_t, true, int64_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, total);
      else
        dw_bwd_input<scalar_t, false, int64_t><<<blocks, kThreads, 0, stream>>>(gp, rp, wp, gxp, a, S, total);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace opforge::conv

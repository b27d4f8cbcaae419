// Launcher of the fused NHWC depthwise backward (conv_dw_fused.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "cuda/conv_depthwise/conv_dw_launch.cuh"

#include <ATen/ops/empty.h>

#include "cuda/conv_depthwise/conv_dw_fused.cuh"

namespace opforge::conv {

template <typename scalar_t>
bool try_backward_fused_nhwc(const scalar_t* gp, const scalar_t* rp, const scalar_t* xp, const scalar_t* wp,
                             scalar_t* gxp, scalar_t* gwp, scalar_t* gbp, const Geometry& g,
                             const at::TensorOptions& opts, cudaStream_t stream) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if constexpr (s == 8) {
    return false;
  } else {
    DwS1NhwcArgs a;
    int threads;
    // 16-row tiles for the half types, 8 for float32: three staged tensors
    // per block.
    if (g.pad != 1 || !plan_nhwc_s1(g, s, xp, gxp, s == 2 ? 16 : 8, a, threads) ||
        !opforge::cuda::is_aligned(gp, a.LB) || (rp != nullptr && !opforge::cuda::is_aligned(rp, a.LB)))
      return false;
    TORCH_INTERNAL_ASSERT(threads <= kFusedThreads);
    const size_t stage = (rp != nullptr ? 3 : 2) * nhwc_s1_stage_bytes(a, s);
    const size_t smem = std::max(stage, static_cast<size_t>(threads) * 10 * 4 * sizeof(float));
    at::Tensor part;
    int splits = 1;
    auto launch = [&](auto kernel) {
      set_smem(kernel, smem);
      splits = resident_splits(kernel, threads, smem, a.chunks, g.N * a.tiles_h * a.tiles_w);
      part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
      kernel<<<dim3(static_cast<unsigned>(a.chunks), static_cast<unsigned>(splits)), threads, smem, stream>>>(
          gp, rp, xp, wp, gxp, part.mutable_data_ptr<float>(), a, splits);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    with_nhwc_s1_consts(1, a.LB, [&](auto, auto lb) {
      constexpr int LB = decltype(lb)::value;
      if (rp != nullptr)
        launch(dw_bwd_fused_nhwc_s1<scalar_t, LB, true>);
      else
        launch(dw_bwd_fused_nhwc_s1<scalar_t, LB, false>);
    });
    finish_weight_sums<scalar_t>(part.const_data_ptr<float>(), gwp, gbp, g.C, splits, stream);
    return true;
  }
}

#define OPFORGE_DW_FUSED(T)                                                                                     \
  template bool try_backward_fused_nhwc<T>(const T*, const T*, const T*, const T*, T*, T*, T*, const Geometry&, \
                                           const at::TensorOptions&, cudaStream_t);
OPFORGE_DW_INSTANTIATE(OPFORGE_DW_FUSED)
#undef OPFORGE_DW_FUSED

}  // namespace opforge::conv

// Launchers of the NHWC depthwise forward kernels (conv_dw_forward_nhwc.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "cuda/conv_depthwise/conv_dw_launch.cuh"
#include "cuda/conv_depthwise/conv_dw_forward_nhwc.cuh"

namespace opforge::conv {

template <typename scalar_t>
void launch_forward_nhwc(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* out, const DwArgs& a, int V,
                         int S, int64_t blocks, size_t smem, cudaStream_t stream) {
  with_forward_vec<scalar_t>(V, [&](auto v) {
    constexpr int kV = decltype(v)::value;
    auto kernel = S == 1 ? dw_fwd_nhwc<scalar_t, kV, 1> : dw_fwd_nhwc<scalar_t, kV, 2>;
    set_smem(kernel, smem);
    kernel<<<blocks, kThreads, smem, stream>>>(x, w, b, out, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
bool try_forward_nhwc_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         Activation act, cudaStream_t stream) {
  if constexpr (sizeof(scalar_t) == 8) {
    return false;
  } else {
    DwS1NhwcArgs a;
    int threads;
    // 32 rows for the half types (their tile is half the bytes), 16 for
    // float32 (docs/ops/conv.md, Design notes).
    if (!plan_nhwc_s1(g, sizeof(scalar_t), xp, op, sizeof(scalar_t) == 2 ? 32 : 16, a, threads)) return false;
    a.act = act;
    const int64_t blocks = g.N * a.tiles_h * a.tiles_w * a.chunks;
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    const size_t smem = nhwc_s1_stage_bytes(a, sizeof(scalar_t));
    with_nhwc_s1_consts(g.pad, a.LB, [&](auto pad, auto lb) {
      auto kernel = dw_fwd_nhwc_s1<scalar_t, decltype(pad)::value, decltype(lb)::value>;
      set_smem(kernel, smem);
      kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(xp, wp, bp, op, a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return true;
  }
}

template <typename scalar_t>
bool try_forward_nhwc_direct(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op,
                             const Geometry& g, Activation act, cudaStream_t stream) {
  NchwDirectPlan plan;
  size_t smem = 0;
  if (!plan_nhwc_direct(g, sizeof(scalar_t), sizeof(at::opmath_type<scalar_t>), xp, op, plan, smem)) return false;
  plan.a.act = act;
  const unsigned blocks = (plan.a.items + kThreads - 1) / kThreads;
  auto launch = [&](auto v, auto s) {
    auto kernel = dw_fwd_nhwc_direct<scalar_t, decltype(v)::value, decltype(s)::value>;
    kernel<<<blocks, kThreads, smem, stream>>>(xp, wp, bp, op, plan.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  with_forward_vec<scalar_t>(plan.V, [&](auto v) {
    if (g.stride == 1) {
      launch(v, std::integral_constant<int, 1>{});
    } else {
      launch(v, std::integral_constant<int, 2>{});
    }
  });
  return true;
}

#define OPFORGE_DW_FORWARD_NHWC(T)                                                                                   \
  template void launch_forward_nhwc<T>(const T*, const T*, const T*, T*, const DwArgs&, int, int, int64_t, size_t,   \
                                       cudaStream_t);                                                                \
  template bool try_forward_nhwc_s1<T>(const T*, const T*, const T*, T*, const Geometry&, Activation, cudaStream_t); \
  template bool try_forward_nhwc_direct<T>(const T*, const T*, const T*, T*, const Geometry&, Activation, cudaStream_t);
OPFORGE_DW_INSTANTIATE(OPFORGE_DW_FORWARD_NHWC)
#undef OPFORGE_DW_FORWARD_NHWC

}  // namespace opforge::conv

// Launchers of the NCHW depthwise forward kernels (conv_dw_forward_nchw.cuh).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "cuda/conv_depthwise/conv_dw_launch.cuh"
#include "cuda/conv_depthwise/conv_dw_forward_nchw.cuh"

namespace opforge::conv {

template <typename scalar_t>
void launch_forward_nchw(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* out, const DwArgs& a, int V,
                         int S, int64_t blocks, size_t smem, cudaStream_t stream) {
  with_forward_vec<scalar_t>(V, [&](auto v) {
    constexpr int kV = decltype(v)::value;
    auto kernel = S == 1 ? dw_fwd_nchw<scalar_t, kV, 1> : dw_fwd_nchw<scalar_t, kV, 2>;
    set_smem(kernel, smem);
    kernel<<<blocks, kThreads, smem, stream>>>(x, w, b, out, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
bool try_forward_nchw_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         Activation act, cudaStream_t stream) {
  if constexpr (sizeof(scalar_t) == 8) {
    return false;
  } else {
    NchwS1Plan plan;
    if (!plan_nchw_s1(g, sizeof(scalar_t), xp, op, false, plan)) return false;
    plan.a.act = act;
    const int64_t blocks = (plan.a.planes + plan.a.PB - 1) / plan.a.PB * plan.a.bands;
    TORCH_CHECK(blocks <= INT32_MAX, "opforge.conv2d_3x3: too many tiles for one launch");
    const size_t smem = nchw_s1_stage_bytes(plan.a, sizeof(scalar_t));
    with_nchw_s1_consts<scalar_t>(plan.V, g.pad, [&](auto v, auto pad) {
      auto kernel = dw_fwd_nchw_s1<scalar_t, decltype(v)::value, decltype(pad)::value>;
      set_smem(kernel, smem);
      kernel<<<static_cast<unsigned>(blocks), plan.threads, smem, stream>>>(xp, wp, bp, op, plan.a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return true;
  }
}

template <typename scalar_t>
bool try_forward_nchw_direct(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op,
                             const Geometry& g, Activation act, cudaStream_t stream) {
  NchwDirectPlan plan;
  if (!plan_nchw_direct(g, sizeof(scalar_t), op, plan)) return false;
  plan.a.act = act;
  const unsigned blocks = (plan.a.items + kThreads - 1) / kThreads;
  auto launch = [&](auto v, auto s) {
    auto kernel = dw_fwd_nchw_direct<scalar_t, decltype(v)::value, decltype(s)::value>;
    kernel<<<blocks, kThreads, 0, stream>>>(xp, wp, bp, op, plan.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto with_stride = [&](auto v) {
    if (g.stride == 1) {
      launch(v, std::integral_constant<int, 1>{});
    } else {
      launch(v, std::integral_constant<int, 2>{});
    }
  };
  if constexpr (sizeof(scalar_t) == 2) {
    if (plan.V == 8) {
      with_stride(std::integral_constant<int, 8>{});
      return true;
    }
  }
  if (plan.V == 4) {
    with_stride(std::integral_constant<int, 4>{});
  } else if (plan.V == 2) {
    with_stride(std::integral_constant<int, 2>{});
  } else {
    with_stride(std::integral_constant<int, 1>{});
  }
  return true;
}

#define OPFORGE_DW_FORWARD_NCHW(T)                                                                                   \
  template void launch_forward_nchw<T>(const T*, const T*, const T*, T*, const DwArgs&, int, int, int64_t, size_t,   \
                                       cudaStream_t);                                                                \
  template bool try_forward_nchw_s1<T>(const T*, const T*, const T*, T*, const Geometry&, Activation, cudaStream_t); \
  template bool try_forward_nchw_direct<T>(const T*, const T*, const T*, T*, const Geometry&, Activation, cudaStream_t);
OPFORGE_DW_INSTANTIATE(OPFORGE_DW_FORWARD_NCHW)
#undef OPFORGE_DW_FORWARD_NCHW

}  // namespace opforge::conv

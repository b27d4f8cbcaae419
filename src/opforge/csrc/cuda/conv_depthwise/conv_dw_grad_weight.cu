// The depthwise grad weight / grad bias (conv_dw_grad_weight.cuh): the staged
// stride-1 kernels where they apply, else the per-row reductions; then the
// splits' sums.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include "cuda/conv_depthwise/conv_dw_launch.cuh"

#include <ATen/ops/empty.h>

#include <opforge/dispatch.h>

#include "cuda/conv_depthwise/conv_dw_grad_weight.cuh"

namespace opforge::conv {

template <typename scalar_t>
void finish_weight_sums(const at::opmath_type<scalar_t>* part, scalar_t* gwp, scalar_t* gbp, int64_t K, int splits,
                        cudaStream_t stream) {
  const int64_t n = K * 10;
  dw_bwd_weight_finish<scalar_t><<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(part, gwp, gbp, K, splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define OPFORGE_DW_FINISH(T) \
  template void finish_weight_sums<T>(const at::opmath_type<T>*, T*, T*, int64_t, int, cudaStream_t);
OPFORGE_DW_INSTANTIATE(OPFORGE_DW_FINISH)
#undef OPFORGE_DW_FINISH

namespace {

// The staged stride-1 weight-gradient kernels (multiplier 1, not float64,
// shapes the forward's tiling accepts), with the splits' sums finished into
// gw / gb. NCHW masks grad_out by result (rp) as it reads it; NHWC stages
// grad_out, already masked (rp null). False where they do not apply.
template <typename scalar_t>
bool try_backward_weight_s1(const scalar_t* gp, const scalar_t* rp, const scalar_t* xp, scalar_t* gwp, scalar_t* gbp,
                            const Geometry& g, bool nhwc, const at::TensorOptions& opts, cudaStream_t stream) {
  constexpr int s = static_cast<int>(sizeof(scalar_t));
  if constexpr (s == 8) {
    return false;
  } else {
    if (g.mult != 1) return false;
    at::Tensor part;
    int splits = 1;
    if (nhwc) {
      DwS1NhwcArgs a;
      int threads;
      // 16-row tiles: the grad_out tile doubles the shared memory per block.
      if (rp != nullptr || !plan_nhwc_s1(g, s, xp, gp, 16, a, threads) || !opforge::cuda::is_aligned(gp, a.LB))
        return false;
      const size_t stage = nhwc_s1_stage_bytes(a, s) + static_cast<size_t>(a.BH) * a.TW * a.CB * s;
      const size_t smem = std::max(stage, static_cast<size_t>(threads) * 10 * 4 * sizeof(float));
      with_nhwc_s1_consts(g.pad, a.LB, [&](auto pad, auto lb) {
        auto kernel = dw_bwd_weight_nhwc_s1<scalar_t, decltype(pad)::value, decltype(lb)::value>;
        set_smem(kernel, smem);
        splits = resident_splits(kernel, threads, smem, a.chunks, g.N * a.tiles_h * a.tiles_w);
        part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
        kernel<<<dim3(static_cast<unsigned>(a.chunks), static_cast<unsigned>(splits)), threads, smem, stream>>>(
            xp, gp, part.mutable_data_ptr<float>(), a, splits);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      NchwS1Plan plan;
      if (!plan_nchw_s1(g, s, xp, gp, true, plan)) return false;
      const size_t vb = static_cast<size_t>(plan.V) * s;
      const bool vec_g = g.Wo % plan.V == 0 && opforge::cuda::is_aligned(gp, vb) &&
                         (rp == nullptr || opforge::cuda::is_aligned(rp, vb));
      const size_t smem = nchw_s1_stage_bytes(plan.a, s);
      const int64_t tiles = (g.N + plan.a.PB - 1) / plan.a.PB * plan.a.bands;
      with_nchw_s1_consts<scalar_t>(plan.V, g.pad, [&](auto v, auto pad) {
        auto kernel = dw_bwd_weight_nchw_s1<scalar_t, decltype(v)::value, decltype(pad)::value>;
        set_smem(kernel, smem);
        splits = resident_splits(kernel, plan.threads, smem, g.C, tiles);
        part = at::empty({g.C, splits, 10}, opts.dtype(at::kFloat));
        kernel<<<dim3(static_cast<unsigned>(g.C), static_cast<unsigned>(splits)), plan.threads, smem, stream>>>(
            xp, gp, rp, part.mutable_data_ptr<float>(), plan.a, splits, vec_g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    finish_weight_sums<scalar_t>(part.const_data_ptr<float>(), gwp, gbp, g.C, splits, stream);
    return true;
  }
}

}  // namespace

void depthwise_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                                    at::Tensor& grad_w, at::Tensor& grad_b, const Geometry& g, bool nhwc) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const DwArgs a = base_args(g);
  const int S = static_cast<int>(g.stride);
  OPFORGE_DISPATCH_FLOATING_TYPES(x.scalar_type(), "conv2d_3x3_depthwise_bwd_weight", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto* gp = grad_out.const_data_ptr<scalar_t>();
    const auto* rp = result.defined() ? result.const_data_ptr<scalar_t>() : nullptr;
    const auto* xp = x.const_data_ptr<scalar_t>();
    auto* gwp = grad_w.defined() ? grad_w.mutable_data_ptr<scalar_t>() : nullptr;
    auto* gbp = grad_b.defined() ? grad_b.mutable_data_ptr<scalar_t>() : nullptr;
    if (g.stride == 1 && try_backward_weight_s1<scalar_t>(gp, rp, xp, gwp, gbp, g, nhwc, x.options(), stream)) return;
    const int64_t rows = g.N * g.Ho;
    const int64_t col_blocks = nhwc ? (g.K + 31) / 32 : g.K;
    const int64_t rows_per_split = rows_per_split_for(rows, col_blocks);
    const int splits = static_cast<int>(std::max<int64_t>(1, (rows + rows_per_split - 1) / rows_per_split));
    at::Tensor part = at::empty({g.K, splits, 10}, x.options().dtype(at::toOpMathType(x.scalar_type())));
    auto* pp = part.mutable_data_ptr<opmath_t>();
    if (nhwc) {
      const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits));
      if (S == 1)
        dw_bwd_weight_nhwc<scalar_t, 1><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, xp, pp, a, splits, rows_per_split);
      else
        dw_bwd_weight_nhwc<scalar_t, 2><<<grid, dim3(32, 8), 0, stream>>>(gp, rp, xp, pp, a, splits, rows_per_split);
    } else {
      TORCH_CHECK(g.K <= INT32_MAX, "opforge._conv2d_3x3_backward: too many channels");
      const dim3 grid(static_cast<unsigned>(g.K), static_cast<unsigned>(splits));
      dw_bwd_weight_nchw<scalar_t><<<grid, kThreads, 0, stream>>>(gp, rp, xp, pp, a, S, splits, rows_per_split);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finish_weight_sums<scalar_t>(pp, gwp, gbp, g.K, splits, stream);
  });
}

}  // namespace opforge::conv

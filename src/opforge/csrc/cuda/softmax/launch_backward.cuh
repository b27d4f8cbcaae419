// The launch template of the softmax backward row kernels (inner-most dim):
// the plan for the rows, then the kernel built for it (bwd_cluster_kernel
// for large clusters, else bwd_rows_kernel). Each softmax_bwd_<dtype>.cu
// instantiates it for one dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <opforge/cuda_vec.cuh>
#include <opforge/cuda_launch.cuh>

#include "backward_rows.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

template <typename T, sm::Mode MODE>
void backward_rows_impl(const sm::BwdArgs& a, const at::Tensor& t, const PlanRequest* req) {
  using A = Acc<T>;
  constexpr int VW = opforge::cuda::vec_width<T>();
  const bool vec = a.K % VW == 0 && opforge::cuda::is_aligned(a.grad, 16) && opforge::cuda::is_aligned(a.out, 16) &&
                   opforge::cuda::is_aligned(a.grad_in, 16);
  auto go = [&](auto vconst) {
    constexpr int V = decltype(vconst)::value;
    using B = Budget<T, 2, sm::Mode::Softmax>;
    constexpr int ITMAX = B::template itmax<V>();
    // Rows split over a cluster hold y only (bwd_cluster_kernel): the
    // forward's budget.
    constexpr int ITCLUSTER = kClusterBackward<T, V, 4> ? Budget<T, 1, sm::Mode::Softmax>::template itmax<V>() : ITMAX;
    Plan p = resolve_plan<B, V>(req, a.K, 2, false, ITCLUSTER);
    if (p.kind == Kind::Cluster && (p.nchunks > kBothArraysMaxCluster || p.it > ITMAX)) {
      bool launched = false;
      with_iters<ITCLUSTER>(p.it, [&](auto itconst) {
        constexpr int IT = decltype(itconst)::value;
        if constexpr (kClusterBackward<T, V, IT>) {
          const auto kernel = bwd_cluster_kernel<T, V, IT, MODE>;
          if (cluster_launchable(kernel, p.nchunks, p.block)) {
            run_plan<A>(p, kernel, a, a.outer, a.K, 2 * sizeof(T), 1, t.options());
            launched = true;
          }
        }
      });
      if (launched) return;
    }
    p = within_budget(p, a.K, V, ITMAX);  // fewer vectors per thread, or the split where clusters fail
    with_iters<ITMAX>(p.it, [&](auto itconst) {
      constexpr int IT = decltype(itconst)::value;
      run_plan<A>(p, bwd_rows_kernel<T, V, IT, MODE>, a, a.outer, a.K, 2 * sizeof(T), 1, t.options());
    });
  };
  if (vec) {
    go(std::integral_constant<int, VW>{});
  } else {
    go(std::integral_constant<int, 1>{});
  }
}

}  // namespace
}  // namespace opforge::softmax::gpu

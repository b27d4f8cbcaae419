// The launch template of the softmax forward row kernels (inner-most dim):
// the plan for the rows, then the kernel built for it. Each
// softmax_fwd_<dtype>.cu instantiates it for one dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <opforge/cuda_vec.cuh>
#include <opforge/cuda_launch.cuh>

#include "forward_cluster.cuh"
#include "launch.cuh"
#include "launchers.h"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

template <typename T, sm::Mode MODE>
void forward_rows_impl(const sm::FwdArgs& a, const at::Tensor& x, const PlanRequest* req) {
  using A = Acc<T>;
  constexpr int VW = opforge::cuda::vec_width<T>();
  const bool vec = a.K % VW == 0 && opforge::cuda::is_aligned(a.in, 16) && opforge::cuda::is_aligned(a.out, 16);
  auto go = [&](auto vconst) {
    constexpr int V = decltype(vconst)::value;
    using B = Budget<T, 1, MODE>;
    constexpr int ITMAX = B::template itmax<V>();
    Plan p = resolve_plan<B, V>(req, a.K, 1, kResident<T, V, MODE>);
    with_iters<ITMAX>(p.it, [&](auto itconst) {
      constexpr int IT = decltype(itconst)::value;
      if (p.kind == Kind::Resident) {
        if constexpr (kResident<T, V, MODE>) {
          if (run_resident(p, fwd_resident_kernel<T, V, IT, MODE>, a, a.outer, size_t{16} * IT)) return;
        }
        p.kind = p.nchunks > 1 ? Kind::Cluster : Kind::Rows;  // run_plan falls back to the split if need be
      }
      if constexpr (kStaged<T, V, MODE>) {
        if (p.kind == Kind::Cluster && run_staged(p, fwd_staged_kernel<T, V, IT, MODE>, a, a.outer, size_t{16} * IT)) {
          return;
        }
      }
      run_plan<A>(p, fwd_rows_kernel<T, V, IT, MODE>, a, a.outer, a.K, sizeof(T), 2, x.options());
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

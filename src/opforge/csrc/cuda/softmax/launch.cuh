// Host launch templates of the softmax row kernels: compile-time vectors
// per thread and mode from runtime ones, cluster launches, and a plan run
// as one launch per batch of rows (or two, for the two-pass split).
// Included by the .cu files that instantiate the kernels.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <type_traits>

#include "occupancy.h"
#include "plan.h"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

// Calls f(std::integral_constant<int, IT>) for a runtime IT in {1, 2, 4, 8, 16}
// (IT <= ITMAX).
template <int ITMAX, typename F>
void with_iters(int it, F&& f) {
  switch (it) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      if constexpr (ITMAX >= 2) {
        f(std::integral_constant<int, 2>{});
        break;
      }
      [[fallthrough]];
    case 4:
      if constexpr (ITMAX >= 4) {
        f(std::integral_constant<int, 4>{});
        break;
      }
      [[fallthrough]];
    case 8:
      if constexpr (ITMAX >= 8) {
        f(std::integral_constant<int, 8>{});
        break;
      }
      [[fallthrough]];
    default:
      if constexpr (ITMAX >= 16) {
        f(std::integral_constant<int, 16>{});
      } else {
        TORCH_INTERNAL_ASSERT(false);
      }
  }
}

// Calls f(std::integral_constant<sm::Mode, MODE>) for a runtime mode.
template <typename F>
void with_mode(sm::Mode mode, F&& f) {
  switch (mode) {
    case sm::Mode::Softmax:
      f(std::integral_constant<sm::Mode, sm::Mode::Softmax>{});
      break;
    case sm::Mode::LogSoftmax:
      f(std::integral_constant<sm::Mode, sm::Mode::LogSoftmax>{});
      break;
    case sm::Mode::ScaledMasked:
      f(std::integral_constant<sm::Mode, sm::Mode::ScaledMasked>{});
      break;
  }
}

// max_active_clusters (occupancy.h) for a kernel.
template <typename Kernel>
int active_clusters(Kernel kernel, int c, int block, size_t smem = 0) {
  return max_active_clusters(reinterpret_cast<const void*>(kernel), c, block, smem);
}

template <typename Kernel>
bool cluster_launchable(Kernel kernel, int c, int block) {
  return active_clusters(kernel, c, block) > 0;
}

// Launches `kernel` on `grid` in clusters of grid.x blocks, with `smem`
// bytes of dynamic shared memory per block.
template <typename Kernel, typename... Args>
void launch_clusters(Kernel kernel, dim3 grid, int block, size_t smem, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(block, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute at[2];
  cfg.attrs = at;
  cfg.numAttrs = cluster_attributes(at, static_cast<int>(grid.x));
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// Calls launch(grid, r0, r1) for a cluster of p.nchunks blocks per row over
// rows [r0, r1), in launches of at most 65535 rows (grid.y's limit).
template <typename F>
void for_cluster_launches(const Plan& p, int64_t rows, F launch) {
  for (int64_t r0 = 0; r0 < rows; r0 += 65535) {
    const int64_t n = std::min<int64_t>(rows - r0, 65535);
    launch(dim3(static_cast<unsigned>(p.nchunks), static_cast<unsigned>(n), 1), r0, r0 + n);
  }
}

// Launches kernel(args..., G, phase, row0, rows, chunk, partials, nchunks)
// over all rows per the plan: one launch per batch of rows for Rows and
// Cluster (phase 0 / 3); two per batch for Split (phases 1 and 2), batches
// sized to half the L2 cache so the second pass re-reads from L2.
template <typename A, typename Kernel, typename Args>
void run_plan(Plan p, Kernel kernel, const Args& args, int64_t rows, int64_t K, int64_t bytes_per_elem,
              int partial_width, const c10::TensorOptions& opts) {
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.kind == Kind::Rows) {
    const int64_t rows_per_block = p.block / p.G;
    const int64_t max_rows = int64_t{1 << 30} * rows_per_block;
    for (int64_t r0 = 0; r0 < rows; r0 += max_rows) {
      const int64_t n = std::min(rows - r0, max_rows);
      const dim3 grid(static_cast<unsigned>(ceil_div(n, rows_per_block)));
      kernel<<<grid, p.block, 0, stream>>>(args, p.G, 0, r0, r0 + n, p.chunk, static_cast<A*>(nullptr), p.nchunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  if (p.kind == Kind::Cluster && !cluster_launchable(kernel, p.nchunks, p.block)) p.kind = Kind::Split;
  if (p.kind == Kind::Cluster) {
    for_cluster_launches(p, rows, [&](dim3 grid, int64_t r0, int64_t r1) {
      launch_clusters(kernel, grid, p.block, 0, args, p.G, 3, r0, r1, p.chunk, static_cast<A*>(nullptr), p.nchunks);
    });
    return;
  }
  const int64_t l2 = std::max<int64_t>(at::cuda::getCurrentDeviceProperties()->l2CacheSize, 1 << 20);
  const int64_t row_bytes = K * bytes_per_elem;
  const int64_t batch =
      std::max<int64_t>(1, std::min<int64_t>({rows, int64_t{65535}, (l2 / 2) / std::max<int64_t>(row_bytes, 1)}));
  at::Tensor ws = at::empty({batch * p.nchunks * partial_width}, opts.dtype(c10::CppTypeToScalarType<A>::value));
  A* partials = ws.mutable_data_ptr<A>();
  for (int64_t r0 = 0; r0 < rows; r0 += batch) {
    const int64_t n = std::min(batch, rows - r0);
    const dim3 grid(static_cast<unsigned>(p.nchunks), static_cast<unsigned>(n));
    for (int phase = 1; phase <= 2; ++phase) {
      kernel<<<grid, p.block, 0, stream>>>(args, p.G, phase, r0, r0 + n, p.chunk, partials, p.nchunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// Launches the resident-cluster forward (Kind::Resident): as many clusters as
// the GPU runs at once, at most one per row. False, launching nothing,
// where the GPU runs none.
// stage_bytes: the shared-memory stage per thread.
template <typename Kernel, typename Args>
bool run_resident(const Plan& p, Kernel kernel, const Args& args, int64_t rows, size_t stage_bytes) {
  const size_t smem = stage_bytes * p.block;
  const int n = active_clusters(kernel, p.nchunks, p.block, smem);
  if (n <= 0) return false;
  const auto clusters = static_cast<unsigned>(std::min<int64_t>(rows, n));
  launch_clusters(kernel, dim3(static_cast<unsigned>(p.nchunks), clusters, 1), p.block, smem, args, p.G, rows, p.chunk);
  return true;
}

// Launches the shared-memory forward of rows split over a cluster
// (fwd_staged_kernel): a cluster per row, stage_bytes of shared memory per
// thread. False, launching nothing, where the GPU runs no such cluster.
template <typename Kernel, typename Args>
bool run_staged(const Plan& p, Kernel kernel, const Args& args, int64_t rows, size_t stage_bytes) {
  const size_t smem = stage_bytes * p.block;
  if (active_clusters(kernel, p.nchunks, p.block, smem) <= 0) return false;
  for_cluster_launches(p, rows, [&](dim3 grid, int64_t r0, int64_t r1) {
    launch_clusters(kernel, grid, p.block, smem, args, p.G, r0, r1, p.chunk);
  });
  return true;
}

}  // namespace
}  // namespace opforge::softmax::gpu

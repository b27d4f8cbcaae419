// Cluster launch attributes and the cluster occupancy cache of the softmax
// kernels (see occupancy.h).
#include "occupancy.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

namespace opforge::softmax::gpu {

int cluster_attributes(cudaLaunchAttribute (&at)[2], int c) {
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = c;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  at[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
  return 2;
}

// One cache for every kernel, keyed by the kernel's address.
int max_active_clusters(const void* kernel, int c, int block, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int, size_t>, int> known;
  const int dev = c10::cuda::current_device();
  const auto key = std::make_tuple(kernel, c, block, dev, smem);
  std::lock_guard<std::mutex> lock(mu);
  auto hit = known.find(key);
  if (hit != known.end()) return hit->second;
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  int n = 0;
  if (attr.ptxVersion >= 90) {
    if (c > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    if (smem > 0) {
      // Past 48 KB a kernel must opt in (raised, never lowered: another block
      // size may have asked for more); the carveout gives shared memory the
      // most of each SM's L1, which these kernels read each row through once.
      const int want = std::max(static_cast<int>(smem), attr.maxDynamicSharedSizeBytes);
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, want) != cudaSuccess ||
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
        (void)cudaGetLastError();
        known.emplace(key, 0);
        return 0;
      }
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(c, 1, 1);
    cfg.blockDim = dim3(block, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[2];
    cfg.attrs = at;
    cfg.numAttrs = cluster_attributes(at, c);
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
    (void)cudaGetLastError();  // a refused query leaves no sticky error behind
  }
  known.emplace(key, n);
  return n;
}

}  // namespace opforge::softmax::gpu

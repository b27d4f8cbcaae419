// Cluster launches of the softmax kernels, host side: the launch attributes
// of a cluster launch, and how many clusters of a kernel the GPU runs at
// once (cached). Host only (the CUDA runtime API, no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace opforge::softmax::gpu {

// The launch attributes of a cluster launch, filled into `at`: c blocks per
// cluster, and the load-balancing scheduling policy (faster for clusters of
// 16 blocks, the same elsewhere). Returns how many it filled.
int cluster_attributes(cudaLaunchAttribute (&at)[2], int c);

// How many clusters of c blocks of `block` threads of `kernel` the current
// GPU runs at once; 0 where it runs none: clusters need sm_90 code (they are
// compiled out below that) and a GPU that can place them. Asked once per
// kernel, cluster size, block size and device.
// smem: dynamic shared memory per block (the kernel is allowed as much).
int max_active_clusters(const void* kernel, int c, int block, size_t smem = 0);

}  // namespace opforge::softmax::gpu

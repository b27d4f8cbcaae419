// Thread block cluster primitives of the softmax kernels (sm_90): the split
// cluster barrier, the one-shot exchange of a few values per block through
// distributed shared memory (st.async counted by an mbarrier), and the
// (max, sum of exp) combination built on it.
#pragma once

#include <cooperative_groups.h>

#include <opforge/cuda_async.cuh>

#include "device_math.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;
using opforge::cuda::smem_u32;  // shared-state-space addresses (mbarrier, mapa, st.async)

// Thread block clusters (distributed shared memory) exist from sm_90 on; the
// host only plans a cluster launch for such GPUs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define OPFORGE_SOFTMAX_CLUSTERS 1
#else
#define OPFORGE_SOFTMAX_CLUSTERS 0
#endif

// The cluster barrier in halves (sm_90). Every thread of every block of the
// cluster arrives once and waits once per barrier phase. A cluster kernel
// arrives (relaxed: it publishes nothing) as it starts and completes that
// phase only when it first writes another block's shared memory: by then
// every block of the cluster has started, which distributed shared memory
// needs, and the wait is long over. The plain arrive releases the thread's
// writes (distributed shared memory included) to every thread that waits on
// that phase.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if OPFORGE_SOFTMAX_CLUSTERS
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if OPFORGE_SOFTMAX_CLUSTERS
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// Blocks in this block's cluster (1 without clusters).
__device__ __forceinline__ unsigned cluster_blocks() {
  unsigned n = 1;
#if OPFORGE_SOFTMAX_CLUSTERS
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// The block's transaction barrier of cluster_exchange (one per kernel).
__device__ __forceinline__ uint64_t& exchange_barrier() {
  __shared__ uint64_t bar;
  return bar;
}

// Starts a kernel that calls cluster_exchange once with N values of type A
// per block: readies the block's exchange barrier to complete when every
// block's values have landed (the cluster's blocks x N x sizeof(A) bytes),
// and arrives on the cluster barrier (see cluster_arrive_relaxed), which
// also publishes the barrier's initialisation to the other blocks.
template <typename A, int N>
__device__ __forceinline__ void cluster_start() {
#if OPFORGE_SOFTMAX_CLUSTERS
  if (threadIdx.x == 0) {
    const uint32_t bar = smem_u32(&exchange_barrier());
    const uint32_t bytes = cluster_blocks() * N * sizeof(A);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar), "r"(bytes)
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#endif
  cluster_arrive_relaxed();
}

// Writes the block's N values (known to every thread) into slot [rank] of
// `slots` in every block of the cluster and arrives on the cluster barrier,
// releasing the writes; after the matching cluster_wait this block's slots
// hold every block's values. The resident clusters of fwd_resident_kernel
// exchange a pair per row this way, doing other work between the two (a
// cluster per row takes cluster_exchange, whose values wait on no cluster
// barrier). Resident clusters keep this barrier: both a relaxed arrive with
// a fence in the writing warp and per-slot-set transaction barriers
// re-armed each row were slower there (docs/ops/softmax.md, Design notes).
template <typename A, int N>
__device__ __forceinline__ void cluster_publish(const A (&mine)[N], A (&slots)[kMaxCluster][N]) {
#if OPFORGE_SOFTMAX_CLUSTERS
  cooperative_groups::cluster_group cl = cooperative_groups::this_cluster();
  if (threadIdx.x < cl.num_blocks()) {
    A* dst = cl.map_shared_rank(&slots[0][0], static_cast<int>(threadIdx.x)) + cl.block_rank() * N;
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = mine[i];
  }
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// Sends the block's N values (known to every thread) into slot
// [rank][0..N) of every block of the cluster, then waits until every block's
// values have landed in this block's slots. The values travel as
// asynchronous stores (st.async) that count their bytes off the receiving
// block's exchange barrier (see cluster_start), so a block waits for the
// data alone: no cluster barrier on the path, whose release made every
// thread of every block wait for its memory operations first (the
// "membar" stall). Each block reads only its own shared memory afterwards,
// so none has to stay alive for another's reads.
// The first wait completes the phase of the arrive in cluster_start: every
// block has started and readied its barrier before any store reaches it.
template <typename A, int N>
__device__ __forceinline__ void cluster_exchange(const A (&mine)[N], A (&slots)[kMaxCluster][N]) {
#if OPFORGE_SOFTMAX_CLUSTERS
  cluster_wait();
  const uint32_t bar = smem_u32(&exchange_barrier());
  if (threadIdx.x < cluster_blocks()) {
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    uint32_t dst, remote_bar;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem_u32(&slots[rank][0])), "r"(threadIdx.x));
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(bar), "r"(threadIdx.x));
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if constexpr (sizeof(A) == 4) {
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(dst + 4 * i),
                     "r"(__float_as_uint(mine[i])), "r"(remote_bar)
                     : "memory");
      } else {
        static_assert(sizeof(A) == 8, "float or double values");
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::"r"(dst + 8 * i),
                     "l"(__double_as_longlong(mine[i])), "r"(remote_bar)
                     : "memory");
      }
    }
  }
  uint32_t done = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
  } while (!done);
#else
  __trap();
#endif
}

// The pair a chunk contributes to its row: its max and sum of exp (an all
// -inf chunk contributes nothing).
template <typename A>
__device__ __forceinline__ void chunk_pair(A m, A s, A (&pair)[2]) {
  pair[0] = m;
  pair[1] = m == neg_inf<A>() ? A(0) : s;
}

// Combines the (max, sum of exp) pairs of every block of the cluster in
// this block's `slots`: gm = max m_i, gs = sum s_i * exp(m_i - gm). Each
// warp combines them itself (no block barrier); all threads get the result.
template <typename A>
__device__ __forceinline__ void combine_pairs(const A (&slots)[kMaxCluster][2], A& gm, A& gs) {
  const unsigned lane = threadIdx.x & 31u;
  const bool have = lane < cluster_blocks();
  const A rm = have ? slots[lane][0] : neg_inf<A>();
  const A rs = have ? slots[lane][1] : A(0);
  A mm = rm;
  for (int off = 16; off > 0; off >>= 1) mm = max_nan(mm, __shfl_xor_sync(0xffffffffu, mm, off));
  A t = rm == neg_inf<A>() ? A(0) : rs * rebase(rm, mm);
  for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
  gm = mm;
  gs = t;
}

// Combines the (max, sum of exp) of every block of the cluster (one chunk of
// the row each). Every thread of every block must call it; all get the
// result.
template <typename A>
__device__ __forceinline__ void cluster_max_sum(A m, A s, A& gm, A& gs) {
  __shared__ A slots[kMaxCluster][2];
  A mine[2];
  chunk_pair(m, s, mine);
  cluster_exchange(mine, slots);
  combine_pairs(slots, gm, gs);
}

// The sum of one value per block of the cluster (see cluster_max_sum).
template <typename A>
__device__ __forceinline__ A cluster_sum(A v) {
  __shared__ A slots[kMaxCluster][1];
  const A mine[1] = {v};
  cluster_exchange(mine, slots);
  const unsigned lane = threadIdx.x & 31u;
  A t = lane < cluster_blocks() ? slots[lane][0] : A(0);
  for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
  return t;
}

}  // namespace
}  // namespace opforge::softmax::gpu

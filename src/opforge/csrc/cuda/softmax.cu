// CUDA kernels of the softmax family.
//
// Inner-most dim (rows contiguous). Every launch follows a plan (threads per
// row, rows per block, values per thread, how a long row is split; the
// defaults in default_request come from timing every plan on an H200 with
// bench/softmax_plans.py, which runs any plan through `_softmax_plan` /
// `_softmax_backward_plan`):
//  * short rows: a warp, or a power-of-two slice of one, per row,
//    reductions by shuffles only, several rows per block;
//  * medium rows: a block per row, the row held in registers, so the input is
//    read once and the output written once; float16 and bfloat16 rows are
//    held as loaded, two values per register (kPacked), so a forward thread
//    holds 64 values in 32 registers and two 512-thread blocks fit on an
//    SM; 4- and 8-byte forward rows up to 512 threads x 64 registers of
//    values stay in one block per row;
//  * rows longer than a block, on Hopper and later: the row is split over a
//    cluster of up to 16 blocks, each holding its chunk in registers; the
//    blocks exchange their chunk's (max, sum of exp) through distributed
//    shared memory, so the input is still read once, in one launch; for
//    the float32 forward the clusters stay resident and walk the rows, each
//    block staging its chunk of the next row in shared memory while it
//    finishes the current one (fwd_resident_kernel); the float16 and
//    bfloat16 forward holds each chunk in shared memory instead of
//    registers (fwd_staged_kernel), the backward of clusters of more than 8
//    blocks holds y only and reads dy twice (bwd_cluster_kernel);
//  * longer rows still, or GPUs without clusters, with no cap: each row is
//    split into chunks of a block's capacity; pass 1 writes each chunk's
//    (max, sum of exp) to a small workspace, pass 2 combines a row's
//    partials and writes its chunk. Rows are processed in batches that fit
//    in half the L2 cache, so pass 2's re-read of the input is served by L2.
// Loads and stores are 16-byte vectors when K is a multiple of the vector
// width and the pointers are aligned, scalar otherwise; a thread issues all
// its loads before it uses any value. Row kernels are built to keep two
// 512-thread blocks per SM (64 registers) unless a thread holds 64 registers
// of values; none spills (ptxas -v).
//
// Outer dims (inner > 1): a thread per (outer, inner) column; consecutive
// threads read consecutive inner elements, so every pass is coalesced and no
// transpose copy is made. With too few columns to fill the GPU (fewer than
// 32768, and K >= 16) the dim is moved last instead (one copy each way).
//
// Current stream, device guard, launch check after every launch, no host
// synchronisation. Arithmetic in opmath (float for the half types).
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <opforge/cuda_async.cuh>
#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>
#include <opforge/dispatch.h>

#include <cooperative_groups.h>

#include <array>
#include <atomic>
#include <limits>
#include <mutex>
#include <map>
#include <tuple>
#include <type_traits>

#include "softmax_host.h"

namespace {

namespace sm = opforge::softmax;
using opforge::cuda::AlignedVec;
using opforge::cuda::smem_u32;  // shared-state-space addresses (mbarrier, mapa, st.async)

template <typename T>
using Acc = at::opmath_type<T>;

// Threads per row at most (and the launch bound): 512 threads leave 128
// registers per thread, room for 64 values held in registers without spills.
constexpr int kMaxGroup = 512;

// Most blocks in one cluster (16 needs the non-portable size, which H100 and
// H200 allow; where the GPU refuses, the split path runs instead).
constexpr int kMaxCluster = 16;

// Whether a row kernel holds a half type's values as loaded, two per
// register, instead of widened to float (16-byte vectors of float16 or
// bfloat16; every backward, the forward of softmax and log_softmax):
// half the registers for the same row, so twice the row per thread, or
// twice the resident threads per SM. Each value is widened again in every
// pass that reads it; the forward also computes exp(x - max) twice (for
// the sum, then for the output) instead of keeping it.
template <typename T, int V, int ARRAYS, sm::Mode MODE>
constexpr bool kPacked = sizeof(T) == 2 && V > 1 && (ARRAYS == 2 || MODE != sm::Mode::ScaledMasked);

// 32-bit registers of values a thread of a row kernel holds.
template <typename T, int V, int IT, int ARRAYS, sm::Mode MODE = sm::Mode::Softmax>
constexpr int value_words() {
  if constexpr (kPacked<T, V, ARRAYS, MODE>) return ARRAYS * V * IT / 2;
  return V * IT * ARRAYS * static_cast<int>(sizeof(at::opmath_type<T>) / 4);
}

// Blocks of 512 threads the row kernels are built to fit on an SM at once:
// two (64 registers per thread) when a thread holds at most 32 registers of
// values, as the common plans do, whose occupancy would otherwise halve
// for a few registers past 64; one (128 registers) beyond. The masked
// forward (mask and index arithmetic), scalar loads of unaligned rows and
// float64 each need more registers beside the values: each halves the
// values that still allow two blocks.
template <typename T, int V, int IT, int ARRAYS, sm::Mode MODE>
constexpr int rows_min_blocks() {
  const int roomy = (MODE == sm::Mode::ScaledMasked && ARRAYS == 1) + (V == 1) + (sizeof(at::opmath_type<T>) == 8);
  return value_words<T, V, IT, ARRAYS, MODE>() <= (32 >> roomy) ? 2 : 1;
}

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// The exp of an element where no row max is at hand (the outer-dim forward,
// the log_softmax backward's exp(y)): in float32 opmath (float32, float16,
// bfloat16) the hardware's exp2 approximation (__expf: relative error within
// 2 + 1.2|v| ulp, as torch.compile's generated kernels use); float64 stays
// exact. The row forward takes exp_from below.
__device__ __forceinline__ float elem_exp(float v) { return __expf(v); }
__device__ __forceinline__ double elem_exp(double v) { return exp(v); }

// The forward's exps of a row, e^(x - m) against the row's (or chunk's)
// max m. In float opmath they are taken in base 2 against the max scaled
// once, mk = m log2(e) (scaled_max, rounded once): e^(x - m) = 2^(x log2(e)
// - mk) is one FFMA and the MUFU ex2, where __expf(x - m) also takes a
// subtraction and ex2's handling of results below 2^-126 (here flushed to
// 0; the sum of a row is at least 1). Measured on an H200 (bfloat16
// forward, default plans): 4096 x 32768 83% -> 90% of the floor, 512 x
// 262144 66% -> 76%. Every exp of a row and every rescale between chunk
// maxima (rebase) takes the same rounded mk, so that rounding shifts all
// of a row's terms alike and cancels in the quotient. float64 stays exact.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float scaled_max(float m) { return __fmul_rn(m, kLog2e); }
__device__ __forceinline__ double scaled_max(double m) { return m; }
__device__ __forceinline__ float exp_from(float x, float mk) {
  float r = 0;
#if defined(__CUDA_ARCH__)
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(fmaf(x, kLog2e, -mk)));
#endif
  return r;
}
__device__ __forceinline__ double exp_from(double x, double m) { return exp(x - m); }
// e^(m - gm) for a chunk's max m and the row's gm, in the scaled terms of
// exp_from (NaN where both are +inf, as exp(inf - inf)).
__device__ __forceinline__ float rebase(float m, float gm) { return exp2f(scaled_max(m) - scaled_max(gm)); }
__device__ __forceinline__ double rebase(double m, double gm) { return exp(m - gm); }
__device__ __forceinline__ float dev_log(float v) { return logf(v); }
__device__ __forceinline__ double dev_log(double v) { return log(v); }
// log of the sum of e^(x - m) over a row, from the sum exp_from gave:
// log_softmax does not divide by the sum, so the rounding of mk would stay
// in it (sum = 2^(m log2(e) - mk) * the sum against m); the product's
// residual, exact by FMA, takes that factor out.
__device__ __forceinline__ float log_sum(float m, float sum) {
  return dev_log(sum) - fmaf(m, kLog2e, -scaled_max(m)) * 0.6931471805599453f;
}
__device__ __forceinline__ double log_sum(double, double sum) { return log(sum); }

// max that propagates NaN (as torch's reductions).
template <typename A>
__device__ __forceinline__ A max_nan(A a, A b) {
  return (a > b || a != a) ? a : b;
}
// float: one instruction from sm_80 on (max.NaN) instead of two compares and
// a select, which matters where every element goes through it.
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a > b || a != a) ? a : b;
#endif
}

// x / G and x % G for the group size G, always a power of two: shifts and
// masks rather than integer divisions by a runtime value.
__device__ __forceinline__ int div_group(int x, int G) { return x >> (__ffs(G) - 1); }
__device__ __forceinline__ int mod_group(int x, int G) { return x & (G - 1); }

struct MaxOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return max_nan(a, b);
  }
};
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a + b;
  }
};

// Reduction over a group of G threads (G a power of two, consecutive thread
// ids). Every thread of the block must call it (it may synchronise the block
// when G > 32); every thread of the group gets the result. `smem` holds 32
// values.
template <typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, int G, Op op, A* smem) {
  const int width = G < 32 ? G : 32;
  for (int off = width / 2; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  if (G <= 32) return v;
  const int warp = threadIdx.x / 32;
  __syncthreads();  // smem may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) smem[warp] = v;
  __syncthreads();
  const int nw = G / 32;
  const int first = div_group(threadIdx.x, G) * nw;
  A r = smem[first];
  for (int i = 1; i < nw; ++i) r = op(r, smem[first + i]);
  return r;
}

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
// barrier). The resident clusters measured faster with the barrier: timed
// alternately on the H200, a fence in the writing warp alone with a
// relaxed arrive was 1.5% slower, and cluster_exchange's transaction
// barriers (one per slot set, re-armed each row) 3-6% slower (float32 512 x
// 262144 301 against 294 us, 256 x 500000 336 against 316 us).
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
// thread of every block wait for its memory operations first (Nsight
// Compute: the "membar" stall, a tenth of the warps' cycles in the bfloat16
// forward). H200: bfloat16 512 x 262144 forward 163 -> 146 us, 2048 x 65536
// 157 -> 143 us, backward 241 -> 217 us, float32 backward 451 -> 440 us
// (modes timed alternately in one process). Each block reads only its own
// shared memory afterwards, so none has to stay alive for another's reads.
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

// Where a group of threads works: row `row` (valid or not), its `len`
// elements from `begin` on. A segment is never longer than a block holds
// (512 threads x 64 values), so offsets in it are 32-bit.
struct Segment {
  int64_t row;
  bool valid;
  int64_t begin;
  int len;
  int lane;  // index in the group
  // Offset in the segment of the thread's vector `it` (V elements each).
  __device__ __forceinline__ int offset(int it, int G, int V) const { return (it * G + lane) * V; }
};

// phase 0: the whole row per group (rows per block = blockDim.x / G).
// phase 1/2 (two-pass split) and 3 (cluster): blockIdx.x = chunk,
// blockIdx.y = row - row0, one group per block.
__device__ __forceinline__ Segment make_segment(int G, int phase, int64_t row0, int64_t rows, int64_t K,
                                                int64_t chunk) {
  Segment s;
  s.lane = mod_group(threadIdx.x, G);
  if (phase == 0) {
    s.row = row0 + static_cast<int64_t>(blockIdx.x) * div_group(blockDim.x, G) + div_group(threadIdx.x, G);
    s.begin = 0;
    s.len = static_cast<int>(K);
  } else {
    s.row = row0 + blockIdx.y;
    s.begin = static_cast<int64_t>(blockIdx.x) * chunk;
    s.len = static_cast<int>(min(K - s.begin, chunk));
  }
  s.valid = s.row < rows;
  return s;
}

// Whether T's values are converted to a wider opmath type when loaded.
template <typename T>
constexpr bool kWidened = !std::is_same_v<T, Acc<T>>;

// Issues the 16-byte (or scalar) loads of the segment's elements
// s.offset(it) + v of `p` (a row); ok[it] says whether vector it lies in the
// row (a valid row, at an offset below `limit`, which is at most s.len; with
// V > 1 a vector is wholly in or out, K being a multiple of V). Half types
// load all their vectors before converting any (to_opmath), so a thread's
// loads are in flight together rather than each waiting for the previous
// conversion.
template <typename T, int V, int IT>
__device__ __forceinline__ void load_raw(const T* __restrict__ p, const Segment& s, int G, int limit,
                                         AlignedVec<T, V> (&raw)[IT], bool (&ok)[IT]) {
  const T* q = p + s.begin;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int off = s.offset(it, G, V);
    ok[it] = s.valid && off < limit;
    if (ok[it]) raw[it] = opforge::cuda::load_vec<T, V>(q, off / V);
  }
}

template <typename T, int V, int IT>
__device__ __forceinline__ void to_opmath(const AlignedVec<T, V> (&raw)[IT], const bool (&ok)[IT], Acc<T> fill,
                                          Acc<T> (&vals)[IT][V]) {
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int v = 0; v < V; ++v) vals[it][v] = ok[it] ? static_cast<Acc<T>>(raw[it].val[v]) : fill;
}

// A row's values as opmath, `fill` outside it (see load_raw). float and
// double load straight into the values: no conversion to wait for, and
// fewer live registers than staging the raw vectors.
template <typename T, int V, int IT>
__device__ __forceinline__ void load_row(const T* __restrict__ p, const Segment& s, int G, int limit,
                                         Acc<T> fill, Acc<T> (&vals)[IT][V]) {
  if constexpr (kWidened<T>) {
    AlignedVec<T, V> raw[IT];
    bool ok[IT];
    load_raw<T, V, IT>(p, s, G, limit, raw, ok);
    to_opmath<T, V, IT>(raw, ok, fill, vals);
  } else {
    const T* q = p + s.begin;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      const int off = s.offset(it, G, V);
      if (s.valid && off < limit) {
        const auto vec = opforge::cuda::load_vec<T, V>(q, off / V);
#pragma unroll
        for (int v = 0; v < V; ++v) vals[it][v] = vec.val[v];
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) vals[it][v] = fill;
      }
    }
  }
}

// Stores the segment's vectors that lie in the row (a vector is wholly in
// or out, see load_raw); vec_at(it) makes the thread's vector it.
template <typename T, int V, int IT, typename F>
__device__ __forceinline__ void store_segment(T* __restrict__ p, const Segment& s, int G, F vec_at) {
  if (!s.valid) return;
  T* q = p + s.begin;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int off = s.offset(it, G, V);
    if (off < s.len) opforge::cuda::store_vec<T, V>(q, off / V, vec_at(it));
  }
}

template <typename T, int V, int IT>
__device__ __forceinline__ void store_row(T* __restrict__ p, const Segment& s, int G, const Acc<T> (&vals)[IT][V]) {
  store_segment<T, V, IT>(p, s, G, [&](int it) {
    AlignedVec<T, V> vec;
#pragma unroll
    for (int v = 0; v < V; ++v) vec.val[v] = static_cast<T>(vals[it][v]);
    return vec;
  });
}
// ------------------------------------------------------------------ forward, inner-most dim

// A segment's (max, sum of exp) -> the row's: phase 2 combines the row's
// partials in global memory (M = max m_i, S = sum s_i * exp(m_i - M)),
// phase 3 the cluster's blocks. Every thread of the block must call it.
template <typename A>
__device__ __forceinline__ void combine_chunks(A m, A sum, const Segment& s, int G, int phase, int64_t row0,
                                               const A* partials, int nchunks, A* smem, A& gm, A& gs) {
  if (phase == 2) {
    const A* p = partials + (s.row - row0) * nchunks * 2;
    gm = neg_inf<A>();
    for (int i = s.lane; i < nchunks; i += G) gm = max_nan(gm, s.valid ? p[2 * i] : neg_inf<A>());
    gm = group_reduce(gm, G, MaxOp{}, smem);
    gs = 0;
    for (int i = s.lane; i < nchunks; i += G) {
      if (s.valid && p[2 * i] != neg_inf<A>()) gs += p[2 * i + 1] * rebase(p[2 * i], gm);
    }
    gs = group_reduce(gs, G, SumOp{}, smem);
  } else {
    cluster_max_sum(m, sum, gm, gs);
  }
}

// Phase 1: this chunk's (max, sum) to the partials; an all -inf chunk
// contributes nothing.
template <typename A>
__device__ __forceinline__ void write_partial(A m, A sum, const Segment& s, int64_t row0, A* partials, int nchunks) {
  if (s.lane == 0 && s.valid) {
    A* p = partials + ((s.row - row0) * nchunks + blockIdx.x) * 2;
    p[0] = m;
    p[1] = m == neg_inf<A>() ? A(0) : sum;
  }
}

// A segment's max and sum of exp, each over the group, from its values
// (-inf past its end); the values become exp(x - max) (log_softmax keeps
// them). Every thread of the block must call it.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ void forward_stats(Acc<T> (&vals)[IT][V], const Segment& s, int G, Acc<T>* smem,
                                              Acc<T>& m, Acc<T>& sum) {
  using A = Acc<T>;
  m = neg_inf<A>();
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int v = 0; v < V; ++v) m = max_nan(m, vals[it][v]);
  m = group_reduce(m, G, MaxOp{}, smem);

  // sum of exp over the segment's elements (vectors past the end skipped;
  // a vector is wholly in or out of the row, see load_raw)
  sum = 0;
  const A mk = scaled_max(m);
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (s.offset(it, G, V) < s.len) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const A e = exp_from(vals[it][v], mk);
        sum += e;
        if constexpr (MODE != sm::Mode::LogSoftmax) vals[it][v] = e;
      }
    }
  }
  sum = group_reduce(sum, G, SumOp{}, smem);
}

// A chunk's exps, taken against its own max m, rescaled to the row's max gm
// (log_softmax holds the inputs: nothing to do). An all -inf chunk holds
// exp(-inf - -inf) = NaN: its values are 0 unless the whole row is -inf,
// where torch's NaN is right.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ void rescale_chunk(Acc<T> (&vals)[IT][V], Acc<T> m, Acc<T> gm) {
  using A = Acc<T>;
  if constexpr (MODE != sm::Mode::LogSoftmax) {
    const bool empty_chunk = m == neg_inf<A>() && gm != neg_inf<A>();
    const A r = empty_chunk ? A(0) : rebase(m, gm);
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int v = 0; v < V; ++v) vals[it][v] = empty_chunk ? A(0) : vals[it][v] * r;
  }
}

// The outputs, in place, from the values (exps against the row's max m, or
// the inputs for log_softmax) and the row's sum of exp.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ void normalize(Acc<T> (&vals)[IT][V], Acc<T> m, Acc<T> sum) {
  using A = Acc<T>;
  if constexpr (MODE == sm::Mode::ScaledMasked) {
    if (m == neg_inf<A>()) {
      // Every key masked out: zeros (documented), not NaN.
#pragma unroll
      for (int it = 0; it < IT; ++it)
#pragma unroll
        for (int v = 0; v < V; ++v) vals[it][v] = A(0);
      return;
    }
  }
  if constexpr (MODE == sm::Mode::LogSoftmax) {
    // (x - m) - log(sum): x - m is exact near the max, where m + log(sum)
    // would round at m's magnitude (offset rows, |m| in the thousands).
    const A l = log_sum(m, sum);
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int v = 0; v < V; ++v) vals[it][v] = (vals[it][v] - m) - l;
  } else {
    const A inv = A(1) / sum;
#pragma unroll
    for (int it = 0; it < IT; ++it)
#pragma unroll
      for (int v = 0; v < V; ++v) vals[it][v] *= inv;
  }
}

// From a segment's values (-inf past its end) to its outputs, in place:
// the max and the sum of exps over the row (phase 0), over the chunk then
// combined with the row's other chunks (phases 2 and 3, combine_chunks),
// and the normalisation. Phase 1 only writes the chunk's (max, sum)
// partial and returns false: nothing to store. Every thread of the block
// must call it.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ bool finish_forward(Acc<T> (&vals)[IT][V], const Segment& s, int G, int phase,
                                               int64_t row0, Acc<T>* partials, int nchunks, Acc<T>* smem) {
  using A = Acc<T>;
  A m, sum;
  forward_stats<T, V, IT, MODE>(vals, s, G, smem, m, sum);
  if (phase == 1) {
    write_partial(m, sum, s, row0, partials, nchunks);
    return false;
  }
  if (phase >= 2) {
    A gm, gs;
    combine_chunks(m, sum, s, G, phase, row0, partials, nchunks, smem, gm, gs);
    rescale_chunk<T, V, IT, MODE>(vals, m, gm);
    m = gm;
    sum = gs;
  }
  normalize<T, V, IT, MODE>(vals, m, sum);
  return true;
}

// Registers of two 2-byte values (rows held packed, kPacked): the first
// in memory in the low half. widen2 is asm volatile on purpose: the compiler
// must re-widen in every pass rather than keep the widened values alive
// between passes, which would undo the packing.
template <typename T>
__device__ __forceinline__ void widen2(uint32_t w, float& lo, float& hi) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;" : "=f"(lo), "=f"(hi) : "r"(w));
  } else {
    asm volatile("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
                 : "=f"(lo), "=f"(hi)
                 : "r"(w));
  }
#endif
}

// Rounds two floats to T (nearest even, as static_cast<T>) in one register.
template <typename T>
__device__ __forceinline__ uint32_t narrow2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  }
  return r;
#else
  const T l = static_cast<T>(lo), h = static_cast<T>(hi);
  return static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(h.x) << 16);
#endif
}

// The largest value (NaN if any) of a thread's packed words, as float:
// from sm_80 on one max per two values (max.NaN on the pairs).
template <typename T, int N>
__device__ __forceinline__ float packed_max(const uint32_t (&w)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t pm = w[0];
#pragma unroll
  for (int i = 1; i < N; ++i) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(pm) : "r"(pm), "r"(w[i]));
    } else {
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(pm) : "r"(pm), "r"(w[i]));
    }
  }
  float lo, hi;
  widen2<T>(pm, lo, hi);
  return max_nan(lo, hi);
#else
  float m = neg_inf<float>();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float lo, hi;
    widen2<T>(w[i], lo, hi);
    m = max_nan(m, max_nan(lo, hi));
  }
  return m;
#endif
}

// Adds the exps of one register's two values, against the scaled max mk
// (scaled_max), to sum: the low value first.
template <typename T>
__device__ __forceinline__ void add_packed_exps(uint32_t w, float mk, float& sum) {
  float lo, hi;
  widen2<T>(w, lo, hi);
  sum += exp_from(lo, mk);
  sum += exp_from(hi, mk);
}

// One register's two outputs from its two inputs: exp(x - m) / sum, or
// (x - m) - log(sum) for log_softmax, given m, mk = scaled_max(m),
// inv = 1 / sum and l = log_sum(m, sum) (log_softmax only).
template <typename T, sm::Mode MODE>
__device__ __forceinline__ uint32_t packed_output_word(uint32_t w, float m, float mk, float inv, float l) {
  float lo, hi;
  widen2<T>(w, lo, hi);
  if constexpr (MODE == sm::Mode::LogSoftmax) {
    return narrow2<T>((lo - m) - l, (hi - m) - l);
  } else {
    return narrow2<T>(exp_from(lo, mk) * inv, exp_from(hi, mk) * inv);
  }
}

// forward_stats for values held as loaded (kPacked): w holds the
// segment's IT vectors of V values, V / 2 registers each (-inf past the
// row); the values stay as they are.
template <typename T, int V, int IT>
__device__ __forceinline__ void packed_stats(const uint32_t (&w)[IT * V / 2], const Segment& s, int G, float* smem,
                                             float& m, float& sum) {
  constexpr int W = V / 2;  // registers per vector
  m = group_reduce(packed_max<T>(w), G, MaxOp{}, smem);
  sum = 0;
  const float mk = scaled_max(m);
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (s.offset(it, G, V) < s.len) {
#pragma unroll
      for (int k = 0; k < W; ++k) add_packed_exps<T>(w[it * W + k], mk, sum);
    }
  }
  sum = group_reduce(sum, G, SumOp{}, smem);
}

// The outputs, in place, of values held as loaded, from the row's max m and
// sum of exp: each from its input, exp(x - m) / sum (or (x - m) - log sum,
// as normalize), so chunks need no rescaling.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ void packed_outputs(uint32_t (&w)[IT * V / 2], float m, float sum) {
  const float l = MODE == sm::Mode::LogSoftmax ? log_sum(m, sum) : 0.0f;
  const float mk = scaled_max(m);
  const float inv = 1.0f / sum;
#pragma unroll
  for (int k = 0; k < IT * V / 2; ++k) w[k] = packed_output_word<T, MODE>(w[k], m, mk, inv, l);
}

// finish_forward for values held as loaded (kPacked). For a row held whole
// (phase 0) the outputs equal finish_forward's bit for bit.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ bool finish_forward_packed(uint32_t (&w)[IT * V / 2], const Segment& s, int G, int phase,
                                                      int64_t row0, float* partials, int nchunks, float* smem) {
  float m, sum;
  packed_stats<T, V, IT>(w, s, G, smem, m, sum);
  if (phase == 1) {
    write_partial(m, sum, s, row0, partials, nchunks);
    return false;
  }
  if (phase >= 2) combine_chunks(m, sum, s, G, phase, row0, partials, nchunks, smem, m, sum);
  packed_outputs<T, V, IT, MODE>(w, m, sum);
  return true;
}

// The bits of two -inf values of 2-byte T in one register (the packed
// forward's fill past the row).
template <typename T>
__device__ __forceinline__ uint32_t packed_neg_inf() {
  const uint32_t h = static_cast<T>(neg_inf<float>()).x;
  return h | (h << 16);
}

// The segment's vectors as loaded, V / 2 registers each, `fill` (two
// values' bits) past the row (see load_raw).
template <typename T, int V, int IT>
__device__ __forceinline__ void load_packed(const T* __restrict__ p, const Segment& s, int G, uint32_t fill,
                                            uint32_t (&w)[IT * V / 2]) {
  const T* q = p + s.begin;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int off = s.offset(it, G, V);
    if (s.valid && off < s.len) {
      const auto vec = opforge::cuda::load_vec<T, V>(q, off / V);
      memcpy(&w[it * V / 2], &vec, sizeof(vec));
    } else {
#pragma unroll
      for (int k = 0; k < V / 2; ++k) w[it * V / 2 + k] = fill;
    }
  }
}

// store_row from packed registers.
template <typename T, int V, int IT>
__device__ __forceinline__ void store_packed(T* __restrict__ p, const Segment& s, int G,
                                             const uint32_t (&w)[IT * V / 2]) {
  store_segment<T, V, IT>(p, s, G, [&](int it) {
    AlignedVec<T, V> vec;
    memcpy(&vec, &w[it * V / 2], sizeof(vec));
    return vec;
  });
}

template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 1, MODE>())) fwd_rows_kernel(sm::FwdArgs a, int G, int phase, int64_t row0,
                                                             int64_t rows, int64_t chunk, Acc<T>* partials,
                                                             int nchunks) {
  using A = Acc<T>;
  __shared__ A smem[32];
  const int64_t K = a.K;
  if (phase == 3) cluster_start<A, 2>();  // see cluster_exchange
  const Segment s = make_segment(G, phase, row0, rows, K, chunk);
  const T* x = static_cast<const T*>(a.in) + s.row * K;
  T* y = static_cast<T*>(a.out) + s.row * K;

  if constexpr (kPacked<T, V, 1, MODE>) {
    uint32_t w[IT * V / 2];
    load_packed<T, V, IT>(x, s, G, packed_neg_inf<T>(), w);
    if (finish_forward_packed<T, V, IT, MODE>(w, s, G, phase, row0, partials, nchunks, smem)) {
      store_packed<T, V, IT>(y, s, G, w);
    }
    return;
  }
  A vals[IT][V];
  int limit = s.len;  // segment offsets from here on are not read
  if constexpr (MODE == sm::Mode::ScaledMasked) {
    // Causal: keys after the query are never read.
    if (a.causal) {
      const int64_t keys = s.row % a.Lq + 1 - s.begin;
      limit = keys < 0 ? 0 : (keys < s.len ? static_cast<int>(keys) : s.len);
    }
  }
  load_row<T, V, IT>(x, s, G, limit, neg_inf<A>(), vals);

  if constexpr (MODE == sm::Mode::ScaledMasked) {
    const int64_t moff = a.mask != nullptr && s.valid ? a.mask_rows(s.row) : 0;
#pragma unroll
    for (int it = 0; it < IT; ++it) {
      if (s.valid && a.mask == nullptr && s.offset(it, G, V) + V <= limit) {
        // The whole vector lies in the row, before the causal limit: scale only.
#pragma unroll
        for (int v = 0; v < V; ++v) vals[it][v] *= static_cast<A>(a.scale);
        continue;
      }
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const int off = s.offset(it, G, V) + v;
        const int64_t j = s.begin + off;
        if (!s.valid || off >= limit) {
          vals[it][v] = neg_inf<A>();  // past the row, or a key after the query
          continue;
        }
        A t = vals[it][v] * static_cast<A>(a.scale);
        if (a.mask != nullptr) {
          if (a.mask_is_bool) {
            if (static_cast<const bool*>(a.mask)[moff + j]) t = neg_inf<A>();
          } else {
            t += static_cast<A>(static_cast<const T*>(a.mask)[moff + j]);
          }
        }
        vals[it][v] = t;
      }
    }
  }

  if (finish_forward<T, V, IT, MODE>(vals, s, G, phase, row0, partials, nchunks, smem)) store_row<T, V, IT>(y, s, G, vals);
}

// Queues the asynchronous copies (cp.async, 16 bytes each) of the segment's
// vectors of row p into this thread's slots of the shared-memory stage: slot
// it of thread t at [it][t], so a warp's copies and reads are contiguous.
// Vectors past the row are not read (the stage holds zeros there; the
// reader fills them).
template <typename T, int V, int IT>
__device__ __forceinline__ void stage_row(const T* __restrict__ p, const Segment& s, int G, uint4* stage) {
  const T* q = p + s.begin;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int off = s.offset(it, G, V);
    opforge::cuda::cp_async16(smem_u32(&stage[it * blockDim.x + threadIdx.x]), q + (off < s.len ? off : 0),
                              off < s.len);
  }
  opforge::cuda::cp_async_commit();
}

// The thread's staged vectors (stage_row) once its copies have landed, as
// opmath values, `fill` past the row.
template <typename T, int V, int IT>
__device__ __forceinline__ void unstage_values(const uint4* stage, const Segment& s, int G, Acc<T> fill,
                                               Acc<T> (&vals)[IT][V]) {
  static_assert(V * sizeof(T) == 16, "16-byte vectors");
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    AlignedVec<T, V> vec;
    const uint4 raw = stage[it * blockDim.x + threadIdx.x];
    memcpy(&vec, &raw, sizeof(vec));
    const bool in = s.offset(it, G, V) < s.len;
#pragma unroll
    for (int v = 0; v < V; ++v) vals[it][v] = in ? static_cast<Acc<T>>(vec.val[v]) : fill;
  }
}

// Whether fwd_resident_kernel is built for these rows: 4-byte types in
// 16-byte vectors (what it stages), softmax and log_softmax (the masked
// forward keeps a cluster per row). Resident clusters of 2-byte types
// measured 69% of the floor on 512 x 262144 against 67% for a cluster per
// row (widened to float, 64%), and needed more registers than the 64 that
// keep four 256-thread blocks per SM (ptxas -v: spills); allowed 128
// registers (no spills) they measured 58-61% against 67%; packed, with
// the next row staged as float32 does, 65-68% against 77% (after the FFMA
// exps). They run a cluster per row (fwd_staged_kernel, 83%), as 8-byte
// types (not measured) do.
template <typename T, int V, sm::Mode MODE>
constexpr bool kResident = MODE != sm::Mode::ScaledMasked && sizeof(T) == 4 && V * sizeof(T) == 16;

// Rows longer than a block on clusters that stay resident (Kind::Resident,
// softmax and log_softmax, 16-byte vectors): the grid holds as many
// clusters as the GPU runs at once (gridDim.y of them, a block per chunk of
// the row), and each walks the rows blockIdx.y, blockIdx.y + gridDim.y, ...
// As a block starts on a row it queues the copies of its chunk of the next
// row into shared memory (cp.async; each thread copies, and later reads,
// only its own vectors, so no block barrier guards the stage), so the next
// row streams in while this one is reduced, exchanged and written; a
// cluster per row instead leaves a block's SM without reads from its last
// load until its row is written. The cluster barrier is split (publish the
// chunk's (max, sum of exp) and arrive, then wait), and the pairs alternate
// between two slot sets: a block can be a row ahead of another, never two
// (it cannot pass the next barrier before the other has read its slots).
template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 1, MODE>()))
    fwd_resident_kernel(sm::FwdArgs a, int G, int64_t rows, int64_t chunk) {
  static_assert(kResident<T, V, MODE>, "built for 4-byte rows in 16-byte vectors (see kResident)");
  using A = Acc<T>;
  extern __shared__ uint4 stage[];  // IT x blockDim.x vectors
  __shared__ A smem[32];
  __shared__ A slots[2][kMaxCluster][2];
  cluster_arrive_relaxed();  // see cluster_exchange: waited on before the first publish
  const int64_t K = a.K;
  const Segment s = make_segment(G, 3, 0, rows, K, chunk);  // valid: gridDim.y <= rows
  // The cluster's rows: n of them, `step` elements apart (pointers advance
  // rather than being recomputed from 64-bit row numbers: fewer registers).
  const int n = static_cast<int>((rows - 1 - s.row) / gridDim.y) + 1;
  const int64_t step = static_cast<int64_t>(gridDim.y) * K;
  const T* x = static_cast<const T*>(a.in) + s.row * K;
  T* y = static_cast<T*>(a.out) + s.row * K;
  A vals[IT][V];
  load_row<T, V, IT>(x, s, G, s.len, neg_inf<A>(), vals);
  for (int k = 0; k < n; ++k, x += step, y += step) {
    const bool more = k + 1 < n;
    if (more) stage_row<T, V, IT>(x + step, s, G, stage);
    A m, sum, mine[2];
    forward_stats<T, V, IT, MODE>(vals, s, G, smem, m, sum);
    chunk_pair(m, sum, mine);
    if (k == 0) cluster_wait();
    cluster_publish(mine, slots[k & 1]);
    cluster_wait();
    A gm, gs;
    combine_pairs(slots[k & 1], gm, gs);
    rescale_chunk<T, V, IT, MODE>(vals, m, gm);
    normalize<T, V, IT, MODE>(vals, gm, gs);
    store_row<T, V, IT>(y, s, G, vals);
    if (more) {
      opforge::cuda::cp_async_wait<0>();
      unstage_values<T, V, IT>(stage, s, G, neg_inf<A>(), vals);
    }
  }
}

// Whether the forward of rows split over a cluster runs fwd_staged_kernel:
// 2-byte types held packed, in 16-byte vectors (what stage_row copies).
template <typename T, int V, sm::Mode MODE>
constexpr bool kStaged = kPacked<T, V, 1, MODE> && V * sizeof(T) == 16;

// The forward of float16 and bfloat16 rows split over a cluster (Kind::Cluster,
// kStaged): each block copies its chunk into shared memory (cp.async; each
// thread copies and reads only its own vectors, so no block barrier guards
// it) and reads it there for the max, the sum of exp and the outputs,
// instead of holding it in registers. A block of 256 threads x 64 values
// then takes 32 KB of shared memory and 40 registers a thread, so an SM keeps
// six blocks instead of the four that 64 registers allow, which hides more of
// the wait for a cluster's slowest block. Outputs are those of the register
// path bit for bit. H200, bfloat16 softmax 512 x 262144: 78% -> 83% of the
// floor (log_softmax 79% -> 84%); 1024 x 131072 80% -> 84%, 2048 x 65536
// 80% -> 85%, 400 x 300000 (clusters of 512 threads x 64 values) 67% ->
// 77%; float16 alike.
template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, IT <= 8 ? 3 : 1)
    fwd_staged_kernel(sm::FwdArgs a, int G, int64_t row0, int64_t rows, int64_t chunk) {
  static_assert(kStaged<T, V, MODE>, "built for packed 2-byte rows in 16-byte vectors (see kStaged)");
  extern __shared__ uint4 stage[];  // IT x blockDim.x vectors
  __shared__ float smem[32];
  cluster_start<float, 2>();  // see cluster_exchange
  const Segment s = make_segment(G, 3, row0, rows, a.K, chunk);
  const T* x = static_cast<const T*>(a.in) + s.row * a.K;
  T* y = static_cast<T*>(a.out) + s.row * a.K;
  stage_row<T, V, IT>(x, s, G, stage);
  opforge::cuda::cp_async_wait<0>();
  const uint4* mine = stage + threadIdx.x;
  float m = neg_inf<float>();
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (s.offset(it, G, V) < s.len) {
      const uint4 r = mine[it * blockDim.x];
      const uint32_t w4[4] = {r.x, r.y, r.z, r.w};
      m = max_nan(m, packed_max<T>(w4));
    }
  }
  m = group_reduce(m, G, MaxOp{}, smem);
  float mk = scaled_max(m);
  float sum = 0;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    if (s.offset(it, G, V) < s.len) {
      const uint4 r = mine[it * blockDim.x];
      const uint32_t w4[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) add_packed_exps<T>(w4[k], mk, sum);
    }
  }
  sum = group_reduce(sum, G, SumOp{}, smem);
  float gm, gs;
  cluster_max_sum(m, sum, gm, gs);
  const float l = MODE == sm::Mode::LogSoftmax ? log_sum(gm, gs) : 0.0f;
  mk = scaled_max(gm);
  const float inv = 1.0f / gs;
  T* q = y + s.begin;
#pragma unroll
  for (int it = 0; it < IT; ++it) {
    const int off = s.offset(it, G, V);
    if (off < s.len) {
      const uint4 r = mine[it * blockDim.x];
      uint32_t w4[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) w4[k] = packed_output_word<T, MODE>(w4[k], gm, mk, inv, l);
      AlignedVec<T, V> vec;
      memcpy(&vec, w4, sizeof(vec));
      opforge::cuda::store_vec<T, V>(q, off / V, vec);
    }
  }
}

// ------------------------------------------------------------------ backward, inner-most dim

// A segment's dy (g) and y (o) as opmath, 0 outside the row. Half types
// issue both rows' loads before converting any.
template <typename T, int V, int IT>
__device__ __forceinline__ void load_grad_out(const T* __restrict__ gp, const T* __restrict__ op, const Segment& s,
                                              int G, Acc<T> (&g)[IT][V], Acc<T> (&o)[IT][V]) {
  using A = Acc<T>;
  if constexpr (kWidened<T>) {
    AlignedVec<T, V> graw[IT], oraw[IT];
    bool ok[IT];
    load_raw<T, V, IT>(gp, s, G, s.len, graw, ok);
    load_raw<T, V, IT>(op, s, G, s.len, oraw, ok);
    to_opmath<T, V, IT>(graw, ok, A(0), g);
    to_opmath<T, V, IT>(oraw, ok, A(0), o);
  } else {
    load_row<T, V, IT>(gp, s, G, s.len, A(0), g);
    load_row<T, V, IT>(op, s, G, s.len, A(0), o);
  }
}

// This thread's part of the row's sum(dy * y) (log_softmax: sum(dy)).
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ Acc<T> backward_dot(const Acc<T> (&g)[IT][V], const Acc<T> (&o)[IT][V]) {
  Acc<T> sum = 0;
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        sum += g[it][v];
      } else {
        sum += g[it][v] * o[it][v];
      }
    }
  return sum;
}

// dx from dy (in g, overwritten), y (o) and the row's sum: y * (dy - sum)
// (times the scale of the masked form), or dy - exp(y) * sum for log_softmax.
template <typename T, int V, int IT, sm::Mode MODE>
__device__ __forceinline__ void backward_grad(Acc<T> (&g)[IT][V], const Acc<T> (&o)[IT][V], Acc<T> sum,
                                              double scale_arg) {
  using A = Acc<T>;
  const A scale = MODE == sm::Mode::ScaledMasked ? static_cast<A>(scale_arg) : A(1);
#pragma unroll
  for (int it = 0; it < IT; ++it)
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        g[it][v] = g[it][v] - elem_exp(o[it][v]) * sum;
      } else {
        g[it][v] = o[it][v] * (g[it][v] - sum) * scale;
      }
    }
}

// backward_dot and backward_grad on values held packed (kPacked), N
// registers of each.
template <typename T, int N, sm::Mode MODE>
__device__ __forceinline__ float backward_dot_packed(const uint32_t (&g)[N], const uint32_t (&o)[N]) {
  float sum = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float g0, g1, o0, o1;
    widen2<T>(g[k], g0, g1);
    if constexpr (MODE == sm::Mode::LogSoftmax) {
      sum += g0;
      sum += g1;
    } else {
      widen2<T>(o[k], o0, o1);
      sum += g0 * o0;
      sum += g1 * o1;
    }
  }
  return sum;
}

template <typename T, int N, sm::Mode MODE>
__device__ __forceinline__ void backward_grad_packed(uint32_t (&g)[N], const uint32_t (&o)[N], float sum,
                                                     double scale_arg) {
  const float scale = MODE == sm::Mode::ScaledMasked ? static_cast<float>(scale_arg) : 1.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float g0, g1, o0, o1;
    widen2<T>(g[k], g0, g1);
    widen2<T>(o[k], o0, o1);
    if constexpr (MODE == sm::Mode::LogSoftmax) {
      g[k] = narrow2<T>(g0 - elem_exp(o0) * sum, g1 - elem_exp(o1) * sum);
    } else {
      g[k] = narrow2<T>(o0 * (g0 - sum) * scale, o1 * (g1 - sum) * scale);
    }
  }
}

// A segment's part of the row's backward sum -> the row's: phase 1 writes
// it to the partials and returns false (nothing to store), phase 2 sums
// the row's partials, phase 3 the cluster's blocks. Every thread of the
// block must call it.
template <typename A>
__device__ __forceinline__ bool backward_row_sum(A& sum, const Segment& s, int G, int phase, int64_t row0,
                                                 A* partials, int nchunks, A* smem) {
  if (phase == 1) {
    if (s.lane == 0 && s.valid) partials[(s.row - row0) * nchunks + blockIdx.x] = sum;
    return false;
  }
  if (phase == 2) {
    const A* p = partials + (s.row - row0) * nchunks;
    A t = 0;
    for (int i = s.lane; i < nchunks; i += G) t += s.valid ? p[i] : A(0);
    sum = group_reduce(t, G, SumOp{}, smem);
  } else if (phase == 3) {
    sum = cluster_sum(sum);
  }
  return true;
}

template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 2, MODE>())) bwd_rows_kernel(sm::BwdArgs a, int G, int phase, int64_t row0,
                                                             int64_t rows, int64_t chunk, Acc<T>* partials,
                                                             int nchunks) {
  using A = Acc<T>;
  __shared__ A smem[32];
  const int64_t K = a.K;
  if (phase == 3) cluster_start<A, 1>();  // see cluster_exchange
  const Segment s = make_segment(G, phase, row0, rows, K, chunk);
  const int64_t off = s.row * K;
  const T* gp = static_cast<const T*>(a.grad) + off;
  const T* op = static_cast<const T*>(a.out) + off;
  T* xp = static_cast<T*>(a.grad_in) + off;

  if constexpr (kPacked<T, V, 2, MODE>) {
    constexpr int N = IT * V / 2;
    uint32_t g[N], o[N];
    load_packed<T, V, IT>(gp, s, G, 0u, g);
    load_packed<T, V, IT>(op, s, G, 0u, o);
    A sum = group_reduce(backward_dot_packed<T, N, MODE>(g, o), G, SumOp{}, smem);
    if (!backward_row_sum(sum, s, G, phase, row0, partials, nchunks, smem)) return;
    backward_grad_packed<T, N, MODE>(g, o, sum, a.scale);
    store_packed<T, V, IT>(xp, s, G, g);
  } else {
    A g[IT][V], o[IT][V];
    load_grad_out<T, V, IT>(gp, op, s, G, g, o);
    A sum = group_reduce(backward_dot<T, V, IT, MODE>(g, o), G, SumOp{}, smem);
    if (!backward_row_sum(sum, s, G, phase, row0, partials, nchunks, smem)) return;
    backward_grad<T, V, IT, MODE>(g, o, sum, a.scale);
    store_row<T, V, IT>(xp, s, G, g);
  }
}

// ------------------------------------------------------------------ backward, rows split over a cluster

// Which backward rows run bwd_cluster_kernel when split over a cluster:
// 16-byte vectors of at least 4 per thread (the kernels built; other plans
// keep both arrays in bwd_rows_kernel).
template <typename T, int V, int IT>
constexpr bool kClusterBackward = V * sizeof(T) == 16 && IT >= 4;

// Clusters of at most this many blocks hold dy and y (bwd_rows_kernel) where
// the plan allows: with few blocks the wait for the slowest is short, and
// reading dy twice costs more than the blocks per SM gained (H200, float32
// 4096 x 32768, clusters of 2: 100% of the floor holding both, 90% holding
// y; bfloat16 512 x 262144, clusters of 8: 85% against 83%). Larger
// clusters hold y only (float32 512 x 262144, clusters of 16: 78% -> 85%).
constexpr int kBothArraysMaxCluster = 8;

// Calls f(it, vector) for each of the segment's vectors `it` of row p that
// lie in the row, loading P of them at a time: the loads of a portion are in
// flight together while only P vectors' registers are taken.
template <typename T, int V, int IT, int P, typename F>
__device__ __forceinline__ void for_each_vector(const T* __restrict__ p, const Segment& s, int G, F f) {
  const T* q = p + s.begin;
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += P) {
    AlignedVec<T, V> raw[P];
    bool ok[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const int off = s.offset(i0 + i, G, V);
      ok[i] = s.valid && off < s.len;
      if (ok[i]) raw[i] = opforge::cuda::load_vec<T, V>(q, off / V);
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (ok[i]) f(i0 + i, raw[i]);
    }
  }
}

// The backward of rows split over a cluster (Kind::Cluster, phase 3; the
// arguments as bwd_rows_kernel's). A block holds only its chunk of y (as
// loaded for the half types, two per register); dy is read in portions (of
// P vectors) for the chunk's sum(dy * y), then read again for dx, which L1
// or L2 serve (this block read the same bytes moments before).
// Holding one array instead of two lets a cluster hold twice the row, or
// an SM twice the blocks: float32 512 x 262144 on an H200, 78% -> 85-87% of
// the 3MKs floor (clusters of 16 blocks of 512 threads x 32 values, two
// blocks per SM, where holding both arrays left one); 256 x 500000, 43%
// (the split) -> 72-77% (clusters of 16 x 512 x 64). Used for clusters of
// more than kBothArraysMaxCluster blocks, and plans that hold more than
// both arrays would fit.
template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 1, sm::Mode::Softmax>()))
    bwd_cluster_kernel(sm::BwdArgs a, int G, int /*phase: 3*/, int64_t row0, int64_t rows, int64_t chunk,
                       Acc<T>* /*partials*/, int /*nchunks*/) {
  static_assert(kClusterBackward<T, V, IT>, "built for 16-byte vectors, 4 or more per thread");
  using A = Acc<T>;
  constexpr bool kPack = kPacked<T, V, 2, MODE>;
  // dy vectors per portion: half the thread's for float32 (measured best:
  // a quarter was 1% slower), a quarter for the other types, where half
  // spills registers (ptxas -v).
  constexpr int P = IT / (sizeof(T) == 4 ? 2 : 4);
  __shared__ A smem[32];
  cluster_start<A, 1>();  // see cluster_exchange
  const Segment s = make_segment(G, 3, row0, rows, a.K, chunk);
  const int64_t off = s.row * a.K;
  const T* gp = static_cast<const T*>(a.grad) + off;
  const T* op = static_cast<const T*>(a.out) + off;
  T* xp = static_cast<T*>(a.grad_in) + off;
  constexpr int W = kPack ? IT * V / 2 : 1;  // packed words of y
  uint32_t w[W];
  A o[kPack ? 1 : IT][V];
  if constexpr (kPack) {
    load_packed<T, V, IT>(op, s, G, 0u, w);
  } else {
    load_row<T, V, IT>(op, s, G, s.len, A(0), o);
  }
  // y's values of vector it, as opmath, two at a time (k: pairs)
  auto y_pair = [&](int it, int k, A& y0, A& y1) {
    if constexpr (kPack) {
      widen2<T>(w[it * V / 2 + k], y0, y1);
    } else {
      y0 = o[it][2 * k];
      y1 = o[it][2 * k + 1];
    }
  };
  // dy's values k of vector d, likewise (2-byte dy widened pair by pair, as
  // it is used, not the whole portion at once)
  auto dy_pair = [](const AlignedVec<T, V>& d, int k, A& d0, A& d1) {
    if constexpr (sizeof(T) == 2) {
      uint32_t u;
      memcpy(&u, &d.val[2 * k], sizeof(u));
      widen2<T>(u, d0, d1);
    } else {
      d0 = d.val[2 * k];
      d1 = d.val[2 * k + 1];
    }
  };
  A dot = 0;
  for_each_vector<T, V, IT, P>(gp, s, G, [&](int it, const AlignedVec<T, V>& d) {
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      A d0, d1;
      dy_pair(d, k, d0, d1);
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        dot += d0;
        dot += d1;
      } else {
        A y0, y1;
        y_pair(it, k, y0, y1);
        dot += d0 * y0;
        dot += d1 * y1;
      }
    }
  });
  const A sum = cluster_sum(group_reduce(dot, G, SumOp{}, smem));
  const A scale = MODE == sm::Mode::ScaledMasked ? static_cast<A>(a.scale) : A(1);
  T* q = xp + s.begin;
  for_each_vector<T, V, IT, P>(gp, s, G, [&](int it, const AlignedVec<T, V>& d) {
    AlignedVec<T, V> r;
#pragma unroll
    for (int k = 0; k < V / 2; ++k) {
      A d0, d1, y0, y1, x0, x1;
      dy_pair(d, k, d0, d1);
      y_pair(it, k, y0, y1);
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        x0 = d0 - elem_exp(y0) * sum;
        x1 = d1 - elem_exp(y1) * sum;
      } else {
        x0 = y0 * (d0 - sum) * scale;
        x1 = y1 * (d1 - sum) * scale;
      }
      if constexpr (sizeof(T) == 2) {
        const uint32_t u = narrow2<T>(x0, x1);  // one conversion for both
        memcpy(&r.val[2 * k], &u, sizeof(u));
      } else {
        r.val[2 * k] = static_cast<T>(x0);
        r.val[2 * k + 1] = static_cast<T>(x1);
      }
    }
    opforge::cuda::store_vec<T, V>(q, s.offset(it, G, V) / V, r);
  });
}

// ------------------------------------------------------------------ outer dims (inner > 1)

template <typename T, sm::Mode MODE>
__global__ void fwd_cols_kernel(sm::FwdArgs a) {
  using A = Acc<T>;
  const int64_t K = a.K, inner = a.inner, cols = a.outer * a.inner;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * K * inner + col % inner;
    A m = neg_inf<A>();
    for (int64_t k = 0; k < K; ++k) m = max_nan(m, static_cast<A>(in[base + k * inner]));
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += elem_exp(static_cast<A>(in[base + k * inner]) - m);
    if constexpr (MODE == sm::Mode::LogSoftmax) {
      const A l = dev_log(sum);  // (x - m) - log(sum), as normalize
      for (int64_t k = 0; k < K; ++k)
        out[base + k * inner] = static_cast<T>((static_cast<A>(in[base + k * inner]) - m) - l);
    } else {
      const A inv = A(1) / sum;
      for (int64_t k = 0; k < K; ++k)
        out[base + k * inner] = static_cast<T>(elem_exp(static_cast<A>(in[base + k * inner]) - m) * inv);
    }
  }
}

template <typename T, sm::Mode MODE>
__global__ void bwd_cols_kernel(sm::BwdArgs a) {
  using A = Acc<T>;
  const int64_t K = a.K, inner = a.inner, cols = a.outer * a.inner;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * K * inner + col % inner;
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = base + k * inner;
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        sum += static_cast<A>(gy[i]);
      } else {
        sum += static_cast<A>(gy[i]) * static_cast<A>(yy[i]);
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = base + k * inner;
      const A g = static_cast<A>(gy[i]), o = static_cast<A>(yy[i]);
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        gx[i] = static_cast<T>(g - elem_exp(o) * sum);
      } else {
        gx[i] = static_cast<T>(o * (g - sum));
      }
    }
  }
}

// ------------------------------------------------------------------ launch

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Registers one element takes in `arrays` register arrays of opmath values.
template <typename T>
constexpr int words_per_elem(int arrays) {
  return arrays * static_cast<int>(sizeof(Acc<T>) / 4);
}

// Largest vectors-per-thread IT (<= 16) keeping the values a thread holds
// within `budget` registers, a vector taking `words_per_vec`.
constexpr int iters_within(int words_per_vec, int budget) {
  int it = 16;
  while (it > 1 && it * words_per_vec > budget) it /= 2;
  return it;
}

// Calls f(std::integral_constant<int, IT>) for a runtime IT in {1, 2, 4, 8, 16}
// (IT <= ITMAX).
template <int ITMAX, typename F>
void with_iters(int it, F&& f) {
  switch (it) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (ITMAX >= 2) { f(std::integral_constant<int, 2>{}); break; } [[fallthrough]];
    case 4: if constexpr (ITMAX >= 4) { f(std::integral_constant<int, 4>{}); break; } [[fallthrough]];
    case 8: if constexpr (ITMAX >= 8) { f(std::integral_constant<int, 8>{}); break; } [[fallthrough]];
    default: if constexpr (ITMAX >= 16) { f(std::integral_constant<int, 16>{}); } else { TORCH_INTERNAL_ASSERT(false); }
  }
}

enum class Kind { Rows, Cluster, Resident, Split };

// The knobs of a launch: threads per row (or per chunk of a row), rows per
// block, vectors per thread, whether a row longer than one block may be
// split over a cluster, and whether those clusters stay resident and walk
// the rows (fwd_resident_kernel; also for rows one block holds: a cluster of
// one).
struct PlanRequest {
  int threads_per_row;
  int rows_per_block;
  int it;
  bool cluster;
  bool resident = false;
};

struct Plan {
  int it;             // elements per thread = V * it
  int G;              // threads per row (Rows) or per chunk (Cluster, Split)
  int block;          // threads per block
  Kind kind = Kind::Rows;
  int64_t chunk = 0;  // elements per block (Cluster, Split)
  int nchunks = 1;
};

Plan plan_from(const PlanRequest& r, int64_t K, int V) {
  Plan p{};
  p.it = r.it;
  p.G = r.threads_per_row;
  p.block = r.threads_per_row * r.rows_per_block;
  const int64_t capacity = int64_t{p.G} * V * p.it;
  if (K <= capacity && !r.resident) return p;
  TORCH_CHECK_VALUE(r.rows_per_block == 1, "opforge softmax plan: a plan that splits rows or keeps clusters "
                                           "resident needs one row per block");
  p.chunk = capacity;
  const int64_t n = ceil_div(K, capacity);  // grid.x: up to 2^31 - 1 chunks, no practical cap
  TORCH_CHECK(n < (int64_t{1} << 31), "opforge softmax: rows of ", opforge::num(K), " elements are too long");
  p.nchunks = static_cast<int>(n);
  p.kind = r.cluster && n <= kMaxCluster ? (r.resident ? Kind::Resident : Kind::Cluster) : Kind::Split;
  return p;
}

// The default plan, from measurements of every plan on an H200
// (bench/softmax_plans.py): threads holding E = 16 values each for rows up
// to 2048 elements and E = 32 beyond (fewer, longer-lived threads keep
// several 16-byte loads in flight each and need fewer reduction steps);
//  * rows up to 32 x 16 values: a slice of a warp (or a warp) per row,
//    several rows per 128-thread block;
//  * rows up to 512 threads x E: a block per row;
//  * 4- and 8-byte forward rows up to 512 threads x 64 registers of values:
//    still one block per row;
//  * longer rows on GPUs with clusters: a cluster of up to 16 blocks, of 256
//    or 512 threads with E or 2E values each (forward; 4- and 8-byte types
//    first try 256 threads x 2E), or of 512 threads with 64 registers of
//    values (backward); where `resident` (fwd_resident_kernel is built for
//    the rows) the forward's clusters stay resident and walk the rows;
//  * otherwise one block of up to itmax vectors per thread, else the
//    two-pass split.
// Rows of the half types held packed (kPacked) past the short rows have
// their own rule: see default_request.
// itmax / itlight: vectors per thread in 64 / 32 registers of values;
// itcluster: the most the backward takes split over a cluster
// (bwd_cluster_kernel holds y only).
PlanRequest default_shape(int64_t K, int V, int itmax, int itlight, int itcluster, bool clusters, int arrays,
                          bool resident) {
  const int e_short = 16, e_long = 32;
  const int it_short = std::max(1, std::min(itlight, e_short / V));
  const int it_long = std::max(1, std::min(itlight, e_long / V));
  if (K <= int64_t{32} * V * it_short) {
    const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it_short)));
    return {G, std::max(1, 128 / G), it_short, false};
  }
  const int it_rows = K <= 2048 ? it_short : it_long;
  if (K <= int64_t{kMaxGroup} * V * it_rows) {
    const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it_rows)));
    return {G, G < 128 ? 128 / G : 1, it_rows, false};
  }
  auto one_block = [&] {
    int it = it_long;
    while (ceil_div(K, int64_t{V} * it) > kMaxGroup) it *= 2;
    return PlanRequest{static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it))), 1, it, false};
  };
  const bool narrow = V >= 8;
  // 4- and 8-byte forward: one block with up to 64 registers of values per
  // thread holds the row faster than a cluster does (measured).
  if (arrays == 1 && !narrow && K <= int64_t{kMaxGroup} * V * itmax) return one_block();
  if (clusters) {
    // (threads, vectors per thread) in order of preference; the first whose
    // cluster has at most 16 blocks wins. The forward's measured best
    // (float32 512 x 262144, a cluster per row: 256 threads x 64 values and
    // 512 x 32, two blocks per SM, 77% of the floor; 512 x 64, one block per
    // SM, 73%; resident clusters in two runs: 512 x 64 85% and 84%, 256 x 64
    // 86% and 82%, 512 x 32 79-80%): 4-byte types favour more values per
    // thread, 2-byte types more threads. Only the forward has resident
    // clusters (a resident backward with dy and y staged measured 73%). The
    // backward: 512 threads x 32 values of each array first (float32 512 x
    // 262144: 85-87% with clusters of 16 holding y only, see
    // kBothArraysMaxCluster; 512 x 64 values of y, 82-88%, and 80% against
    // 87% on 512 x 200000), then 64 values of y only, for rows up to twice
    // as long (float32 256 x 500000: 72-77%, where the split made 43%).
    const int fwd_narrow[4][2] = {{256, it_long}, {kMaxGroup, it_long}, {256, 2 * it_long}, {kMaxGroup, 2 * it_long}};
    const int fwd_wide[4][2] = {{256, 2 * it_long}, {kMaxGroup, it_long}, {kMaxGroup, 2 * it_long}, {256, it_long}};
    const int fwd_resident[4][2] = {
        {kMaxGroup, 2 * it_long}, {256, 2 * it_long}, {kMaxGroup, it_long}, {256, it_long}};
    const int (&fwd)[4][2] = resident ? fwd_resident : narrow ? fwd_narrow : fwd_wide;
    const int bwd[2][2] = {{kMaxGroup, itmax}, {kMaxGroup, 2 * itmax}};
    const int n = arrays == 1 ? 4 : 2;
    for (int i = 0; i < n; ++i) {
      const int G = arrays == 1 ? fwd[i][0] : bwd[i][0];
      const int it = arrays == 1 ? fwd[i][1] : bwd[i][1];
      if (it <= (arrays == 1 ? itmax : itcluster) && ceil_div(K, int64_t{G} * V * it) <= kMaxCluster) {
        return {G, 1, it, true, resident};
      }
    }
  }
  if (K <= int64_t{kMaxGroup} * V * itmax) return one_block();
  return {kMaxGroup, 1, itlight, false};
}

// packed: the row is held as loaded (kPacked: the half types).
// resident: fwd_resident_kernel is built for these rows (kResident).
PlanRequest default_request(int64_t K, int V, int itmax, int itlight, int itcluster, bool clusters, int arrays,
                            bool packed, bool resident) {
  // Rows of the half types held packed, past the short rows (512
  // elements): threads of E = 32 values (of each array) up to 2048
  // elements, E = 64 beyond; one block per row while 512 threads hold it,
  // else a cluster of up to 16 blocks (of 256 threads first forward, of
  // 512 backward), else (backward) a cluster of 512-thread blocks holding
  // 128 values of y, else the split. Measured best on an H200 (bfloat16):
  // forward a block of 128 threads x 64 values on 8192 x 8192 (90% of the
  // floor), 512 x 64 on 4096 x 32768 (84%), a cluster of 16 x 256 x 64 on
  // 512 x 262144 (83% with the chunks in shared memory, fwd_staged_kernel;
  // 8 x 512 x 64: 82%), 32 x 32 on 8192 x 1024; backward
  // 512 x 64 on 4096 x 32768 (99%), a cluster of 8 x 512 x 64 on 512 x
  // 262144 (85%; 16 x 256 x 64: 81-85%), within 2% of the best elsewhere.
  if (packed && K > 512) {
    const int it = (K <= 2048 ? 32 : 64) / V;
    if (K <= int64_t{kMaxGroup} * V * it) {
      const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it)));
      return {G, G < 128 ? 128 / G : 1, it, false};
    }
    const int order[2] = {arrays == 1 ? 256 : kMaxGroup, arrays == 1 ? kMaxGroup : 256};
    for (const int G : order) {
      if (clusters && ceil_div(K, int64_t{G} * V * it) <= kMaxCluster) return {G, 1, it, true};
    }
    // The backward's clusters hold y only: twice the values per thread
    // still fit, for rows up to twice as long.
    if (arrays == 2 && clusters && 2 * it <= itcluster && ceil_div(K, int64_t{kMaxGroup} * V * 2 * it) <= kMaxCluster) {
      return {kMaxGroup, 1, 2 * it, true};
    }
    return {kMaxGroup, 1, it, false};
  }
  return default_shape(K, V, itmax, itlight, itcluster, clusters, arrays, resident);
}

// The launch attributes of a cluster launch: c blocks per cluster, and the
// load-balancing scheduling policy (measured on an H200 with the cluster
// exchange above: float32 forward 512 x 262144 73% -> 77% of the floor for
// clusters of 16 blocks, others unchanged within 1%).
int cluster_attributes(cudaLaunchAttribute (&at)[2], int c) {
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = c;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
  at[1].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicyLoadBalancing;
  return 2;
}

// How many clusters of c blocks of `block` threads of `kernel` the current
// GPU runs at once; 0 where it runs none: clusters need sm_90 code (they are
// compiled out below that) and a GPU that can place them. Asked once per
// kernel, cluster size, block size and device.
// smem: dynamic shared memory per block (the kernel is allowed as much).
template <typename Kernel>
int active_clusters(Kernel kernel, int c, int block, size_t smem = 0) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int, size_t>, int> known;
  const int dev = c10::cuda::current_device();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), c, block, dev, smem);
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
  const int64_t batch = std::max<int64_t>(
      1, std::min<int64_t>({rows, int64_t{65535}, (l2 / 2) / std::max<int64_t>(row_bytes, 1)}));
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
  launch_clusters(kernel, dim3(static_cast<unsigned>(p.nchunks), clusters, 1), p.block, smem, args, p.G, rows,
                  p.chunk);
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

// Whether this build's kernels can use clusters at all on the current GPU.
// Asked by every launch: answered once per device, then read without the
// occupancy cache's lock.
bool clusters_available() {
  static std::array<std::atomic<int8_t>, 64> known{};  // 0 not asked yet, 1 no, 2 yes
  auto ask = [] { return cluster_launchable(fwd_rows_kernel<float, 4, 1, sm::Mode::Softmax>, 2, kMaxGroup); };
  const int dev = c10::cuda::current_device();
  if (dev < 0 || dev >= static_cast<int>(known.size())) return ask();
  int8_t v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    v = ask() ? 2 : 1;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

// Register budgets (in 32-bit words of values per thread) of the plans.
template <typename T, int ARRAYS, sm::Mode MODE>
struct Budget {
  // The masked mode's index and mask arithmetic needs more registers: it
  // holds at most 32 registers of values.
  static constexpr int kHeavy = MODE == sm::Mode::ScaledMasked ? 32 : 64;
  template <int V>
  static constexpr bool packed() { return kPacked<T, V, ARRAYS, MODE>; }
  // Registers a vector of V values takes: two values per register when
  // packed, else words_per_elem each.
  template <int V>
  static constexpr int words_per_vec() { return packed<V>() ? ARRAYS * V / 2 : V * words_per_elem<T>(ARRAYS); }
  // The most vectors per thread the kernels take.
  template <int V>
  static constexpr int itmax() { return iters_within(words_per_vec<V>(), kHeavy); }
  // Vectors per thread in 64 and 32 registers of widened values, the units
  // the default plans are written in.
  template <int V>
  static constexpr int itplan() { return iters_within(V * words_per_elem<T>(ARRAYS), kHeavy); }
  template <int V>
  static constexpr int itlight() { return iters_within(V * words_per_elem<T>(ARRAYS), 32); }
};

// Checks a requested plan (the `_plan` ops) against what the kernels allow.
void check_request(const PlanRequest& r, int itmax) {
  auto pow2 = [](int64_t v) { return v > 0 && (v & (v - 1)) == 0; };
  TORCH_CHECK_VALUE(pow2(r.threads_per_row) && r.threads_per_row <= kMaxGroup,
                    "opforge softmax plan: threads_per_row must be a power of two in [1, 512], got ",
                    opforge::num(r.threads_per_row));
  TORCH_CHECK_VALUE(pow2(r.rows_per_block) && int64_t{r.rows_per_block} * r.threads_per_row <= kMaxGroup,
                    "opforge softmax plan: rows_per_block must be a power of two with rows_per_block x "
                    "threads_per_row <= 512, got ",
                    opforge::num(r.rows_per_block));
  TORCH_CHECK_VALUE(pow2(r.it) && r.it <= itmax, "opforge softmax plan: vectors_per_thread must be a power of two <= ",
                    opforge::num(itmax), " for this dtype and alignment, got ", opforge::num(r.it));
  TORCH_CHECK_VALUE(!r.resident || r.cluster, "opforge softmax plan: persistent clusters need cluster=True");
}

// The plan for rows of K elements in vectors of V: the requested one
// (checked against the kernels' register budget B) or the default.
// arrays: register arrays per element (1 forward, 2 backward); resident:
// fwd_resident_kernel is built for these rows; itcluster (backward): the
// most vectors per thread of a plan that asks for clusters
// (bwd_cluster_kernel), 0 for B's.
template <typename B, int V>
Plan resolve_plan(const PlanRequest* req, int64_t K, int arrays, bool resident = false, int itcluster = 0) {
  constexpr int ITMAX = B::template itmax<V>();
  const int itcl = itcluster > 0 ? itcluster : ITMAX;
  if (req != nullptr) {
    check_request(*req, req->cluster ? itcl : ITMAX);
    return plan_from(*req, K, V);
  }
  return plan_from(default_request(K, V, B::template itplan<V>(), B::template itlight<V>(), itcl, clusters_available(),
                                   arrays, B::template packed<V>(), resident),
                   K, V);
}

// A backward plan that bwd_rows_kernel, holding dy and y, can run: vectors
// per thread within its budget itmax (a plan meant for bwd_cluster_kernel,
// which holds y only, may take up to twice as many).
Plan within_budget(const Plan& p, int64_t K, int V, int itmax) {
  if (p.it <= itmax) return p;
  const int rows_per_block = int64_t{p.G} * V * itmax >= K ? p.block / p.G : 1;
  return plan_from(PlanRequest{p.G, rows_per_block, itmax, p.kind != Kind::Rows}, K, V);
}

template <typename T, sm::Mode MODE>
void forward_cuda_impl(const sm::FwdArgs& a, const at::Tensor& x, const PlanRequest* req) {
  using A = Acc<T>;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (a.inner > 1) {
    if constexpr (MODE != sm::Mode::ScaledMasked) {
      const int threads = 256;
      const auto blocks = opforge::cuda::grid_for(a.outer * a.inner, threads);
      fwd_cols_kernel<T, MODE><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
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

template <typename T, sm::Mode MODE>
void backward_cuda_impl(const sm::BwdArgs& a, const at::Tensor& t, const PlanRequest* req) {
  using A = Acc<T>;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (a.inner > 1) {
    if constexpr (MODE != sm::Mode::ScaledMasked) {
      const int threads = 256;
      const auto blocks = opforge::cuda::grid_for(a.outer * a.inner, threads);
      bwd_cols_kernel<T, MODE><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
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

template <sm::Mode MODE>
at::Tensor run_forward(sm::Prepared p, const PlanRequest* req = nullptr) {
  if (p.out.numel() == 0) return p.out;
  const c10::cuda::CUDAGuard guard(p.x.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(p.args.dtype, "opforge_softmax_cuda", [&] {
    forward_cuda_impl<scalar_t, MODE>(p.args, p.x, req);
  });
  return p.out;
}

template <sm::Mode MODE>
at::Tensor run_backward(sm::PreparedBwd p, const PlanRequest* req = nullptr) {
  if (p.grad_in.numel() == 0) return p.grad_in;
  const c10::cuda::CUDAGuard guard(p.out.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(p.args.dtype, "opforge_softmax_backward_cuda", [&] {
    backward_cuda_impl<scalar_t, MODE>(p.args, p.out, req);
  });
  return p.grad_in;
}

// The `_plan` ops: softmax over the last dim with a given launch plan.
PlanRequest request_from(int64_t threads_per_row, int64_t rows_per_block, int64_t vectors_per_thread, bool cluster,
                         bool persistent = false) {
  auto small = [](int64_t v, const char* name) {
    TORCH_CHECK_VALUE(v >= 1 && v <= 512, "opforge softmax plan: ", name, " must be in [1, 512], got ", opforge::num(v));
    return static_cast<int>(v);
  };
  return {small(threads_per_row, "threads_per_row"), small(rows_per_block, "rows_per_block"),
          small(vectors_per_thread, "vectors_per_thread"), cluster, persistent};
}

at::Tensor softmax_plan_cuda(const at::Tensor& x, int64_t threads_per_row, int64_t rows_per_block,
                             int64_t vectors_per_thread, bool cluster, bool persistent) {
  const PlanRequest r = request_from(threads_per_row, rows_per_block, vectors_per_thread, cluster, persistent);
  return run_forward<sm::Mode::Softmax>(
      sm::prepare_softmax("opforge._softmax_plan", sm::Mode::Softmax, x, -1, std::nullopt), &r);
}

at::Tensor softmax_backward_plan_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t threads_per_row,
                                      int64_t rows_per_block, int64_t vectors_per_thread, bool cluster) {
  const PlanRequest r = request_from(threads_per_row, rows_per_block, vectors_per_thread, cluster);
  return run_backward<sm::Mode::Softmax>(
      sm::prepare_backward("opforge._softmax_backward_plan", sm::Mode::Softmax, grad, output, -1, 1.0), &r);
}

// Few columns over a reduced outer dim: a thread per column would leave
// most of the GPU idle, so the dim is moved last instead (one copy in, one
// copy out) and the row kernels run.
bool few_columns(const sm::FwdArgs& a) { return a.inner > 1 && a.K >= 16 && a.outer * a.inner < 32768; }
bool few_columns(const sm::BwdArgs& a) { return a.inner > 1 && a.K >= 16 && a.outer * a.inner < 32768; }

template <sm::Mode MODE>
at::Tensor softmax_family_cuda(const char* op, const at::Tensor& x, int64_t dim,
                               std::optional<c10::ScalarType> dtype) {
  sm::Prepared p = sm::prepare_softmax(op, MODE, x, dim, dtype);
  if (p.out.numel() > 0 && few_columns(p.args)) {
    const int64_t d = sm::wrap_dim(op, x, dim, "x");
    const c10::cuda::CUDAGuard guard(p.x.device());
    at::Tensor rows = run_forward<MODE>(sm::prepare_softmax(op, MODE, p.x.movedim(d, -1), -1, std::nullopt));
    p.out.copy_(rows.movedim(-1, d));
    return p.out;
  }
  return run_forward<MODE>(std::move(p));
}

template <sm::Mode MODE>
at::Tensor softmax_family_backward_cuda(const char* op, const at::Tensor& grad, const at::Tensor& output,
                                        int64_t dim) {
  sm::PreparedBwd p = sm::prepare_backward(op, MODE, grad, output, dim, 1.0);
  if (p.grad_in.numel() > 0 && few_columns(p.args)) {
    const int64_t d = sm::wrap_dim(op, output, dim, "output");
    const c10::cuda::CUDAGuard guard(p.out.device());
    at::Tensor rows = run_backward<MODE>(
        sm::prepare_backward(op, MODE, p.grad.movedim(d, -1), p.out.movedim(d, -1), -1, 1.0));
    p.grad_in.copy_(rows.movedim(-1, d));
    return p.grad_in;
  }
  return run_backward<MODE>(std::move(p));
}

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  return softmax_family_cuda<sm::Mode::Softmax>("opforge.softmax", x, dim, dtype);
}

at::Tensor log_softmax_cuda(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  return softmax_family_cuda<sm::Mode::LogSoftmax>("opforge.log_softmax", x, dim, dtype);
}

at::Tensor scaled_masked_softmax_cuda(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                      bool causal) {
  return run_forward<sm::Mode::ScaledMasked>(
      sm::prepare_scaled_masked("opforge.scaled_masked_softmax", x, mask, scale, causal));
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  return softmax_family_backward_cuda<sm::Mode::Softmax>("opforge._softmax_backward", grad, output, dim);
}

at::Tensor log_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  return softmax_family_backward_cuda<sm::Mode::LogSoftmax>("opforge._log_softmax_backward", grad, output, dim);
}

at::Tensor scaled_masked_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, double scale) {
  return run_backward<sm::Mode::ScaledMasked>(sm::prepare_backward(
      "opforge._scaled_masked_softmax_backward", sm::Mode::ScaledMasked, grad, output, -1, scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("softmax", &softmax_cuda);
  m.impl("log_softmax", &log_softmax_cuda);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_cuda);
  m.impl("_softmax_backward", &softmax_backward_cuda);
  m.impl("_log_softmax_backward", &log_softmax_backward_cuda);
  m.impl("_scaled_masked_softmax_backward", &scaled_masked_softmax_backward_cuda);
  m.impl("_softmax_plan", &softmax_plan_cuda);
  m.impl("_softmax_backward_plan", &softmax_backward_plan_cuda);
}

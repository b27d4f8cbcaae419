// Forward kernels of rows split over a thread block cluster that read their
// chunk from shared memory: resident clusters walking the rows (float32),
// and a cluster per row with the chunk staged (float16, bfloat16).
#pragma once

#include <opforge/cuda_async.cuh>

#include "forward_rows.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

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
// forward keeps a cluster per row). 2-byte types need more than the 64
// registers that keep four 256-thread blocks per SM to be resident, and
// were slower so in every variant tried: they run fwd_staged_kernel, and
// 8-byte types a cluster per row.
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
// path bit for bit.
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

}  // namespace
}  // namespace opforge::softmax::gpu

// Backward row kernels of the softmax family (inner-most dim): both arrays
// held (bwd_rows_kernel), or y only with dy read twice (bwd_cluster_kernel).
#pragma once

#include "cluster.cuh"
#include "row_io.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

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
__device__ __forceinline__ bool backward_row_sum(A& sum, const Segment& s, int G, int phase, int64_t row0, A* partials,
                                                 int nchunks, A* smem) {
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
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 2, MODE>()))
    bwd_rows_kernel(sm::BwdArgs a, int G, int phase, int64_t row0, int64_t rows, int64_t chunk, Acc<T>* partials,
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

// Rows split over a cluster, y held alone.

// Which backward rows run bwd_cluster_kernel when split over a cluster:
// 16-byte vectors of at least 4 per thread (the kernels built; other plans
// keep both arrays in bwd_rows_kernel).
template <typename T, int V, int IT>
constexpr bool kClusterBackward = V * sizeof(T) == 16 && IT >= 4;

// Clusters of at most this many blocks hold dy and y (bwd_rows_kernel) where
// the plan allows: with few blocks the wait for the slowest is short, and
// reading dy twice costs more than the blocks per SM gained. Larger
// clusters hold y only (bwd_cluster_kernel).
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
// an SM twice the blocks (which hides the wait for a cluster's slowest
// block). Used for clusters of more than kBothArraysMaxCluster blocks, and
// plans that hold more than both arrays would fit.
template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 1, sm::Mode::Softmax>()))
    bwd_cluster_kernel(sm::BwdArgs a, int G, int /*phase: 3*/, int64_t row0, int64_t rows, int64_t chunk,
                       Acc<T>* /*partials*/, int /*nchunks*/) {
  static_assert(kClusterBackward<T, V, IT>, "built for 16-byte vectors, 4 or more per thread");
  using A = Acc<T>;
  constexpr bool kPack = kPacked<T, V, 2, MODE>;
  // dy vectors per portion: half the thread's for float32 (the fastest
  // tried), a quarter for the other types, where half spills registers.
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

}  // namespace
}  // namespace opforge::softmax::gpu

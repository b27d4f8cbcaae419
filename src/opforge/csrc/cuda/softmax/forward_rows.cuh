// Forward row kernel of the softmax family (inner-most dim): a row per
// group of threads, or a chunk of one per block (two-pass split, phases 1
// and 2; a cluster per row, phase 3).
#pragma once

#include "cluster.cuh"
#include "row_io.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

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
__device__ __forceinline__ void forward_stats(Acc<T> (&vals)[IT][V], const Segment& s, int G, Acc<T>* smem, Acc<T>& m,
                                              Acc<T>& sum) {
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
__device__ __forceinline__ bool finish_forward(Acc<T> (&vals)[IT][V], const Segment& s, int G, int phase, int64_t row0,
                                               Acc<T>* partials, int nchunks, Acc<T>* smem) {
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

template <typename T, int V, int IT, sm::Mode MODE>
__global__ void __launch_bounds__(kMaxGroup, (rows_min_blocks<T, V, IT, 1, MODE>()))
    fwd_rows_kernel(sm::FwdArgs a, int G, int phase, int64_t row0, int64_t rows, int64_t chunk, Acc<T>* partials,
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

  if (finish_forward<T, V, IT, MODE>(vals, s, G, phase, row0, partials, nchunks, smem))
    store_row<T, V, IT>(y, s, G, vals);
}

}  // namespace
}  // namespace opforge::softmax::gpu

// How a softmax row kernel's threads reach their row: the segment a group
// of threads works on, its vector loads and stores, and values held as
// loaded, two 2-byte values per register.
#pragma once

#include <opforge/cuda_vec.cuh>

#include "device_math.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;
using opforge::cuda::AlignedVec;

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
__device__ __forceinline__ void load_row(const T* __restrict__ p, const Segment& s, int G, int limit, Acc<T> fill,
                                         Acc<T> (&vals)[IT][V]) {
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

}  // namespace
}  // namespace opforge::softmax::gpu

// Constants and register-budget traits of the softmax CUDA kernels, shared
// by the kernels (device), their launchers and the host-only planner.
#pragma once

#include <ATen/OpMathType.h>

#include <type_traits>

#include "softmax.h"

namespace opforge::softmax::gpu {

namespace sm = opforge::softmax;

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

// Register budgets (in 32-bit words of values per thread) of the plans.
template <typename T, int ARRAYS, sm::Mode MODE>
struct Budget {
  // The masked mode's index and mask arithmetic needs more registers: it
  // holds at most 32 registers of values.
  static constexpr int kHeavy = MODE == sm::Mode::ScaledMasked ? 32 : 64;
  template <int V>
  static constexpr bool packed() {
    return kPacked<T, V, ARRAYS, MODE>;
  }
  // Registers a vector of V values takes: two values per register when
  // packed, else words_per_elem each.
  template <int V>
  static constexpr int words_per_vec() {
    return packed<V>() ? ARRAYS * V / 2 : V * words_per_elem<T>(ARRAYS);
  }
  // The most vectors per thread the kernels take.
  template <int V>
  static constexpr int itmax() {
    return iters_within(words_per_vec<V>(), kHeavy);
  }
  // Vectors per thread in 64 and 32 registers of widened values, the units
  // the default plans are written in.
  template <int V>
  static constexpr int itplan() {
    return iters_within(V * words_per_elem<T>(ARRAYS), kHeavy);
  }
  template <int V>
  static constexpr int itlight() {
    return iters_within(V * words_per_elem<T>(ARRAYS), 32);
  }
};

}  // namespace opforge::softmax::gpu

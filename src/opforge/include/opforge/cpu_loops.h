// CPU loops for elementwise ops of any number of inputs over a
// TensorIterator's 2-d chunks: vectorized with at::vec where the inner
// dimension is contiguous (or an input is a broadcast scalar), a scalar loop
// otherwise. The caller runs them in parallel over the outer work
// (cpu_elementwise.h: TensorIterator::for_each, at::parallel_for underneath).
//
// Half types are widened to float for the arithmetic and rounded once on the
// store. Ops supply a scalar functor and a vector functor over opmath_t.
//
// Include it from a kernel source compiled per ISA (cpu_isa_begin.h): the
// loops live in the inline namespace CPU_CAPABILITY, so each ISA's copy is
// a distinct symbol.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <utility>

namespace opforge::cpu {
inline namespace CPU_CAPABILITY {

template <typename scalar_t>
constexpr bool is_reduced_float_v = std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16>;

// Loads kWidth consecutive scalar_t (or one broadcast value) as opmath vectors.
// For float/double one Vectorized holds them all; for half types two float
// vectors do.
template <typename scalar_t>
struct VecIO {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = at::vec::Vectorized<scalar_t>;
  using OVec = at::vec::Vectorized<opmath_t>;
  static constexpr int64_t kWidth = Vec::size();
  static constexpr int kParts = is_reduced_float_v<scalar_t> ? 2 : 1;

  struct Pack {
    OVec v[kParts];
  };

  static Pack load(const scalar_t* p) {
    Pack out;
    if constexpr (kParts == 2) {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vec::loadu(p));
      out.v[0] = lo;
      out.v[1] = hi;
    } else {
      out.v[0] = Vec::loadu(p);
    }
    return out;
  }
  static Pack broadcast(scalar_t x) {
    Pack out;
    for (int i = 0; i < kParts; ++i) out.v[i] = OVec(static_cast<opmath_t>(x));
    return out;
  }
  static void store(scalar_t* p, const Pack& x) {
    if constexpr (kParts == 2) {
      at::vec::convert_from_float<scalar_t>(x.v[0], x.v[1]).store(p);
    } else {
      x.v[0].store(p);
    }
  }
};

// The elementwise loop below calls an N-ary functor with N values (or N
// vectors) taken from arrays; these unpack the array into the argument list.
template <typename Op, typename T, size_t N, size_t... I>
inline auto apply_n(Op& op, const std::array<T, N>& args, std::index_sequence<I...>) {
  return op(args[I]...);
}

// Part `p` of each input's Pack (half types load as two float vectors).
template <typename Op, typename Pack, size_t N, size_t... I>
inline auto apply_part(Op& op, const std::array<Pack, N>& args, int p, std::index_sequence<I...>) {
  return op(args[I].v[p]...);
}

// One TensorIterator 2-d chunk of out = op(in_0, ..., in_{N-1}) (operand 0
// is the output, as TensorIterator orders them): `strides` holds the inner
// strides of out and the N inputs, then their outer strides, in bytes.
//
// Vectorized when the output is contiguous and every input is contiguous or
// a broadcast scalar (stride 0) along the inner dimension; a scalar loop
// over the byte strides otherwise. A broadcast input is read, in the vector
// loop, from a small buffer of its value repeated one vector long, so one
// branch-free instantiation serves every mix of contiguous and broadcast
// inputs (2^N specialisations would cost compile time, and the extra load
// hits L1). sop takes N opmath_t values, vop N at::vec::Vectorized<opmath_t>.
template <typename scalar_t, int N, typename ScalarOp, typename VecOp>
void elementwise_loop2d(char** data, const int64_t* strides, int64_t n, int64_t m, ScalarOp sop, VecOp vop) {
  static_assert(N >= 1, "an elementwise op needs at least one input");
  using IO = VecIO<scalar_t>;
  using opmath_t = typename IO::opmath_t;
  using Pack = typename IO::Pack;
  constexpr int64_t s = sizeof(scalar_t);
  constexpr int64_t W = IO::kWidth;
  constexpr auto idx = std::make_index_sequence<N>{};
  constexpr int NT = N + 1;  // tensors: the output, then the inputs
  bool vectorized = strides[0] == s;
  for (int k = 1; k < NT; ++k) vectorized = vectorized && (strides[k] == s || strides[k] == 0);
  for (int64_t j = 0; j < m; ++j) {
    char* po = data[0] + j * strides[NT];
    std::array<const char*, N> in;
    for (int k = 0; k < N; ++k) in[k] = data[1 + k] + j * strides[NT + 1 + k];
    if (!vectorized) {
      for (int64_t i = 0; i < n; ++i) {
        std::array<opmath_t, N> x;
        for (int k = 0; k < N; ++k) x[k] = *reinterpret_cast<const scalar_t*>(in[k] + i * strides[1 + k]);
        *reinterpret_cast<scalar_t*>(po + i * strides[0]) = static_cast<scalar_t>(apply_n(sop, x, idx));
      }
      continue;
    }
    auto* out = reinterpret_cast<scalar_t*>(po);
    // Element steps (1 or 0) of each input, for the scalar tail.
    std::array<int64_t, N> step;
    for (int k = 0; k < N; ++k) step[k] = strides[1 + k] == 0 ? 0 : 1;
    auto scalar_at = [&](int64_t i) {
      std::array<opmath_t, N> x;
      for (int k = 0; k < N; ++k) x[k] = reinterpret_cast<const scalar_t*>(in[k])[i * step[k]];
      return static_cast<scalar_t>(apply_n(sop, x, idx));
    };
    int64_t i = 0;
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512) && (defined(__x86_64__) || defined(_M_X64))
    // at::vec's portable x86 fallback emulates vectors element by element and
    // is far slower than a plain loop the compiler vectorises for SSE2 (which
    // it does when no input is broadcast: the steps are then known).
    bool all_contiguous = true;
    for (int k = 0; k < N; ++k) all_contiguous = all_contiguous && step[k] == 1;
    if (all_contiguous) {
      for (; i < n; ++i) {
        std::array<opmath_t, N> x;
        for (int k = 0; k < N; ++k) x[k] = reinterpret_cast<const scalar_t*>(in[k])[i];
        out[i] = static_cast<scalar_t>(apply_n(sop, x, idx));
      }
    }
    for (; i < n; ++i) out[i] = scalar_at(i);
    (void)vop;
    continue;
#endif
    alignas(64) scalar_t repeated[N][W];
    std::array<const scalar_t*, N> vp;  // where each input's next vector is read
    std::array<int64_t, N> vstep;
    for (int k = 0; k < N; ++k) {
      const auto* p = reinterpret_cast<const scalar_t*>(in[k]);
      if (step[k] == 0) {
        std::fill(repeated[k], repeated[k] + W, p[0]);
        vp[k] = repeated[k];
        vstep[k] = 0;
      } else {
        vp[k] = p;
        vstep[k] = W;
      }
    }
    for (; i + W <= n; i += W) {
      std::array<Pack, N> x;
      for (int k = 0; k < N; ++k) {
        x[k] = IO::load(vp[k]);
        vp[k] += vstep[k];
      }
      Pack r;
      for (int p = 0; p < IO::kParts; ++p) r.v[p] = apply_part(vop, x, p, idx);
      IO::store(out + i, r);
    }
    for (; i < n; ++i) out[i] = scalar_at(i);
  }
}

// The same loop with one functor for both: a generic lambda whose body
// reads the same for values and vectors (`[](auto x, auto y) { return x * y; }`).
template <typename scalar_t, int N, typename Op>
void elementwise_loop2d(char** data, const int64_t* strides, int64_t n, int64_t m, Op op) {
  elementwise_loop2d<scalar_t, N>(data, strides, n, m, op, op);
}

// out = op(a, b): the N = 2 case, under the name opforge's add family and
// earlier projects use.
template <typename scalar_t, typename ScalarOp, typename VecOp>
void binary_loop2d(char** data, const int64_t* strides, int64_t n, int64_t m, ScalarOp sop, VecOp vop) {
  elementwise_loop2d<scalar_t, 2>(data, strides, n, m, sop, vop);
}

}  // namespace CPU_CAPABILITY
}  // namespace opforge::cpu

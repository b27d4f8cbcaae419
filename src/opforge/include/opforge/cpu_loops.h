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

// op(args[0], ..., args[N-1]) for values, or part `p` of each Pack.
template <typename Op, typename T, size_t N, size_t... I>
inline auto apply_n(Op& op, const std::array<T, N>& args, std::index_sequence<I...>) {
  return op(args[I]...);
}

template <typename Op, typename Pack, size_t N, size_t... I>
inline auto apply_part(Op& op, const std::array<Pack, N>& args, int p, std::index_sequence<I...>) {
  return op(args[I].v[p]...);
}

// Which inputs of a row are broadcast (stride 0), as a template argument:
// none, exactly input k (0 <= k < N), or any other mix (kMixed = N).
// The common patterns (none, one: a bias, a 0-d tensor) then get a loop with
// no per-input test or extra load; the rest share one loop that reads each
// input at `base + i * step` (step 0 for broadcast ones). N + 2 copies per
// op and dtype, not 2^N.
constexpr int kNoBroadcast = -1;

// One such row; in[k] is input k's row start.
template <typename scalar_t, int N, int kB, typename ScalarOp, typename VecOp, size_t... I>
inline void contiguous_row(scalar_t* out, const std::array<const scalar_t*, N>& in, const std::array<int64_t, N>& step,
                           int64_t n, ScalarOp& sop, VecOp& vop, std::index_sequence<I...> idx) {
  using IO = VecIO<scalar_t>;
  using opmath_t = typename IO::opmath_t;
  constexpr bool kMixed = kB == N;
  // Element i of input k, as opmath_t; the test on k is resolved at compile time.
  auto value = [&](auto k, int64_t i) -> opmath_t {
    if constexpr (static_cast<int>(decltype(k)::value) == kB) return static_cast<opmath_t>(in[k][0]);
    if constexpr (kMixed) return static_cast<opmath_t>(in[k][i * step[k]]);
    return static_cast<opmath_t>(in[k][i]);
  };
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512) || !(defined(__x86_64__) || defined(_M_X64))
  // (On x86 without AVX, at::vec's portable fallback emulates vectors element
  // by element and is far slower than the plain loop below, which the
  // compiler vectorises for SSE2; there only that loop runs.)
  using Pack = typename IO::Pack;
  constexpr int64_t W = IO::kWidth;
  Pack bc{};  // the broadcast input's value, for kB < N
  if constexpr (kB >= 0 && !kMixed) bc = IO::broadcast(in[kB][0]);
  auto vector = [&](auto k, int64_t at) -> Pack {
    if constexpr (static_cast<int>(decltype(k)::value) == kB) return bc;
    return IO::load(in[k] + at);
  };
  // A broadcast input of a mixed row is read one vector at a time from a
  // buffer of its value repeated (step 0): `row` points there.
  std::array<const scalar_t*, N> row = in;
  alignas(64) scalar_t repeated[kMixed ? N : 1][W];
  if constexpr (kMixed) {
    for (int k = 0; k < N; ++k) {
      if (step[k] == 0) {
        std::fill(repeated[k], repeated[k] + W, in[k][0]);
        row[k] = repeated[k];
      }
    }
  }
  auto load_all = [&](int64_t at) -> std::array<Pack, N> {
    if constexpr (kMixed) {
      return {IO::load(row[I] + at * step[I])...};
    } else {
      return {vector(std::integral_constant<size_t, I>{}, at)...};
    }
  };
  for (; i + W <= n; i += W) {
    const std::array<Pack, N> x = load_all(i);
    Pack r;
    for (int p = 0; p < IO::kParts; ++p) r.v[p] = apply_part(vop, x, p, idx);
    IO::store(out + i, r);
  }
#else
  (void)vop;
#endif
  for (; i < n; ++i) {
    const std::array<opmath_t, N> x{value(std::integral_constant<size_t, I>{}, i)...};
    out[i] = static_cast<scalar_t>(apply_n(sop, x, idx));
  }
}

// m rows of n elements with a contiguous output, each input contiguous
// (step 1) or broadcast (step 0) along the rows; the broadcast pattern is a
// template argument, chosen once per 2-d chunk.
template <typename scalar_t, int N, int kB, typename ScalarOp, typename VecOp, size_t... I>
inline void contiguous_rows(char** data, const int64_t* strides, int64_t n, int64_t m,
                            const std::array<int64_t, N>& step, ScalarOp& sop, VecOp& vop,
                            std::index_sequence<I...> idx) {
  for (int64_t j = 0; j < m; ++j) {
    auto* out = reinterpret_cast<scalar_t*>(data[0] + j * strides[N + 1]);
    const std::array<const scalar_t*, N> in{reinterpret_cast<const scalar_t*>(data[1 + I] + j * strides[N + 2 + I])...};
    contiguous_row<scalar_t, N, kB>(out, in, step, n, sop, vop, idx);
  }
}

// contiguous_rows with kB = the broadcast pattern `b` (a run-time value).
template <typename scalar_t, int N, typename ScalarOp, typename VecOp, size_t... I>
inline void contiguous_rows_for(int b, char** data, const int64_t* strides, int64_t n, int64_t m,
                                const std::array<int64_t, N>& step, ScalarOp& sop, VecOp& vop,
                                std::index_sequence<I...> idx) {
  if (b == kNoBroadcast) return contiguous_rows<scalar_t, N, kNoBroadcast>(data, strides, n, m, step, sop, vop, idx);
  if (b == N) return contiguous_rows<scalar_t, N, N>(data, strides, n, m, step, sop, vop, idx);
  // b is one input: the matching one of the N instantiations.
  (void)((b == static_cast<int>(I) &&
          (contiguous_rows<scalar_t, N, static_cast<int>(I)>(data, strides, n, m, step, sop, vop, idx), true)) ||
         ...);
}

// One TensorIterator 2-d chunk of out = op(in_0, ..., in_{N-1}) (operand 0
// is the output, as TensorIterator orders them): `strides` holds the inner
// strides of out and the N inputs, then their outer strides, in bytes.
//
// Vectorized when the output is contiguous and every input is contiguous or
// a broadcast scalar (stride 0) along the inner dimension; a scalar loop
// over the byte strides otherwise. sop takes N opmath_t values, vop N
// at::vec::Vectorized<opmath_t>; both must compute the same function.
template <typename scalar_t, int N, typename ScalarOp, typename VecOp>
void elementwise_loop2d(char** data, const int64_t* strides, int64_t n, int64_t m, ScalarOp sop, VecOp vop) {
  static_assert(N >= 1, "an elementwise op needs at least one input");
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t s = sizeof(scalar_t);
  constexpr auto idx = std::make_index_sequence<N>{};
  constexpr int NT = N + 1;  // tensors: the output, then the inputs
  bool vectorized = strides[0] == s;
  std::array<int64_t, N> step;  // element steps of the inputs along a row: 1 or 0
  int broadcast = kNoBroadcast, n_broadcast = 0;
  for (int k = 0; k < N; ++k) {
    vectorized = vectorized && (strides[1 + k] == s || strides[1 + k] == 0);
    step[k] = strides[1 + k] == 0 ? 0 : 1;
    if (step[k] == 0) {
      broadcast = k;
      ++n_broadcast;
    }
  }
  if (n_broadcast > 1) broadcast = N;
  if (vectorized) return contiguous_rows_for<scalar_t, N>(broadcast, data, strides, n, m, step, sop, vop, idx);
  for (int64_t j = 0; j < m; ++j) {
    char* po = data[0] + j * strides[NT];
    std::array<const char*, N> in;
    for (int k = 0; k < N; ++k) in[k] = data[1 + k] + j * strides[NT + 1 + k];
    for (int64_t i = 0; i < n; ++i) {
      std::array<opmath_t, N> x;
      for (int k = 0; k < N; ++k) x[k] = *reinterpret_cast<const scalar_t*>(in[k] + i * strides[1 + k]);
      *reinterpret_cast<scalar_t*>(po + i * strides[0]) = static_cast<scalar_t>(apply_n(sop, x, idx));
    }
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

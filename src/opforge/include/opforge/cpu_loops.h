// CPU loop for binary elementwise ops over a TensorIterator: vectorized with
// at::vec where the inner dimension is contiguous (or one input is a
// broadcast scalar), a scalar loop otherwise, parallel over the outer work
// through TensorIterator::for_each (at::parallel_for underneath).
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

// Contiguous output; each input contiguous or (kAScalar/kBScalar) a
// broadcast scalar. Templated so the inner loop carries no branches.
template <typename scalar_t, bool kAScalar, bool kBScalar, typename ScalarOp, typename VecOp>
inline void binary_contiguous(scalar_t* out, const scalar_t* a, const scalar_t* b, int64_t n, ScalarOp& sop,
                              VecOp& vop) {
  using IO = VecIO<scalar_t>;
  using opmath_t = typename IO::opmath_t;
  constexpr int64_t W = IO::kWidth;
  if (n <= 0) return;
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512) && (defined(__x86_64__) || defined(_M_X64))
  // at::vec's portable x86 fallback emulates vectors element by element and
  // is far slower than a plain loop the compiler vectorises for SSE2.
  for (int64_t i = 0; i < n; ++i) {
    const opmath_t x = kAScalar ? opmath_t(a[0]) : opmath_t(a[i]);
    const opmath_t y = kBScalar ? opmath_t(b[0]) : opmath_t(b[i]);
    out[i] = static_cast<scalar_t>(sop(x, y));
  }
  return;
#endif
  const auto a_bc = IO::broadcast(a[0]);
  const auto b_bc = IO::broadcast(b[0]);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto x = kAScalar ? a_bc : IO::load(a + i);
    const auto y = kBScalar ? b_bc : IO::load(b + i);
    typename IO::Pack r;
    for (int k = 0; k < IO::kParts; ++k) r.v[k] = vop(x.v[k], y.v[k]);
    IO::store(out + i, r);
  }
  for (; i < n; ++i) {
    const opmath_t x = kAScalar ? opmath_t(a[0]) : opmath_t(a[i]);
    const opmath_t y = kBScalar ? opmath_t(b[0]) : opmath_t(b[i]);
    out[i] = static_cast<scalar_t>(sop(x, y));
  }
}

// One TensorIterator 2-d loop of out = op(a, b) (operand 0 is the output):
// `strides` holds the inner strides of out, a, b, then their outer strides.
template <typename scalar_t, typename ScalarOp, typename VecOp>
void binary_loop2d(char** data, const int64_t* strides, int64_t n, int64_t m, ScalarOp sop, VecOp vop) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t s = sizeof(scalar_t);
  const int64_t so = strides[0], sa = strides[1], sb = strides[2];
  for (int64_t j = 0; j < m; ++j) {
    char* po = data[0] + j * strides[3];
    const char* pa = data[1] + j * strides[4];
    const char* pb = data[2] + j * strides[5];
    auto* out = reinterpret_cast<scalar_t*>(po);
    const auto* a = reinterpret_cast<const scalar_t*>(pa);
    const auto* b = reinterpret_cast<const scalar_t*>(pb);
    if (so == s && sa == s && sb == s) {
      binary_contiguous<scalar_t, false, false>(out, a, b, n, sop, vop);
    } else if (so == s && sa == 0 && sb == s) {
      binary_contiguous<scalar_t, true, false>(out, a, b, n, sop, vop);
    } else if (so == s && sa == s && sb == 0) {
      binary_contiguous<scalar_t, false, true>(out, a, b, n, sop, vop);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const opmath_t x = *reinterpret_cast<const scalar_t*>(pa + i * sa);
        const opmath_t y = *reinterpret_cast<const scalar_t*>(pb + i * sb);
        *reinterpret_cast<scalar_t*>(po + i * so) = static_cast<scalar_t>(sop(x, y));
      }
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace opforge::cpu

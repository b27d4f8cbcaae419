// CPU loops of the softmax family, compiled once per ISA by
// softmax_{default,avx2,avx512}.cpp (which include cpu_isa_begin.h first);
// cpu/softmax.cpp checks the arguments and picks the ISA.
//
// Inner-most dim (inner == 1): parallel over rows; each row is read once
// from memory (max, then exp written to the output -- or to a float scratch
// row for the half types -- while summing, then one scaling pass over the
// cache-resident row). Outer dims (inner > 1): parallel over (outer, block of
// inner columns); each pass walks K with the inner columns vectorised, so no
// transpose copy is made. Arithmetic in opmath (float for the half types),
// results rounded once.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <opforge/cpu_loops.h>
#include <opforge/dispatch.h>

#include "softmax_common.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace {

namespace sm = ::opforge::softmax;
using at::vec::Vectorized;

template <typename T>
using Acc = at::opmath_type<T>;

template <typename T>
constexpr bool kNeedsConvert = !std::is_same_v<T, Acc<T>>;

// n values of T -> opmath.
template <typename T>
inline void to_acc(const T* src, Acc<T>* dst, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    using OVec = typename IO::OVec;
    constexpr int64_t W = IO::kWidth;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const auto p = IO::load(src + i);
      p.v[0].store(dst + i);
      p.v[1].store(dst + i + OVec::size());
    }
    for (; i < n; ++i) dst[i] = static_cast<Acc<T>>(src[i]);
  } else {
    std::copy(src, src + n, dst);
  }
}

// n opmath values -> T, rounded once.
template <typename T>
inline void from_acc(const Acc<T>* src, T* dst, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using OVec = Vectorized<float>;
    constexpr int64_t W = Vectorized<T>::size();
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      at::vec::convert_from_float<T>(OVec::loadu(src + i), OVec::loadu(src + i + OVec::size())).store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  } else {
    std::copy(src, src + n, dst);
  }
}

template <typename A>
inline Vectorized<A> vexp(const Vectorized<A>& v) {
  if constexpr (std::is_same_v<A, float>) {
    // exp_u20 maps NaN to +inf; keep NaN so it propagates as in torch.
    return Vectorized<A>::blendv(v.exp_u20(), v, v != v);
  } else {
    return v.exp();
  }
}

// max that propagates NaN, as torch's reductions do.
template <typename A>
inline A max_nan(A a, A b) {
  return (std::isnan(a) || a > b) ? a : b;
}

template <typename A>
inline A row_max(const A* src, int64_t n) {
  using V = Vectorized<A>;
  return at::vec::reduce_all<A>([](V& a, V& b) { return at::vec::maximum(a, b); }, src, n);
}

// dst[i] = exp(src[i] - m); returns the sum. dst may alias src.
template <typename A>
inline A exp_and_sum(const A* src, A* dst, int64_t n, A m) {
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  const V vm(m);
  V acc0(0), acc1(0);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const V e0 = vexp(V::loadu(src + i) - vm);
    const V e1 = vexp(V::loadu(src + i + W) - vm);
    e0.store(dst + i);
    e1.store(dst + i + W);
    acc0 = acc0 + e0;
    acc1 = acc1 + e1;
  }
  acc0 = acc0 + acc1;
  if (i + W <= n) {
    const V e = vexp(V::loadu(src + i) - vm);
    e.store(dst + i);
    acc0 = acc0 + e;
    i += W;
  }
  if (i < n) {
    const int64_t r = n - i;
    const V e = vexp(V::loadu(src + i, r) - vm);
    e.store(dst + i, r);
    acc0 = acc0 + V::set(V(0), e, r);  // lanes past the row stay 0
  }
  return at::vec::vec_reduce_all<A>([](V& a, V& b) { return a + b; }, acc0);
}

// sum(exp(src - m)) without storing.
template <typename A>
inline A sum_exp(const A* src, int64_t n, A m) {
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  const V vm(m);
  V acc(0);
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = acc + vexp(V::loadu(src + i) - vm);
  if (i < n) {
    const int64_t r = n - i;
    acc = acc + V::set(V(0), vexp(V::loadu(src + i, r) - vm), r);
  }
  return at::vec::vec_reduce_all<A>([](V& a, V& b) { return a + b; }, acc);
}

// ------------------------------------------------------------------ forward, inner-most dim

template <typename T>
void fwd_rows(const sm::FwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const int64_t rows = a.outer;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool masked_mode = a.mode == sm::Mode::ScaledMasked;
  const bool need_buf = kNeedsConvert<T> || masked_mode;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));

  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<A> scratch(need_buf ? K : 0);
    A* buf = scratch.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = in + r * K;
      T* y = out + r * K;
      const A* src;
      if (masked_mode) {
        // buf = x * scale + mask, -inf where masked or above the diagonal.
        const int64_t valid = a.causal ? std::min<int64_t>(K, r % a.Lq + 1) : K;
        to_acc(x, buf, valid);
        const V vs(static_cast<A>(a.scale));
        at::vec::map([vs](V v) { return v * vs; }, buf, buf, valid);
        if (a.mask != nullptr) {
          const int64_t moff = a.mask_rows(r);
          if (a.mask_is_bool) {
            const bool* mk = static_cast<const bool*>(a.mask) + moff;
            for (int64_t j = 0; j < valid; ++j) buf[j] = mk[j] ? -std::numeric_limits<A>::infinity() : buf[j];
          } else {
            const T* mk = static_cast<const T*>(a.mask) + moff;
            if constexpr (kNeedsConvert<T>) {
              for (int64_t j = 0; j < valid; ++j) buf[j] += static_cast<A>(mk[j]);
            } else {
              at::vec::map2([](V u, V w) { return u + w; }, buf, buf, mk, valid);
            }
          }
        }
        for (int64_t j = valid; j < K; ++j) buf[j] = -std::numeric_limits<A>::infinity();
        src = buf;
      } else if constexpr (kNeedsConvert<T>) {
        to_acc(x, buf, K);
        src = buf;
      } else {
        src = x;
      }

      const A m = row_max(src, K);
      if (masked_mode && m == -std::numeric_limits<A>::infinity()) {
        // Every key masked out: zeros (documented), not NaN.
        std::fill(y, y + K, T(0));
        continue;
      }
      if (a.mode == sm::Mode::LogSoftmax) {
        const A c = m + std::log(sum_exp(src, K, m));
        const V vc(c);
        if constexpr (kNeedsConvert<T>) {
          at::vec::map([vc](V v) { return v - vc; }, buf, src, K);
          from_acc(buf, y, K);
        } else {
          at::vec::map([vc](V v) { return v - vc; }, y, src, K);
        }
      } else {
        A* dst;
        if constexpr (kNeedsConvert<T>) {
          dst = buf;
        } else {
          dst = y;
        }
        const A s = exp_and_sum(src, dst, K, m);
        const V inv(A(1) / s);
        at::vec::map([inv](V v) { return v * inv; }, dst, dst, K);
        if constexpr (kNeedsConvert<T>) from_acc(buf, y, K);
      }
    }
  });
}

// ------------------------------------------------------------------ forward, outer dim

constexpr int64_t kColBlock = 64;  // inner columns per task (a multiple of every vector width)

template <typename T>
void fwd_cols(const sm::FwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K, inner = a.inner;
  const int64_t nb = (inner + kColBlock - 1) / kColBlock;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 12) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer * nb, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) A mx[kColBlock], sum[kColBlock], tmp[kColBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / nb;
      const int64_t i0 = (t % nb) * kColBlock;
      const int64_t n = std::min(kColBlock, inner - i0);
      const int64_t base = o * K * inner + i0;
      std::fill(mx, mx + n, -std::numeric_limits<A>::infinity());
      std::fill(sum, sum + n, A(0));
      for (int64_t k = 0; k < K; ++k) {
        to_acc(in + base + k * inner, tmp, n);
        at::vec::map2([](V u, V w) { return at::vec::maximum(u, w); }, mx, mx, tmp, n);
      }
      for (int64_t k = 0; k < K; ++k) {
        to_acc(in + base + k * inner, tmp, n);
        at::vec::map3([](V u, V w, V s) { return s + vexp(u - w); }, sum, tmp, mx, sum, n);
      }
      if (log_mode) {
        for (int64_t j = 0; j < n; ++j) sum[j] = mx[j] + std::log(sum[j]);  // the log-sum-exp
        for (int64_t k = 0; k < K; ++k) {
          to_acc(in + base + k * inner, tmp, n);
          at::vec::map2([](V u, V c) { return u - c; }, tmp, tmp, sum, n);
          from_acc(tmp, out + base + k * inner, n);
        }
      } else {
        for (int64_t j = 0; j < n; ++j) sum[j] = A(1) / sum[j];
        for (int64_t k = 0; k < K; ++k) {
          to_acc(in + base + k * inner, tmp, n);
          at::vec::map3([](V u, V w, V inv) { return vexp(u - w) * inv; }, tmp, tmp, mx, sum, n);
          from_acc(tmp, out + base + k * inner, n);
        }
      }
    }
  });
}

// ------------------------------------------------------------------ backward

template <typename T>
void bwd_rows(const sm::BwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const A scale = a.mode == sm::Mode::ScaledMasked ? static_cast<A>(a.scale) : A(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    std::vector<A> scratch(kNeedsConvert<T> ? 2 * K : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const A* dy;
      const A* y;
      A* dst;
      if constexpr (kNeedsConvert<T>) {
        to_acc(gy + r * K, scratch.data(), K);
        to_acc(yy + r * K, scratch.data() + K, K);
        dy = scratch.data();
        y = scratch.data() + K;
        dst = scratch.data();
      } else {
        dy = gy + r * K;
        y = yy + r * K;
        dst = gx + r * K;
      }
      if (log_mode) {
        const V s(at::vec::reduce_all<A>([](V& u, V& w) { return u + w; }, dy, K));
        at::vec::map2([s](V g, V o) { return g - vexp(o) * s; }, dst, dy, y, K);
      } else {
        const V s(at::vec::map2_reduce_all<A>([](V g, V o) { return g * o; },
                                              [](V u, V w) { return u + w; }, dy, y, K));
        const V vs(scale);
        at::vec::map2([s, vs](V g, V o) { return o * (g - s) * vs; }, dst, dy, y, K);
      }
      if constexpr (kNeedsConvert<T>) from_acc(dst, gx + r * K, K);
    }
  });
}

template <typename T>
void bwd_cols(const sm::BwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K, inner = a.inner;
  const int64_t nb = (inner + kColBlock - 1) / kColBlock;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  const bool log_mode = a.mode == sm::Mode::LogSoftmax;
  const A scale = a.mode == sm::Mode::ScaledMasked ? static_cast<A>(a.scale) : A(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 12) / std::max<int64_t>(K, 1));

  at::parallel_for(0, a.outer * nb, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) A sum[kColBlock], g[kColBlock], o[kColBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t oi = t / nb;
      const int64_t i0 = (t % nb) * kColBlock;
      const int64_t n = std::min(kColBlock, inner - i0);
      const int64_t base = oi * K * inner + i0;
      std::fill(sum, sum + n, A(0));
      for (int64_t k = 0; k < K; ++k) {
        to_acc(gy + base + k * inner, g, n);
        if (log_mode) {
          at::vec::map2([](V s, V u) { return s + u; }, sum, sum, g, n);
        } else {
          to_acc(yy + base + k * inner, o, n);
          at::vec::map3([](V s, V u, V w) { return s + u * w; }, sum, sum, g, o, n);
        }
      }
      const V vs(scale);
      for (int64_t k = 0; k < K; ++k) {
        to_acc(gy + base + k * inner, g, n);
        to_acc(yy + base + k * inner, o, n);
        if (log_mode) {
          at::vec::map3([](V u, V w, V s) { return u - vexp(w) * s; }, g, g, o, sum, n);
        } else {
          at::vec::map3([vs](V u, V w, V s) { return w * (u - s) * vs; }, g, g, o, sum, n);
        }
        from_acc(g, gx + base + k * inner, n);
      }
    }
  });
}

}  // namespace

void softmax_forward(const sm::FwdArgs& a) {
  OPFORGE_DISPATCH_FLOATING_TYPES(a.dtype, "opforge_softmax_forward", [&] {
    if (a.inner == 1) {
      fwd_rows<scalar_t>(a);
    } else {
      fwd_cols<scalar_t>(a);
    }
  });
}

void softmax_backward(const sm::BwdArgs& a) {
  OPFORGE_DISPATCH_FLOATING_TYPES(a.dtype, "opforge_softmax_backward", [&] {
    if (a.inner == 1) {
      bwd_rows<scalar_t>(a);
    } else {
      bwd_cols<scalar_t>(a);
    }
  });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

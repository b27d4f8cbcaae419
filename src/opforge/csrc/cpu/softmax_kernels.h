// CPU loops of the softmax family, compiled once per ISA by
// softmax_{default,avx2,avx512}.cpp (which include cpu_isa_begin.h first);
// cpu/softmax_cpu.cpp checks the arguments and picks the ISA.
//
// Inner-most dim (inner == 1): parallel over rows; each row is read once
// from memory (max, then exp written to the output -- or to a float scratch
// row for the half types -- while summing, then one scaling pass over the
// cache-resident row). Outer dims (inner > 1): parallel over (outer, block of
// inner columns); each pass walks K with the inner columns vectorised, so no
// transpose copy is made. Arithmetic in opmath (float for the half types),
// results rounded once.
//
// Helpers: cpu/softmax_vec.h; forward loops: cpu/softmax_fwd_kernels.h; here the
// backward loops and the entry points.
#include "cpu/softmax_fwd_kernels.h"
#include "cpu/softmax_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace {

// ------------------------------------------------------------------ backward

// sum(dy * y) (softmax) or sum(dy) (log_softmax) over one row, in opmath,
// with several independent accumulators so the adds do not form one chain
// (dy and y loaded alike in ChunkIO's order, which a sum does not see).
template <typename T, bool kLog>
inline Acc<T> bwd_row_sum(const T* dy, const T* y, int64_t K) {
  using A = Acc<T>;
  using IO = VecIO<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  V acc[2 * P];
  for (int k = 0; k < 2 * P; ++k) acc[k] = V(0);
  int64_t i = 0;
  for (; i + 2 * W <= K; i += 2 * W) {
    for (int u = 0; u < 2; ++u) {
      const auto g = ChunkIO<T>::load(dy + i + u * W);
      if constexpr (kLog) {
        for (int k = 0; k < P; ++k) acc[u * P + k] = acc[u * P + k] + g.v[k];
      } else {
        const auto o = ChunkIO<T>::load(y + i + u * W);
        for (int k = 0; k < P; ++k) acc[u * P + k] = at::vec::fmadd(g.v[k], o.v[k], acc[u * P + k]);
      }
    }
  }
  for (; i + W <= K; i += W) {
    const auto g = ChunkIO<T>::load(dy + i);
    if constexpr (kLog) {
      for (int k = 0; k < P; ++k) acc[k] = acc[k] + g.v[k];
    } else {
      const auto o = ChunkIO<T>::load(y + i);
      for (int k = 0; k < P; ++k) acc[k] = at::vec::fmadd(g.v[k], o.v[k], acc[k]);
    }
  }
  for (int k = 1; k < 2 * P; ++k) acc[0] = acc[0] + acc[k];
  A s = at::vec::vec_reduce_all<A>([](V& u, V& w) { return u + w; }, acc[0]);
  for (; i < K; ++i) s += kLog ? static_cast<A>(dy[i]) : static_cast<A>(dy[i]) * static_cast<A>(y[i]);
  return s;
}

// Half types, one row: the sum in one pass over (dy, y) converted on the
// fly, then the result in a second pass (the row is in cache by then); dy
// and y load alike in ChunkIO's order, which its store puts back.
template <typename T>
void bwd_row_reduced(const T* dy, const T* y, T* dx, int64_t K, bool log_mode, float scale) {
  using IO = VecIO<T>;
  using V = Vectorized<float>;
  constexpr int64_t W = IO::kWidth;
  const float s = log_mode ? bwd_row_sum<T, true>(dy, y, K) : bwd_row_sum<T, false>(dy, y, K);
  int64_t i;
  const V vs(s), vscale(scale);
  for (i = 0; i + W <= K; i += W) {
    auto g = ChunkIO<T>::load(dy + i);
    const auto o = ChunkIO<T>::load(y + i);
    for (int k = 0; k < 2; ++k) {
      g.v[k] = log_mode ? g.v[k] - o.v[k].exp() * vs : o.v[k] * (g.v[k] - vs) * vscale;
    }
    ChunkIO<T>::template store<false>(dx + i, g.v[0], g.v[1]);
  }
  for (; i < K; ++i) {
    const float g = static_cast<float>(dy[i]), o = static_cast<float>(y[i]);
    dx[i] = static_cast<T>(log_mode ? g - std::exp(o) * s : o * (g - s) * scale);
  }
}

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
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kNeedsConvert<T>) {
        bwd_row_reduced(gy + r * K, yy + r * K, gx + r * K, K, log_mode, scale);
      } else {
        const A* dy = gy + r * K;
        const A* y = yy + r * K;
        A* dst = gx + r * K;
        if (log_mode) {
          const V s(bwd_row_sum<T, true>(dy, y, K));
          at::vec::map2([s](V g, V o) { return g - o.exp() * s; }, dst, dy, y, K);
        } else {
          const V s(bwd_row_sum<T, false>(dy, y, K));
          const V vs(scale);
          at::vec::map2([s, vs](V g, V o) { return o * (g - s) * vs; }, dst, dy, y, K);
        }
      }
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
          at::vec::map3([](V u, V w, V s) { return u - w.exp() * s; }, g, g, o, sum, n);
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

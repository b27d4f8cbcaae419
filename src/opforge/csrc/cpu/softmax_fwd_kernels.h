// The softmax family's CPU forward loops: rows (the inner-most dim) and
// columns (an outer dim, inner columns vectorised).
// Compiled once per ISA with cpu/softmax_kernels.h, which includes it (after cpu_isa_begin.h).
#pragma once

#include "cpu/softmax_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace {

// ------------------------------------------------------------------ forward, inner-most dim

// y[0, n) = T(buf * mul), rounded once. kChunks: buf holds a half type's
// row written chunk by chunk in ChunkIO's order (the values past the last
// whole chunk in the original one); kFinite: buf holds no NaN.
template <typename T, bool kChunks = false, bool kFinite = false>
inline void scale_out(const Acc<T>* buf, T* y, int64_t n, Acc<T> mul) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = Vectorized<T>::size();
  const V vm(mul);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    if constexpr (kChunks) {
      ChunkIO<T>::template store<kFinite>(y + i, V::loadu(buf + i) * vm, V::loadu(buf + i + V::size()) * vm);
    } else if constexpr (kNeedsConvert<T>) {
      at::vec::convert_from_float<T>(V::loadu(buf + i) * vm, V::loadu(buf + i + V::size()) * vm).store(y + i);
    } else {
      (V::loadu(buf + i) * vm).store(y + i);
    }
  }
  for (; i < n; ++i) y[i] = static_cast<T>(buf[i] * mul);
}

// max of n values of T, computed in opmath (NaN propagates).
template <typename T>
inline Acc<T> in_max(const T* x, int64_t n) {
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    using V = Vectorized<float>;
    constexpr int64_t W = IO::kWidth;
    V m0(-std::numeric_limits<float>::infinity()), m1 = m0;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const auto p = ChunkIO<T>::load(x + i);
      m0 = at::vec::maximum(m0, p.v[0]);
      m1 = at::vec::maximum(m1, p.v[1]);
    }
    m0 = at::vec::maximum(m0, m1);
    float m = at::vec::vec_reduce_all<float>([](V& u, V& w) { return at::vec::maximum(u, w); }, m0);
    for (; i < n; ++i) m = max_nan(m, static_cast<float>(x[i]));
    return m;
  } else {
    return row_max(x, n);
  }
}

// Half types: the last n < 2 * V::size() values of a row, buf[0, n) =
// exp(x - m) by the same exp as the rest of the row; returns their sum.
template <typename T, bool kFinite>
inline float tail_exp_sum(const T* x, float* buf, int64_t n, const ShiftedMax& sm) {
  using V = Vectorized<float>;
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(x[j]);
  V acc(0);
  for (int64_t j = 0; j < n; j += V::size()) {
    const int64_t c = std::min<int64_t>(V::size(), n - j);
    const V e = exp_shifted<T, kFinite>(V::loadu(buf + j, c), sm);
    e.store(buf + j, c);
    acc = acc + V::set(V(0), e, c);  // lanes past the row stay 0
  }
  return at::vec::vec_reduce_all<float>([](V& u, V& w) { return u + w; }, acc);
}

// Half types: buf = exp(x - m) in float; returns the sum. A finite m
// means x holds no NaN and no +inf (exp_for's kFinite).
template <typename T, bool kFinite>
inline float in_exp_sum_pass(const T* x, float* buf, int64_t n, float m) {
  using IO = VecIO<T>;
  using V = Vectorized<float>;
  constexpr int64_t W = IO::kWidth;
  const ShiftedMax sm(m);
  V acc0(0), acc1(0);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const auto p = ChunkIO<T>::load(x + i);
    const V e0 = exp_shifted<T, kFinite>(p.v[0], sm);
    const V e1 = exp_shifted<T, kFinite>(p.v[1], sm);
    e0.store(buf + i);
    e1.store(buf + i + V::size());
    acc0 = acc0 + e0;
    acc1 = acc1 + e1;
  }
  acc0 = acc0 + acc1;
  float s = at::vec::vec_reduce_all<float>([](V& u, V& w) { return u + w; }, acc0);
  if (i < n) s += tail_exp_sum<T, kFinite>(x + i, buf + i, n - i, sm);
  return s;
}

// buf = exp(x - m) in opmath; returns the sum.
template <typename T>
inline Acc<T> in_exp_sum(const T* x, Acc<T>* buf, int64_t n, Acc<T> m) {
  if constexpr (kNeedsConvert<T>) {
    return std::isfinite(m) ? in_exp_sum_pass<T, true>(x, buf, n, m) : in_exp_sum_pass<T, false>(x, buf, n, m);
  } else {
    return exp_and_sum(x, buf, n, m);
  }
}

// Short rows (K <= kShortK): kRows rows at once, so the latency chain of
// each row (max, its horizontal reduction, exp, the sum's reduction, the
// reciprocal) overlaps with the others'. x and y point at kRows consecutive
// rows; buf holds kRows * K opmath values (half types only). Used for the
// half types: for float32 it measured no faster than row by row, and at
// times slower.
constexpr int64_t kShortK = 1024;
constexpr int kRows = 4;

template <typename T>
inline void softmax_short_rows(const T* x, T* y, int64_t K, Acc<T>* buf) {
  static_assert(kNeedsConvert<T>, "half types only");
  using A = Acc<T>;
  using IO = VecIO<T>;
  using V = Vectorized<A>;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  V mx[kRows], acc[kRows];
  for (int r = 0; r < kRows; ++r) mx[r] = V(-std::numeric_limits<A>::infinity());
  int64_t i = 0;
  for (; i + W <= K; i += W) {
    for (int r = 0; r < kRows; ++r) {
      const auto p = ChunkIO<T>::load(x + r * K + i);
      for (int k = 0; k < P; ++k) mx[r] = at::vec::maximum(mx[r], p.v[k]);
    }
  }
  const int64_t body = i;
  A m[kRows], s[kRows];
  ShiftedMax sm[kRows];
  for (int r = 0; r < kRows; ++r) {
    m[r] = at::vec::vec_reduce_all<A>([](V& u, V& w) { return at::vec::maximum(u, w); }, mx[r]);
    for (int64_t j = body; j < K; ++j) m[r] = max_nan(m[r], static_cast<A>(x[r * K + j]));
    sm[r] = ShiftedMax(m[r]);
    acc[r] = V(0);
  }
  // Every max finite: no NaN or +inf in the rows (exp_for's kFinite).
  auto exp_rows = [&](auto finite) {
    constexpr bool kFinite = decltype(finite)::value;
    for (i = 0; i < body; i += W) {
      for (int r = 0; r < kRows; ++r) {
        const auto p = ChunkIO<T>::load(x + r * K + i);
        for (int k = 0; k < P; ++k) {
          const V e = exp_shifted<T, kFinite>(p.v[k], sm[r]);
          e.store(buf + r * K + i + k * V::size());
          acc[r] = acc[r] + e;
        }
      }
    }
    for (int r = 0; r < kRows; ++r) {
      s[r] = at::vec::vec_reduce_all<A>([](V& u, V& w) { return u + w; }, acc[r]);
      if (body < K) s[r] += tail_exp_sum<T, kFinite>(x + r * K + body, buf + r * K + body, K - body, sm[r]);
    }
    for (int r = 0; r < kRows; ++r) scale_out<T, true, kFinite>(buf + r * K, y + r * K, K, A(1) / s[r]);
  };
  if (std::all_of(m, m + kRows, [](A v) { return std::isfinite(v); })) {
    exp_rows(std::true_type{});
  } else {
    exp_rows(std::false_type{});
  }
}

// dst = src * mul with streaming (non-temporal) stores where the ISA has
// them: the output skips the caches, so writing it costs one pass over
// memory instead of two (a normal store first reads the line it fills).
// Callers issue a store fence (stream_fence) before the data is used.
template <typename A>
inline void scale_stream(const A* src, A* dst, int64_t n, A mul) {
  using V = Vectorized<A>;
  const V vm(mul);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    // Regular stores up to the first 64-byte boundary, then whole aligned vectors.
    const int64_t head = std::min<int64_t>(n, ((64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64) / sizeof(A));
    if (reinterpret_cast<std::uintptr_t>(dst) % sizeof(A) == 0) {
      for (; i < head; ++i) dst[i] = src[i] * mul;
      for (; i + V::size() <= n; i += V::size()) {
#if defined(CPU_CAPABILITY_AVX512)
        _mm512_stream_ps(dst + i, V::loadu(src + i) * vm);
#else
        _mm256_stream_ps(dst + i, V::loadu(src + i) * vm);
#endif
      }
    }
  }
#endif
  at::vec::map([vm](V v) { return v * vm; }, dst + i, src + i, n - i);
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// scaled_masked_softmax: buf[j] = -inf where the bool mask is set. AVX2
// float: eight mask bytes widened to a lane mask and blended (the
// element-by-element select took as long as the rest of the row).
template <typename A>
inline void mask_out(const bool* mk, A* buf, int64_t n) {
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(mk);  // a bool is one byte, 0 or 1
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<A, float>) {
    const __m256 ninf = _mm256_set1_ps(kNegInf);
    for (; j + 8 <= n; j += 8) {
      int64_t bytes;
      std::memcpy(&bytes, m8 + j, 8);
      const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
      const __m256 set = _mm256_castsi256_ps(_mm256_cmpgt_epi32(wide, _mm256_setzero_si256()));
      _mm256_storeu_ps(buf + j, _mm256_blendv_ps(_mm256_loadu_ps(buf + j), ninf, set));
    }
  }
#endif
  for (; j < n; ++j) buf[j] = m8[j] ? kNegInf : buf[j];
}

// scaled_masked_softmax: buf += an additive mask of T (converted a vector at
// a time for the half types).
template <typename T>
inline void add_mask(const T* mk, Acc<T>* buf, int64_t n) {
  using V = Vectorized<Acc<T>>;
  if constexpr (kNeedsConvert<T>) {
    using IO = VecIO<T>;
    constexpr int64_t W = IO::kWidth;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
      const auto p = IO::load(mk + j);
      (V::loadu(buf + j) + p.v[0]).store(buf + j);
      (V::loadu(buf + j + V::size()) + p.v[1]).store(buf + j + V::size());
    }
    for (; j < n; ++j) buf[j] += static_cast<float>(mk[j]);
  } else {
    at::vec::map2([](V u, V w) { return u + w; }, buf, buf, mk, n);
  }
}

// Rows [r0, r1) of softmax / scaled_masked_softmax. float: exp(x - max) is
// written to y and scaled in place while the row is in cache. Half types and
// masked rows: buf (K opmath values, cache-line aligned) holds exp(x - max),
// then y is written from it in one pass. Short half-type rows go kRows at a
// time (softmax_short_rows; buf then holds kRows * K values).
template <typename T>
void fwd_rows_range(const sm::FwdArgs& a, int64_t r0, int64_t r1, Acc<T>* buf, bool stream) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const bool masked_mode = a.mode == sm::Mode::ScaledMasked;
  bool next_max_ready = false;
  A next_max = A(0);
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = in + r * K;
    T* y = out + r * K;
    if (masked_mode) {
      // buf[0, valid) = x * scale + mask (-inf where masked); the keys
      // above the diagonal are skipped and come out as 0.
      const int64_t valid = a.causal ? std::min<int64_t>(K, r % a.Lq + 1) : K;
      to_acc(x, buf, valid);
      const V vs(static_cast<A>(a.scale));
      at::vec::map([vs](V v) { return v * vs; }, buf, buf, valid);
      if (a.mask != nullptr) {
        const int64_t moff = a.mask_rows(r);
        if (a.mask_is_bool) {
          mask_out(static_cast<const bool*>(a.mask) + moff, buf, valid);
        } else {
          add_mask(static_cast<const T*>(a.mask) + moff, buf, valid);
        }
      }
      const A m = row_max(buf, valid);
      if (m == -std::numeric_limits<A>::infinity()) {
        // Every key masked out: zeros (documented), not NaN.
        std::fill(buf, buf + K, A(0));
        scale_out<T>(buf, y, K, A(0));
        continue;
      }
      const A s = exp_and_sum(buf, buf, valid, m);
      std::fill(buf + valid, buf + K, A(0));
      scale_out<T>(buf, y, K, A(1) / s);
    } else {
      if constexpr (kNeedsConvert<T>) {
        if (K <= kShortK && r + kRows <= r1) {
          softmax_short_rows(x, y, K, buf);
          r += kRows - 1;
          continue;
        }
      }
      if constexpr (kNeedsConvert<T>) {
        const A m = in_max(x, K);
        const A s = in_exp_sum(x, buf, K, m);
        if (std::isfinite(m)) {
          scale_out<T, true, true>(buf, y, K, A(1) / s);  // a finite max: no NaN
        } else {
          scale_out<T, true>(buf, y, K, A(1) / s);
        }
      } else {
        // float: row r + 1's max is taken in row r's exp pass. With
        // stream (buf set), exp goes to buf and y is written once, by
        // streaming stores.
        const A m = next_max_ready ? next_max : in_max(x, K);
        next_max_ready = r + 1 < r1;
        A* e = stream ? buf : y;
        const A s = next_max_ready ? exp_and_sum_next_max(x, e, K, m, x + K, &next_max) : exp_and_sum(x, e, K, m);
        if (stream) {
          scale_stream(buf, y, K, A(1) / s);
        } else {
          const V inv(A(1) / s);
          at::vec::map([inv](V v) { return v * inv; }, y, y, K);
        }
      }
    }
  }
}

template <typename T>
void fwd_rows_log(const sm::FwdArgs& a) {
  using A = Acc<T>;
  using V = Vectorized<A>;
  const int64_t K = a.K;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    std::vector<A> scratch(kNeedsConvert<T> ? K : 0);
    A* buf = scratch.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = in + r * K;
      T* y = out + r * K;
      // (x - m) - log(sum), not x - (m + log(sum)): m + log(sum) would
      // round at m's magnitude (logits offset by thousands).
      if constexpr (kNeedsConvert<T>) {
        const A m = to_acc_max(x, buf, K);
        const A l = std::log(sum_exp(buf, K, m));
        if (std::isfinite(m)) {
          log_softmax_from_acc<T, true>(buf, y, K, m, l);
        } else {
          log_softmax_from_acc<T, false>(buf, y, K, m, l);
        }
      } else {
        const A m = row_max(x, K);
        const V vm(m), vl(std::log(sum_exp(x, K, m)));
        at::vec::map([vm, vl](V v) { return (v - vm) - vl; }, y, x, K);
      }
    }
  });
}

// The last-level cache one core sees (Linux sysfs; 32 MiB where unknown).
inline int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t v = 0;
    if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      long kib = 0;
      if (std::fscanf(f, "%ldK", &kib) == 1) v = int64_t{kib} << 10;
      std::fclose(f);
    }
    return v > 0 ? v : int64_t{32} << 20;
  }();
  return bytes;
}

// Whether the float softmax forward writes its output with streaming
// stores (exps to a scratch row, then one streaming pass to y): when input
// and output together outgrow the last-level cache, so the output would
// not stay there for the next op anyway, and rows are at most 2048 long.
// Measured on 2 cores (AVX-512, 32 MiB of input): rows of 128 to 2048
// 15-40% faster than writing y twice in cache (exp, then the scaling);
// rows of 4096 and 8192 17-20% slower (the streaming pass over a long row
// no longer overlaps the next row's loads), so they keep the cached path.
constexpr int64_t kStreamMaxK = 2048;

template <typename T>
bool stream_output(const sm::FwdArgs& a) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    const int64_t bytes = 2 * a.outer * a.K * static_cast<int64_t>(sizeof(T));
    return a.mode == sm::Mode::Softmax && a.K <= kStreamMaxK && bytes > last_level_cache_bytes();
  }
}

template <typename T>
void fwd_rows(const sm::FwdArgs& a) {
  using A = Acc<T>;
  if (a.mode == sm::Mode::LogSoftmax) {
    fwd_rows_log<T>(a);
    return;
  }
  const int64_t K = a.K;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(K, 1));
  at::parallel_for(0, a.outer, grain, [&](int64_t r0, int64_t r1) {
    // Aligned to a cache line, so no vector access to it splits a line.
    constexpr int64_t kPad = 64 / sizeof(A);
    const bool half_or_masked = kNeedsConvert<T> || a.mode == sm::Mode::ScaledMasked;
    const bool stream = stream_output<T>(a);
    const int64_t buf_len = half_or_masked ? (kNeedsConvert<T> && K <= kShortK ? kRows * K : K) : (stream ? K : 0);
    const bool need_buf = buf_len > 0;
    std::vector<A> scratch(need_buf ? buf_len + kPad : 0);
    A* buf = scratch.data();
    if (need_buf) buf += (kPad - (reinterpret_cast<std::uintptr_t>(buf) % 64) / sizeof(A)) % kPad;
    fwd_rows_range<T>(a, r0, r1, buf, stream);
    if (stream) stream_fence();
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
        for (int64_t j = 0; j < n; ++j) sum[j] = std::log(sum[j]);  // (x - m) - log(sum), as the rows
        for (int64_t k = 0; k < K; ++k) {
          to_acc(in + base + k * inner, tmp, n);
          at::vec::map3([](V u, V w, V l) { return (u - w) - l; }, tmp, tmp, mx, sum, n);
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

}  // namespace
}  // namespace opforge::cpu::CPU_CAPABILITY

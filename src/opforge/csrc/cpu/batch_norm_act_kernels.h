// CPU loops of the training-mode batch norm + activation engine, compiled
// once per ISA by batch_norm_act_{default,avx2,avx512}.cpp (which include
// cpu_isa_begin.h first); batch_norm_act_cpu.cpp checks the tensors and
// picks the ISA.
//
// NCHW: parallel over channels; a task walks its channel's N planes in each
// pass while they sit in cache. channels_last: parallel over blocks of the
// N * H * W rows of C values, each block's per-channel partial sums merged
// after, then the elementwise pass over rows. Sums run in float vector lanes
// over at most kFlush values a lane and are combined in double: the two
// passes (sum, then squares about the mean) stay accurate on large planes.
// Arithmetic in float; values are rounded where torch's modules round them
// (the batch norm's output, the activation's gradient) for the half types.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/activation_grad_vec.h"
#include "cpu/batch_norm_act_params.h"
#include "cpu/conv_vec.h"

namespace opforge::cpu::CPU_CAPABILITY {
namespace bn_detail {

using batch_norm::CpuBackwardArgs;
using batch_norm::CpuForwardArgs;
using batch_norm::CpuLayout;
using conv_detail::act_vec;
using conv_detail::VecIo;
using Vf = at::vec::Vectorized<float>;
constexpr int L = Vf::size();
constexpr int64_t kFlush = 256;        // rows (or vectors of a plane) summed in float before a double add
constexpr int64_t kGrain = 32 * 1024;  // values a task handles at least: less is not worth a thread
constexpr int kChunkVecs = 4;          // channel vectors a channels_last pass keeps in registers

// v rounded to T and back (the half types), as a tensor of T holds it.
template <typename T>
inline Vf rounded(const Vf& v) {
  if constexpr (VecIo<T>::kSame) {
    return v;
  } else {
    T buf[L];
    VecIo<T>::store(buf, v);
    return VecIo<T>::load(buf);
  }
}

template <typename T>
inline Vf load(const T* p, int n) {
  return n == L ? VecIo<T>::load(p) : VecIo<T>::load(p, n);
}

template <typename T>
inline void store(T* p, const Vf& v, int n) {
  if (n == L) {
    VecIo<T>::store(p, v);
  } else {
    VecIo<T>::store(p, v, n);
  }
}

// A per-channel float row of the stats table (or of the coefficients) at
// channel c as a vector: channels_last reads lanes c..c+n, NCHW broadcasts c.
inline Vf coef(const float* row, int64_t c, int n, bool per_lane) {
  if (!per_lane) return Vf(row[c]);
  return n == L ? Vf::loadu(row + c) : Vf::loadu(row + c, n);
}

inline double lane_sum(const Vf& v) {
  float buf[L];
  v.store(buf);
  double s = 0;
  for (int i = 0; i < L; ++i) s += buf[i];
  return s;
}

// s[c + i] += lanes i < n of v.
inline void add_lanes(double* s, const Vf& v, int n) {
  float buf[L];
  v.store(buf);
  for (int i = 0; i < n; ++i) s[i] += buf[i];
}

// ------------------------------------------------------------------ the passes' per-vector work
// Each op: Coefs at(c, n, per_lane) holds the channel's coefficients as
// vectors; sum(off, k, n, a0, a1) adds one vector's terms to two sums (lanes
// n.. must add 0: a plane's lanes are summed whole); write(off, k, n) is the
// elementwise pass.

template <typename T>
struct SumOp {  // a0 += y
  const T* y;
  struct Coefs {};
  Coefs at(int64_t, int, bool) const { return {}; }
  void sum(int64_t off, const Coefs&, int n, Vf& a0, Vf&) const { a0 = a0 + load(y + off, n); }
};

template <typename T>
struct SquareOp {  // a0 += (y - mean)^2
  const T* y;
  const float* mean;
  struct Coefs {
    Vf mean;
  };
  Coefs at(int64_t c, int n, bool per_lane) const { return {coef(mean, c, n, per_lane)}; }
  void sum(int64_t off, const Coefs& k, int n, Vf& a0, Vf&) const {
    Vf d = load(y + off, n) - k.mean;
    if (n < L) d = Vf::set(Vf(0), d, n);  // lanes past the tail load 0, not mean: they add nothing
    a0 = at::vec::fmadd(d, d, a0);
  }
};

// out = act(rounded(y * scale + shift)).
template <typename T>
struct NormalizeOp {
  const T* y;
  T* out;
  const float *scale, *shift;
  Activation act;
  struct Coefs {
    Vf scale, shift;
  };
  Coefs at(int64_t c, int n, bool per_lane) const { return {coef(scale, c, n, per_lane), coef(shift, c, n, per_lane)}; }
  void write(int64_t off, const Coefs& k, int n) const {
    const Vf z = rounded<T>(at::vec::fmadd(load(y + off, n), k.scale, k.shift));
    store(out + off, act_vec(z, act), n);
  }
};

// g = grad * act'(z), z recomputed from y, rounded as torch's activation backward rounds it.
template <typename T>
inline Vf through_activation(const Vf& grad, const Vf& y, const Vf& scale, const Vf& shift, Activation act) {
  if (act == Activation::None) return grad;
  const Vf z = rounded<T>(at::vec::fmadd(y, scale, shift));
  const Vf g = act_grad_vec(grad, z, act);
  return (act == Activation::Hardswish || act == Activation::Silu) ? rounded<T>(g) : g;
}

// a0 += g, a1 += g * (y - mean).
template <typename T>
struct GradSumOp {
  const T *grad, *y;
  const float *mean, *scale, *shift;
  Activation act;
  struct Coefs {
    Vf mean, scale, shift;
  };
  Coefs at(int64_t c, int n, bool per_lane) const {
    return {coef(mean, c, n, per_lane), coef(scale, c, n, per_lane), coef(shift, c, n, per_lane)};
  }
  void sum(int64_t off, const Coefs& k, int n, Vf& a0, Vf& a1) const {
    const Vf yv = load(y + off, n);
    const Vf g = through_activation<T>(load(grad + off, n), yv, k.scale, k.shift, act);
    a0 = a0 + g;
    a1 = at::vec::fmadd(g, yv - k.mean, a1);
  }
};

// dy = a * g + b * y + d (the batch norm's backward as per-channel coefficients).
template <typename T>
struct GradInputOp {
  const T *grad, *y;
  T* dy;
  const float *scale, *shift, *a, *b, *d;
  Activation act;
  struct Coefs {
    Vf scale, shift, a, b, d;
  };
  Coefs at(int64_t c, int n, bool per_lane) const {
    return {coef(scale, c, n, per_lane), coef(shift, c, n, per_lane), coef(a, c, n, per_lane), coef(b, c, n, per_lane),
            coef(d, c, n, per_lane)};
  }
  void write(int64_t off, const Coefs& k, int n) const {
    const Vf yv = load(y + off, n);
    const Vf g = through_activation<T>(load(grad + off, n), yv, k.scale, k.shift, act);
    store(dy + off, at::vec::fmadd(k.a, g, at::vec::fmadd(k.b, yv, k.d)), n);
  }
};

// ------------------------------------------------------------------ NCHW: one channel's planes

// Sums of op over channel c's N planes of HW values: float lanes over at most
// kFlush vectors, then double.
template <typename Op>
inline void sum_channel(const CpuLayout& g, int64_t c, const Op& op, double& s0, double& s1) {
  const auto full = op.at(c, L, false);
  s0 = s1 = 0;
  for (int64_t p = 0; p < g.N; ++p) {
    const int64_t base = (p * g.C + c) * g.HW;
    for (int64_t i0 = 0; i0 < g.HW; i0 += kFlush * L) {
      const int64_t i1 = std::min(g.HW, i0 + kFlush * L);
      Vf a0(0), a1(0), b0(0), b1(0);
      int64_t i = i0;
      for (; i + 2 * L <= i1; i += 2 * L) {
        op.sum(base + i, full, L, a0, a1);
        op.sum(base + i + L, full, L, b0, b1);
      }
      for (; i < i1; i += L) op.sum(base + i, full, static_cast<int>(std::min<int64_t>(L, i1 - i)), a0, a1);
      s0 += lane_sum(a0 + b0);
      s1 += lane_sum(a1 + b1);
    }
  }
}

template <typename Op>
inline void write_channel(const CpuLayout& g, int64_t c, const Op& op) {
  const auto k = op.at(c, L, false);
  for (int64_t p = 0; p < g.N; ++p) {
    const int64_t base = (p * g.C + c) * g.HW;
    int64_t i = 0;
    for (; i + L <= g.HW; i += L) op.write(base + i, k, L);
    if (i < g.HW) op.write(base + i, k, static_cast<int>(g.HW - i));
  }
}

// ------------------------------------------------------------------ channels_last: blocks of rows

// Sums of op over rows [r0, r1) for NV channel vectors from c0 (the last one
// n_last lanes wide), added to s0[c], s1[c].
template <int NV, typename Op>
inline void sum_rows_chunk(const CpuLayout& g, int64_t r0, int64_t r1, int64_t c0, int n_last, const Op& op, double* s0,
                           double* s1) {
  typename Op::Coefs k[NV];
  for (int j = 0; j < NV; ++j) k[j] = op.at(c0 + j * L, j == NV - 1 ? n_last : L, true);
  for (int64_t rs = r0; rs < r1; rs += kFlush) {
    const int64_t re = std::min(r1, rs + kFlush);
    Vf a0[NV], a1[NV];
    for (int j = 0; j < NV; ++j) a0[j] = a1[j] = Vf(0);
    for (int64_t r = rs; r < re; ++r) {
      const int64_t off = r * g.C + c0;
      for (int j = 0; j < NV - 1; ++j) op.sum(off + j * L, k[j], L, a0[j], a1[j]);
      op.sum(off + (NV - 1) * L, k[NV - 1], n_last, a0[NV - 1], a1[NV - 1]);
    }
    for (int j = 0; j < NV; ++j) {
      const int n = j == NV - 1 ? n_last : L;
      add_lanes(s0 + c0 + j * L, a0[j], n);
      add_lanes(s1 + c0 + j * L, a1[j], n);
    }
  }
}

// Channel chunks of kChunkVecs vectors, then the rest (1 to kChunkVecs vectors, the last one partial).
template <typename Op>
inline void sum_rows(const CpuLayout& g, int64_t r0, int64_t r1, const Op& op, double* s0, double* s1) {
  int64_t c0 = 0;
  for (; c0 + kChunkVecs * L <= g.C; c0 += kChunkVecs * L) sum_rows_chunk<kChunkVecs>(g, r0, r1, c0, L, op, s0, s1);
  const int64_t rest = g.C - c0;
  if (rest == 0) return;
  const int vecs = static_cast<int>((rest + L - 1) / L);
  const int n_last = static_cast<int>(rest - (vecs - 1) * L);
  switch (vecs) {
    case 1:
      return sum_rows_chunk<1>(g, r0, r1, c0, n_last, op, s0, s1);
    case 2:
      return sum_rows_chunk<2>(g, r0, r1, c0, n_last, op, s0, s1);
    case 3:
      return sum_rows_chunk<3>(g, r0, r1, c0, n_last, op, s0, s1);
    default:
      return sum_rows_chunk<4>(g, r0, r1, c0, n_last, op, s0, s1);
  }
}

// Row blocks of at least kGrain values, at most one per thread.
inline int64_t row_blocks(const CpuLayout& g) {
  const int64_t rows = g.N * g.HW;
  return std::max<int64_t>(1, std::min<int64_t>({rows, g.numel() / kGrain, at::get_num_threads()}));
}

// f(block, r0, r1) for each row block, in parallel where there are several.
template <typename F>
inline void for_row_blocks(const CpuLayout& g, int64_t blocks, const F& f) {
  const int64_t rows = g.N * g.HW;
  auto run = [&](int64_t b) { f(b, rows * b / blocks, rows * (b + 1) / blocks); };
  if (blocks == 1) return run(0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) run(b);
  });
}

// Per-channel sums of op over all rows into s0, s1 (C each): each block into
// its own slice of part (blocks x 2C doubles), merged in block order.
template <typename Op>
inline void sum_all_rows(const CpuLayout& g, int64_t blocks, const Op& op, std::vector<double>& part, double* s0,
                         double* s1) {
  const int64_t C = g.C;
  part.assign(static_cast<size_t>(blocks * 2 * C), 0.0);
  for_row_blocks(g, blocks, [&](int64_t b, int64_t r0, int64_t r1) {
    sum_rows(g, r0, r1, op, part.data() + b * 2 * C, part.data() + b * 2 * C + C);
  });
  for (int64_t c = 0; c < C; ++c) {
    double a = 0, d = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      a += part[b * 2 * C + c];
      d += part[b * 2 * C + C + c];
    }
    s0[c] = a;
    s1[c] = d;
  }
}

template <typename Op>
inline void write_all_rows(const CpuLayout& g, int64_t blocks, const Op& op) {
  const int64_t C = g.C;
  for_row_blocks(g, blocks, [&](int64_t, int64_t r0, int64_t r1) {
    for (int64_t c0 = 0; c0 < C; c0 += kChunkVecs * L) {
      // A chunk's coefficients in registers over the block's rows.
      const int64_t c1 = std::min(C, c0 + kChunkVecs * L);
      typename Op::Coefs k[kChunkVecs];
      int n[kChunkVecs];
      const int vecs = static_cast<int>((c1 - c0 + L - 1) / L);
      for (int j = 0; j < vecs; ++j) {
        n[j] = static_cast<int>(std::min<int64_t>(L, c1 - c0 - j * L));
        k[j] = op.at(c0 + j * L, n[j], true);
      }
      for (int64_t r = r0; r < r1; ++r) {
        for (int j = 0; j < vecs; ++j) op.write(r * C + c0 + j * L, k[j], n[j]);
      }
    }
  });
}

// ------------------------------------------------------------------ per-channel arithmetic

template <typename W>
inline float param(const void* p, int64_t c, float fallback) {
  return p == nullptr ? fallback : static_cast<float>(static_cast<const W*>(p)[c]);
}

// The stats table's entries for channel c, and the running statistics' update.
template <typename W>
inline void finish_channel(const CpuForwardArgs& a, int64_t c, double mean, double sum_sq) {
  const int64_t C = a.layout.C;
  const double n = static_cast<double>(a.layout.N * a.layout.HW);
  const double var = sum_sq / n;
  const float invstd = static_cast<float>(1.0 / std::sqrt(var + a.eps));
  const float scale = param<W>(a.weight, c, 1.f) * invstd;
  a.stats[batch_norm::kCpuMean * C + c] = static_cast<float>(mean);
  a.stats[batch_norm::kCpuInvstd * C + c] = invstd;
  a.stats[batch_norm::kCpuScale * C + c] = scale;
  a.stats[batch_norm::kCpuShift * C + c] = param<W>(a.bias, c, 0.f) - static_cast<float>(mean) * scale;
  if (a.running_mean != nullptr) {
    W* rm = static_cast<W*>(a.running_mean);
    W* rv = static_cast<W*>(a.running_var);
    const double m = a.momentum;
    rm[c] = static_cast<W>((1 - m) * static_cast<double>(rm[c]) + m * mean);
    rv[c] = static_cast<W>((1 - m) * static_cast<double>(rv[c]) + m * var * n / (n - 1));
  }
}

// grad weight and bias of channel c, and the coefficients of
// dy = scale * (g - sum_g / n - (y - mean) * invstd^2 * sum_gy / n) as a * g + b * y + d.
template <typename W>
inline void finish_grad_channel(const CpuBackwardArgs& a, int64_t c, double sum_g, double sum_gy, float* coefs) {
  const int64_t C = a.layout.C;
  const double n = static_cast<double>(a.layout.N * a.layout.HW);
  const double invstd = a.stats[batch_norm::kCpuInvstd * C + c];
  const double scale = a.stats[batch_norm::kCpuScale * C + c];
  const double mean = a.stats[batch_norm::kCpuMean * C + c];
  if (a.grad_weight != nullptr) static_cast<W*>(a.grad_weight)[c] = static_cast<W>(sum_gy * invstd);
  if (a.grad_bias != nullptr) static_cast<W*>(a.grad_bias)[c] = static_cast<W>(sum_g);
  const double slope = invstd * invstd * sum_gy / n;
  coefs[c] = static_cast<float>(scale);
  coefs[C + c] = static_cast<float>(-scale * slope);
  coefs[2 * C + c] = static_cast<float>(scale * (slope * mean - sum_g / n));
}

// ------------------------------------------------------------------ the engine

template <typename T, typename W>
void forward(const CpuForwardArgs& a) {
  const CpuLayout& g = a.layout;
  const int64_t C = g.C;
  const T* y = static_cast<const T*>(a.y);
  const double n = static_cast<double>(g.N * g.HW);
  float* mean = a.stats + batch_norm::kCpuMean * C;
  const NormalizeOp<T> norm{y, static_cast<T*>(a.out), a.stats + batch_norm::kCpuScale * C,
                            a.stats + batch_norm::kCpuShift * C, a.act};
  if (!g.channels_last) {
    const int64_t grain = std::max<int64_t>(1, kGrain / (g.N * g.HW));
    at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        double s, unused;
        sum_channel(g, c, SumOp<T>{y}, s, unused);
        const double mu = s / n;
        mean[c] = static_cast<float>(mu);
        double sq;
        sum_channel(g, c, SquareOp<T>{y, mean}, sq, unused);
        finish_channel<W>(a, c, mu, sq);
        write_channel(g, c, norm);
      }
    });
    return;
  }
  const int64_t blocks = row_blocks(g);
  std::vector<double> part, sums(static_cast<size_t>(2 * C));
  double *s0 = sums.data(), *s1 = sums.data() + C;
  sum_all_rows(g, blocks, SumOp<T>{y}, part, s0, s1);
  for (int64_t c = 0; c < C; ++c) mean[c] = static_cast<float>(s0[c] / n);
  // The squares about the float mean the next pass subtracts; the mean itself kept in double.
  std::vector<double> mu(s0, s0 + C);
  sum_all_rows(g, blocks, SquareOp<T>{y, mean}, part, s0, s1);
  for (int64_t c = 0; c < C; ++c) finish_channel<W>(a, c, mu[c] / n, s0[c]);
  write_all_rows(g, blocks, norm);
}

template <typename T, typename W>
void backward(const CpuBackwardArgs& a) {
  const CpuLayout& g = a.layout;
  const int64_t C = g.C;
  const T* grad = static_cast<const T*>(a.grad);
  const T* y = static_cast<const T*>(a.y);
  const float* mean = a.stats + batch_norm::kCpuMean * C;
  const float* scale = a.stats + batch_norm::kCpuScale * C;
  const float* shift = a.stats + batch_norm::kCpuShift * C;
  const GradSumOp<T> sums_op{grad, y, mean, scale, shift, a.act};
  std::vector<float> coefs(static_cast<size_t>(3 * C));
  const GradInputOp<T> input_op{
      grad, y, static_cast<T*>(a.dy), scale, shift, coefs.data(), coefs.data() + C, coefs.data() + 2 * C, a.act};
  if (!g.channels_last) {
    const int64_t grain = std::max<int64_t>(1, kGrain / (g.N * g.HW));
    at::parallel_for(0, C, grain, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        double sum_g, sum_gy;
        sum_channel(g, c, sums_op, sum_g, sum_gy);
        finish_grad_channel<W>(a, c, sum_g, sum_gy, coefs.data());
        if (a.dy != nullptr) write_channel(g, c, input_op);
      }
    });
    return;
  }
  const int64_t blocks = row_blocks(g);
  std::vector<double> part, sums(static_cast<size_t>(2 * C));
  sum_all_rows(g, blocks, sums_op, part, sums.data(), sums.data() + C);
  for (int64_t c = 0; c < C; ++c) finish_grad_channel<W>(a, c, sums[c], sums[C + c], coefs.data());
  if (a.dy != nullptr) write_all_rows(g, blocks, input_op);
}

// f(T{}, W{}): y's dtype T and the parameters' W (T's or float).
template <typename F>
void with_types(c10::ScalarType dtype, c10::ScalarType param_dtype, const F& f) {
  auto with_w = [&](auto t) {
    using T = decltype(t);
    if (param_dtype == c10::ScalarType::Float) return f(T{}, float{});
    f(T{}, T{});
  };
  if (dtype == c10::ScalarType::Float) return with_w(float{});
  if (dtype == c10::ScalarType::Half) return with_w(c10::Half{});
  with_w(c10::BFloat16{});
}

}  // namespace bn_detail

void batch_norm_act_forward(const batch_norm::CpuForwardArgs& a) {
  bn_detail::with_types(a.dtype, a.param_dtype,
                        [&](auto t, auto w) { bn_detail::forward<decltype(t), decltype(w)>(a); });
}

void batch_norm_act_backward(const batch_norm::CpuBackwardArgs& a) {
  bn_detail::with_types(a.dtype, a.param_dtype,
                        [&](auto t, auto w) { bn_detail::backward<decltype(t), decltype(w)>(a); });
}

}  // namespace opforge::cpu::CPU_CAPABILITY

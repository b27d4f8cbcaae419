// Training-mode batch norm [+ residual] + activation on a channels_last
// tensor seen as (rows, C), rows = N * H * W, three launches each way:
//  1. a reduction over rows: thread (lane, row lane) of a block owns V
//     channels (one 16-byte vector) of a chunk of at most 32 vectors and
//     every R-th row of its row block, so a warp reads contiguous memory;
//     the block's row lanes merge in a shared-memory tree and one partial
//     per (row block, channel) is written;
//  2. a per-channel merge of the partials (32 channels x 32 partial lanes a
//     block, fixed order: the result is deterministic, no atomics);
//  3. the elementwise pass, tiled as 1 (with more row blocks), the
//     channels' coefficients held in registers.
// The forward's statistics are sums of y - y[row 0] (a per-channel shift
// near the mean, so the variance's two terms do not cancel) in float32.
// Values are rounded where torch's modules round them (the batch norm's
// output, the activation's gradient), so the result matches theirs.
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <opforge/cuda_launch.cuh>
#include <opforge/cuda_vec.cuh>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/batch_norm_act.h"

namespace opforge::batch_norm {
namespace {

using opforge::cuda::AlignedVec;
using opforge::cuda::load_vec;
using opforge::cuda::store_vec;

constexpr int kThreads = 256;
constexpr int kMergeChannels = 32;
constexpr int kMergeLanes = 32;
// Rows of the (stats) table: per channel mean, 1 / std, scale and the shift beta.
enum Stat : int { kMean, kInvstd, kScale, kBeta, kStats };

constexpr int kMaxLanes = 32;      // a warp across one row's chunk: 512 contiguous bytes
constexpr int kMaxPartials = 256;  // row blocks of a reduction: what one merge thread sums, times 32
constexpr int kPartialShare = 8;   // a reduction's partials: at most 1/8 of the bytes it reads

struct Tiling {
  int64_t rows;
  int C;
  int V;           // channels per thread: one vector access
  int lanes;       // threads across one chunk of channels
  int R;           // rows a block covers at once: a power of two, lanes * R <= kThreads
  int chunks;      // channel chunks (grid.y)
  int row_blocks;  // grid.x
  dim3 grid() const { return dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(chunks)); }
  int threads() const { return lanes * R; }
};

// Channels split into chunks of at most kMaxLanes vectors (wide tensors get
// more blocks without more partials per channel); row blocks enough for
// blocks_per_sm blocks an SM, at least rows_per_thread rows a thread. A
// reduction (partials = true) also keeps its partials few next to its data.
Tiling make_tiling(int64_t rows, int C, int V, int64_t itemsize, bool partials) {
  Tiling t{};
  t.rows = rows;
  t.C = C;
  t.V = V;
  const int vecs = C / V;
  t.chunks = (vecs + kMaxLanes - 1) / kMaxLanes;
  t.lanes = (vecs + t.chunks - 1) / t.chunks;
  t.R = 1;
  while (t.R * 2 * t.lanes <= kThreads) t.R *= 2;
  const int rows_per_thread = partials ? 4 : 2;
  int64_t blocks = std::min<int64_t>(std::max<int64_t>(1, rows / (int64_t{t.R} * rows_per_thread)),
                                     std::max<int64_t>(1, int64_t{8} * opforge::cuda::sm_count() / t.chunks));
  if (partials) {
    // partials: row_blocks * 2 * C floats, against rows * C * itemsize bytes read.
    const int64_t share = rows * itemsize / (8 * kPartialShare);
    blocks = std::min<int64_t>({blocks, kMaxPartials, std::max<int64_t>(1, share)});
  }
  t.row_blocks = static_cast<int>(std::min<int64_t>(blocks, 65535));
  return t;
}

// The calling thread's place in the tiling.
struct Place {
  int lane, row_lane, vec;  // vec: the thread's channel vector, channels vec * V ...
  bool active;
};

__device__ inline Place place(int lanes, int vecs) {
  Place p;
  p.lane = threadIdx.x % lanes;
  p.row_lane = threadIdx.x / lanes;
  p.vec = blockIdx.y * lanes + p.lane;
  p.active = p.vec < vecs;
  return p;
}

// use(row, load(row)) for row = first, first + step, ... < rows, U loads in flight at a time.
template <int U, typename Load, typename Use>
__device__ __forceinline__ void over_rows(int64_t r, int64_t step, int64_t rows, Load load, Use use) {
  for (; r + (U - 1) * step < rows; r += U * step) {
    decltype(load(r)) v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load(r + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) use(r + u * step, v[u]);
  }
  for (; r < rows; r += step) use(r, load(r));
}

// Sums acc over the block's R row lanes (a tree in a fixed order); row lane 0 holds the sums.
// Every thread of the block calls it.
template <int N>
__device__ inline void reduce_row_lanes(float (&acc)[N], float* sh, int lanes, int R) {
  const int tid = threadIdx.x, B = blockDim.x;
#pragma unroll
  for (int k = 0; k < N; ++k) sh[k * B + tid] = acc[k];
  __syncthreads();
  for (int s = R / 2; s >= 1; s /= 2) {
    if (tid < s * lanes) {
#pragma unroll
      for (int k = 0; k < N; ++k) sh[k * B + tid] += sh[k * B + tid + s * lanes];
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < N; ++k) acc[k] = sh[k * B + tid];
}

// Sums acc (two sums per channel: acc[0, V) and acc[V, 2V)) over the block's row lanes and
// writes them as the block's partials, part laid out (row block, 2, C).
template <int V>
__device__ inline void block_partials(float (&acc)[2 * V], float* sh, const Place& p, int C, int lanes, int R,
                                      float* __restrict__ part) {
  reduce_row_lanes(acc, sh, lanes, R);
  if (p.row_lane != 0 || !p.active) return;
  float* out = part + int64_t{blockIdx.x} * 2 * C + int64_t{p.vec} * V;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    out[v] = acc[v];
    out[C + v] = acc[V + v];
  }
}

// The value as torch's modules hold it: rounded to the tensor's dtype.
template <typename T>
__device__ inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T, int V>
__global__ void stats_partial(const T* __restrict__ y, int64_t rows, int C, int lanes, int R,
                              float* __restrict__ part) {
  extern __shared__ float sh[];
  const int vecs = C / V;
  const Place p = place(lanes, vecs);
  float acc[2 * V] = {};
  if (p.active) {
    float shift[V];
    const auto first = load_vec<T, V>(y, p.vec);
#pragma unroll
    for (int v = 0; v < V; ++v) shift[v] = static_cast<float>(first.val[v]);
    over_rows<4>(
        int64_t{blockIdx.x} * R + p.row_lane, int64_t{gridDim.x} * R, rows,
        [&](int64_t r) { return load_vec<T, V>(y, r * vecs + p.vec); },
        [&](int64_t, const AlignedVec<T, V>& a) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const float d = static_cast<float>(a.val[v]) - shift[v];
            acc[v] += d;
            acc[V + v] += d * d;
          }
        });
  }
  block_partials<V>(acc, sh, p, C, lanes, R, part);
}

// Per channel c, the sums of the partials' two rows (s0, s1), merged in a fixed order.
__device__ inline bool merge_partials(const float* __restrict__ part, int row_blocks, int C, float& s0, float& s1) {
  __shared__ float sh[2][kMergeLanes][kMergeChannels];
  const int c = blockIdx.x * kMergeChannels + threadIdx.x;
  s0 = 0.f;
  s1 = 0.f;
  if (c < C) {
    for (int b = threadIdx.y; b < row_blocks; b += kMergeLanes) {
      s0 += part[int64_t{b} * 2 * C + c];
      s1 += part[int64_t{b} * 2 * C + C + c];
    }
  }
  sh[0][threadIdx.y][threadIdx.x] = s0;
  sh[1][threadIdx.y][threadIdx.x] = s1;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return false;
  for (int j = 1; j < kMergeLanes; ++j) {
    s0 += sh[0][j][threadIdx.x];
    s1 += sh[1][j][threadIdx.x];
  }
  return true;
}

template <typename W>
__device__ inline float param(const W* p, int c, float fallback) {
  return p == nullptr ? fallback : static_cast<float>(p[c]);
}

// Per channel: the batch statistics, the running statistics' update, and the stats table.
template <typename T, typename W>
__global__ void stats_merge(const float* __restrict__ part, int row_blocks, int C, int64_t rows,
                            const T* __restrict__ y, float eps, float momentum, const W* weight, const W* bias,
                            W* running_mean, W* running_var, float* __restrict__ stats) {
  float sum, sum_sq;
  if (!merge_partials(part, row_blocks, C, sum, sum_sq)) return;
  const int c = blockIdx.x * kMergeChannels + threadIdx.x;
  const float n = static_cast<float>(rows);
  const float shifted_mean = sum / n;
  const float var = fmaxf(sum_sq / n - shifted_mean * shifted_mean, 0.f);
  const float mean = static_cast<float>(y[c]) + shifted_mean;
  const float invstd = 1.f / sqrtf(var + eps);
  stats[kMean * C + c] = mean;
  stats[kInvstd * C + c] = invstd;
  stats[kScale * C + c] = param(weight, c, 1.f) * invstd;
  stats[kBeta * C + c] = param(bias, c, 0.f);
  if (running_mean != nullptr) {
    const float unbiased = var * (n / (n - 1.f));
    running_mean[c] = static_cast<W>(momentum * mean + (1.f - momentum) * static_cast<float>(running_mean[c]));
    running_var[c] = static_cast<W>(momentum * unbiased + (1.f - momentum) * static_cast<float>(running_var[c]));
  }
}

// The thread's channels' (mean, scale, beta) from the stats table.
template <int V>
struct Coefficients {
  float mean[V], scale[V], beta[V];
  __device__ Coefficients(const float* stats, int C, int c0) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      mean[v] = stats[kMean * C + c0 + v];
      scale[v] = stats[kScale * C + c0 + v];
      beta[v] = stats[kBeta * C + c0 + v];
    }
  }
  // The batch norm's output for channel v, as the tensor's dtype holds it.
  template <typename T>
  __device__ float normed(float y, int v) const {
    return rounded<T>((y - mean[v]) * scale[v] + beta[v]);
  }
};

// y and, where a residual is added, its values at the same place.
template <typename T, int V>
struct InputAndResidual {
  AlignedVec<T, V> y, res;
};

template <typename T, int V>
__device__ inline InputAndResidual<T, V> load_input(const T* __restrict__ y, const T* __restrict__ res, int64_t i) {
  InputAndResidual<T, V> a;
  a.y = load_vec<T, V>(y, i);
  if (res != nullptr) a.res = load_vec<T, V>(res, i);
  return a;
}

// The activation's input: bn(y), plus the residual where one is given, each
// rounded to T where torch's modules round it.
template <typename T, int V>
__device__ inline float pre_activation(const Coefficients<V>& k, float yv, const T* res, const AlignedVec<T, V>& r,
                                       int v) {
  const float z = k.template normed<T>(yv, v);
  return res == nullptr ? z : rounded<T>(z + static_cast<float>(r.val[v]));
}

template <typename T, int V>
__global__ void normalize(const T* __restrict__ y, const T* __restrict__ res, T* __restrict__ out, int64_t rows, int C,
                          int lanes, int R, const float* __restrict__ stats, Activation act) {
  const int vecs = C / V;
  const Place p = place(lanes, vecs);
  if (!p.active) return;
  const Coefficients<V> k(stats, C, p.vec * V);
  over_rows<4>(
      int64_t{blockIdx.x} * R + p.row_lane, int64_t{gridDim.x} * R, rows,
      [&](int64_t r) { return load_input<T, V>(y, res, r * vecs + p.vec); },
      [&](int64_t r, const InputAndResidual<T, V>& a) {
        AlignedVec<T, V> o;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float z = pre_activation<T, V>(k, static_cast<float>(a.y.val[v]), res, a.res, v);
          o.val[v] = static_cast<T>(apply_activation(z, act));
        }
        store_vec<T, V>(out, r * vecs + p.vec, o);
      });
}

// g times d act(z) / dz at the batch norm's output z, as torch's backward functions define it,
// rounded as torch's activation backward rounds it.
template <typename T>
__device__ inline float through_activation(float g, float z, Activation act) {
  switch (act) {
    case Activation::Relu:
      return z > 0.f ? g : 0.f;
    case Activation::Relu6:
      return (z > 0.f && z < 6.f) ? g : 0.f;
    case Activation::Hardswish:
      return rounded<T>(z < -3.f ? 0.f : (z <= 3.f ? g * (z / 3.f + 0.5f) : g));
    case Activation::Silu: {
      const float s = 1.f / (1.f + expf(-z));
      return rounded<T>(g * s * (1.f + z * (1.f - s)));
    }
    default:
      return g;
  }
}

template <typename T, int V>
struct GradAndInput {
  AlignedVec<T, V> grad, y, res;
};

// res: read only where the activation's derivative needs the pre-activation (else null).
template <typename T, int V>
__device__ inline GradAndInput<T, V> load_grad_and_input(const T* __restrict__ grad, const T* __restrict__ y,
                                                         const T* __restrict__ res, int64_t i) {
  GradAndInput<T, V> a;
  a.grad = load_vec<T, V>(grad, i);
  a.y = load_vec<T, V>(y, i);
  if (res != nullptr) a.res = load_vec<T, V>(res, i);
  return a;
}

template <typename T, int V>
__global__ void grad_partial(const T* __restrict__ grad, const T* __restrict__ y, const T* __restrict__ res,
                             int64_t rows, int C, int lanes, int R, const float* __restrict__ stats, Activation act,
                             float* __restrict__ part) {
  extern __shared__ float sh[];
  const int vecs = C / V;
  const Place p = place(lanes, vecs);
  float acc[2 * V] = {};
  if (p.active) {
    const Coefficients<V> k(stats, C, p.vec * V);
    over_rows<2>(
        int64_t{blockIdx.x} * R + p.row_lane, int64_t{gridDim.x} * R, rows,
        [&](int64_t r) { return load_grad_and_input<T, V>(grad, y, res, r * vecs + p.vec); },
        [&](int64_t, const GradAndInput<T, V>& a) {
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const float yv = static_cast<float>(a.y.val[v]);
            const float z = pre_activation<T, V>(k, yv, res, a.res, v);
            const float g = through_activation<T>(static_cast<float>(a.grad.val[v]), z, act);
            acc[v] += g;
            acc[V + v] += g * (yv - k.mean[v]);
          }
        });
  }
  block_partials<V>(acc, sh, p, C, lanes, R, part);
}

// Per channel: grad weight and bias, and the terms of
// grad y = scale * (g - mean(g) - (y - mean) * invstd^2 * mean(g * (y - mean))).
template <typename W>
__global__ void grad_merge(const float* __restrict__ part, int row_blocks, int C, int64_t rows,
                           const float* __restrict__ stats, W* grad_weight, W* grad_bias, float* __restrict__ terms) {
  float sum_g, sum_gy;
  if (!merge_partials(part, row_blocks, C, sum_g, sum_gy)) return;
  const int c = blockIdx.x * kMergeChannels + threadIdx.x;
  const float invstd = stats[kInvstd * C + c];
  if (grad_weight != nullptr) grad_weight[c] = static_cast<W>(sum_gy * invstd);
  if (grad_bias != nullptr) grad_bias[c] = static_cast<W>(sum_g);
  const float n = static_cast<float>(rows);
  terms[c] = sum_g / n;
  terms[C + c] = invstd * invstd * sum_gy / n;
}

// dy, and the residual's gradient dres (the gradient through the activation) where asked.
template <typename T, int V>
__global__ void grad_input(const T* __restrict__ grad, const T* __restrict__ y, const T* __restrict__ res,
                           T* __restrict__ dy, T* __restrict__ dres, int64_t rows, int C, int lanes, int R,
                           const float* __restrict__ stats, const float* __restrict__ terms, Activation act) {
  const int vecs = C / V;
  const Place p = place(lanes, vecs);
  if (!p.active) return;
  const Coefficients<V> k(stats, C, p.vec * V);
  float mean_g[V], slope[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    mean_g[v] = terms[p.vec * V + v];
    slope[v] = terms[C + p.vec * V + v];
  }
  over_rows<2>(
      int64_t{blockIdx.x} * R + p.row_lane, int64_t{gridDim.x} * R, rows,
      [&](int64_t r) { return load_grad_and_input<T, V>(grad, y, res, r * vecs + p.vec); },
      [&](int64_t r, const GradAndInput<T, V>& a) {
        AlignedVec<T, V> o, gr;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float yv = static_cast<float>(a.y.val[v]);
          const float z = pre_activation<T, V>(k, yv, res, a.res, v);
          const float g = through_activation<T>(static_cast<float>(a.grad.val[v]), z, act);
          o.val[v] = static_cast<T>(k.scale[v] * (g - mean_g[v] - (yv - k.mean[v]) * slope[v]));
          gr.val[v] = static_cast<T>(g);
        }
        if (dy != nullptr) store_vec<T, V>(dy, r * vecs + p.vec, o);
        if (dres != nullptr) store_vec<T, V>(dres, r * vecs + p.vec, gr);
      });
}

// f(T{}, std::integral_constant<int, V>{}) for the tensor's dtype T and the vector width V.
template <typename T, typename F>
void with_width(int V, F& f) {
  if constexpr (sizeof(T) == 2) {
    if (V == 8) return f(T{}, std::integral_constant<int, 8>{});
  }
  if (V == 4) return f(T{}, std::integral_constant<int, 4>{});
  if (V == 2) return f(T{}, std::integral_constant<int, 2>{});
  f(T{}, std::integral_constant<int, 1>{});
}

template <typename F>
void with_type_and_width(at::ScalarType dtype, int V, F&& f) {
  if (dtype == at::kFloat) return with_width<float>(V, f);
  if (dtype == at::kHalf) return with_width<at::Half>(V, f);
  with_width<at::BFloat16>(V, f);
}

// f(W{}) for the BatchNorm parameters' dtype.
template <typename F>
void with_param_type(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) return f(float{});
  if (dtype == at::kHalf) return f(at::Half{});
  f(at::BFloat16{});
}

// The parameters' dtype: the first one given, else float32 (none is read).
at::ScalarType param_type(std::initializer_list<const at::Tensor*> params) {
  for (const at::Tensor* t : params) {
    if (t->defined()) return t->scalar_type();
  }
  return at::kFloat;
}

template <typename W>
W* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? static_cast<W*>(t.data_ptr()) : nullptr;
}

int vector_width(const at::Tensor& y, std::initializer_list<const void*> ptrs) {
  const int C = static_cast<int>(y.size(1));
  switch (y.scalar_type()) {
    case at::kFloat:
      return opforge::cuda::pick_vec<float>(C, ptrs);
    default:
      return opforge::cuda::pick_vec<at::Half>(C, ptrs);
  }
}

dim3 merge_grid(int C) { return dim3(static_cast<unsigned>((C + kMergeChannels - 1) / kMergeChannels)); }
const dim3 kMergeBlock(kMergeChannels, kMergeLanes);

}  // namespace

bool cuda_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& running_mean) {
  if (!y.is_cuda() || at::isTensorSubclassLike(y) || y.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const auto dtype = y.scalar_type();
  if (y.dim() != 4 || !(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) return false;
  if (!y.is_contiguous(at::MemoryFormat::ChannelsLast) || y.numel() == 0) return false;
  if (y.numel() / y.size(1) < 2 || y.size(1) > (int64_t{1} << 30)) return false;
  at::ScalarType params = at::ScalarType::Undefined;
  for (const at::Tensor* t : {&weight, &bias, &running_mean}) {
    if (!t->defined()) continue;
    if (at::isTensorSubclassLike(*t) || t->device() != y.device() || !t->is_contiguous()) return false;
    if (t->scalar_type() != dtype && t->scalar_type() != at::kFloat) return false;
    if (params != at::ScalarType::Undefined && t->scalar_type() != params) return false;
    params = t->scalar_type();
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> cuda_forward(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                                                const at::Tensor& running_mean, const at::Tensor& running_var,
                                                double momentum, double eps, Activation act,
                                                const at::Tensor& residual) {
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int C = static_cast<int>(y.size(1));
  const int64_t rows = y.numel() / C;
  // Same strides as y (what ATen's batch norm gives a channels_last input).
  at::Tensor out = at::empty_like(y);
  const void* res_ptr = residual.defined() ? residual.data_ptr() : nullptr;
  const int V = vector_width(y, {y.data_ptr(), out.data_ptr(), res_ptr});
  const Tiling reduce = make_tiling(rows, C, V, y.element_size(), /*partials=*/true);
  const Tiling pointwise = make_tiling(rows, C, V, y.element_size(), /*partials=*/false);
  const auto f32 = y.options().dtype(at::kFloat);
  at::Tensor part = at::empty({int64_t{reduce.row_blocks} * 2 * C}, f32);
  at::Tensor stats = at::empty({kStats, C}, f32);
  const bool update = running_mean.defined();
  with_type_and_width(y.scalar_type(), V, [&](auto t, auto width) {
    using T = decltype(t);
    constexpr int kV = decltype(width)::value;
    const T* yp = static_cast<const T*>(y.data_ptr());
    const size_t shared = sizeof(float) * 2 * kV * reduce.threads();
    stats_partial<T, kV><<<reduce.grid(), reduce.threads(), shared, stream>>>(yp, rows, C, reduce.lanes, reduce.R,
                                                                              part.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    with_param_type(param_type({&weight, &bias, &running_mean}), [&](auto w) {
      using W = decltype(w);
      stats_merge<T, W><<<merge_grid(C), kMergeBlock, 0, stream>>>(
          part.data_ptr<float>(), reduce.row_blocks, C, rows, yp, static_cast<float>(eps), static_cast<float>(momentum),
          ptr_or_null<const W>(weight), ptr_or_null<const W>(bias), update ? ptr_or_null<W>(running_mean) : nullptr,
          update ? ptr_or_null<W>(running_var) : nullptr, stats.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    normalize<T, kV><<<pointwise.grid(), pointwise.threads(), 0, stream>>>(
        yp, static_cast<const T*>(res_ptr), static_cast<T*>(out.data_ptr()), rows, C, pointwise.lanes, pointwise.R,
        stats.data_ptr<float>(), act);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cuda_backward(
    const at::Tensor& grad_arg, const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& stats, Activation act, std::array<bool, 3> mask, const at::Tensor& residual, bool residual_grad) {
  const c10::cuda::CUDAGuard guard(y.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int C = static_cast<int>(y.size(1));
  const int64_t rows = y.numel() / C;
  // The gradient laid out as y, so that both are walked as (rows, C).
  const at::Tensor grad = grad_arg.strides() == y.strides() ? grad_arg : at::empty_like(y).copy_(grad_arg);
  at::Tensor dy = mask[0] ? at::empty_like(y) : at::Tensor();
  const auto param_dtype = param_type({&weight, &bias});
  const auto param_options = y.options().dtype(param_dtype);
  at::Tensor dw = mask[1] && weight.defined() ? at::empty({C}, param_options) : at::Tensor();
  at::Tensor db = mask[2] && bias.defined() ? at::empty({C}, param_options) : at::Tensor();
  // The pre-activation is recomputed with the residual where the derivative reads it; without an
  // activation the residual's gradient is grad itself, which the caller passes on.
  const bool reads_res = residual.defined() && act != Activation::None;
  const void* res_ptr = reads_res ? residual.data_ptr() : nullptr;
  at::Tensor dres = reads_res && residual_grad ? at::empty_like(y) : at::Tensor();
  const int V = vector_width(y, {y.data_ptr(), grad.data_ptr(), dy.defined() ? dy.data_ptr() : nullptr, res_ptr,
                                 dres.defined() ? dres.data_ptr() : nullptr});
  const Tiling reduce = make_tiling(rows, C, V, y.element_size(), /*partials=*/true);
  const Tiling pointwise = make_tiling(rows, C, V, y.element_size(), /*partials=*/false);
  at::Tensor scratch = at::empty({int64_t{reduce.row_blocks} * 2 * C + 2 * int64_t{C}}, y.options().dtype(at::kFloat));
  float* part = scratch.data_ptr<float>();
  float* terms = part + int64_t{reduce.row_blocks} * 2 * C;
  const float* st = stats.data_ptr<float>();
  with_type_and_width(y.scalar_type(), V, [&](auto t, auto width) {
    using T = decltype(t);
    constexpr int kV = decltype(width)::value;
    const T* gp = static_cast<const T*>(grad.data_ptr());
    const T* yp = static_cast<const T*>(y.data_ptr());
    const size_t shared = sizeof(float) * 2 * kV * reduce.threads();
    const T* rp = static_cast<const T*>(res_ptr);
    grad_partial<T, kV><<<reduce.grid(), reduce.threads(), shared, stream>>>(gp, yp, rp, rows, C, reduce.lanes,
                                                                             reduce.R, st, act, part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    with_param_type(param_dtype, [&](auto w) {
      using W = decltype(w);
      grad_merge<W><<<merge_grid(C), kMergeBlock, 0, stream>>>(part, reduce.row_blocks, C, rows, st, ptr_or_null<W>(dw),
                                                               ptr_or_null<W>(db), terms);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    if (dy.defined() || dres.defined()) {
      grad_input<T, kV><<<pointwise.grid(), pointwise.threads(), 0, stream>>>(
          gp, yp, rp, ptr_or_null<T>(dy), ptr_or_null<T>(dres), rows, C, pointwise.lanes, pointwise.R, st, terms, act);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {dy, dw, db, dres};
}

}  // namespace opforge::batch_norm

// Training-mode batch norm + activation on a channels_last (rows, C) tensor,
// forward and backward, in three launches each and no zero-filled scratch:
//  1. per-block partial statistics: thread (x, y) of a 32x8 block owns
//     channel blockIdx.y * 32 + x and every (8 * gridDim.x)-th row from
//     blockIdx.x * 8 + y; the block's 8 row lanes merge through shared
//     memory and one partial per (row block, channel) is written;
//  2. one thread per channel merges the partials in a fixed order
//     (deterministic: no atomics) and makes the per-channel coefficients;
//  3. the elementwise pass, over the same 32x8 tiling.
// Forward statistics are Welford (mean, M2) merged by Chan's rule, in
// float32; the backward recomputes the pre-activation from y.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>

#include <opforge/cuda_launch.cuh>

#include <algorithm>
#include <cmath>

#include "cuda/batch_norm_act.h"

namespace opforge::batch_norm {
namespace {

constexpr int kLanes = 32;  // channels per block
constexpr int kRows = 8;    // row lanes per block

struct Tiling {
  int64_t rows;
  int C;
  dim3 grid;
};

// Enough blocks to fill the GPU a few times over, no more row blocks than rows.
Tiling tiling(const at::Tensor& y) {
  const int C = static_cast<int>(y.size(1));
  const int64_t rows = y.numel() / C;
  const int channel_blocks = (C + kLanes - 1) / kLanes;
  const int64_t want = std::max<int64_t>(1, 8LL * opforge::cuda::sm_count() / channel_blocks);
  const int64_t row_blocks = std::min<int64_t>({want, (rows + kRows - 1) / kRows, 4096});
  return {rows, C, dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(channel_blocks))};
}

template <typename W>
__device__ inline float param(const W* p, int c, float fallback) {
  return p == nullptr ? fallback : static_cast<float>(p[c]);
}

// Chan's merge of (n, mean, m2) with (nb, mb, m2b) into the first.
__device__ inline void merge(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
  if (nb == 0.f) return;
  const float total = n + nb, delta = mb - mean;
  mean += delta * (nb / total);
  m2 += m2b + delta * delta * (n * nb / total);
  n = total;
}

template <typename T>
__global__ void stats_partial(const T* __restrict__ y, int64_t rows, int C, float* __restrict__ part) {
  const int c = blockIdx.y * kLanes + threadIdx.x;
  float n = 0.f, mean = 0.f, m2 = 0.f;
  if (c < C) {
    for (int64_t r = blockIdx.x * kRows + threadIdx.y; r < rows; r += int64_t{gridDim.x} * kRows) {
      const float v = static_cast<float>(y[r * C + c]);
      n += 1.f;
      const float d = v - mean;
      mean += d / n;
      m2 += d * (v - mean);
    }
  }
  __shared__ float sn[kRows][kLanes], sm[kRows][kLanes], s2[kRows][kLanes];
  sn[threadIdx.y][threadIdx.x] = n;
  sm[threadIdx.y][threadIdx.x] = mean;
  s2[threadIdx.y][threadIdx.x] = m2;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  for (int j = 1; j < kRows; ++j) merge(n, mean, m2, sn[j][threadIdx.x], sm[j][threadIdx.x], s2[j][threadIdx.x]);
  float* p = part + int64_t{blockIdx.x} * 3 * C;
  p[c] = n;
  p[C + c] = mean;
  p[2 * C + c] = m2;
}

// Per channel: the batch statistics, the running statistics' update, and
// scale / shift with bn(y) = y * scale + shift.
template <typename W>
__global__ void stats_final(const float* __restrict__ part, int row_blocks, int C, int64_t rows, float eps,
                            float momentum, const W* weight, const W* bias, W* running_mean, W* running_var,
                            float* save_mean, float* save_invstd, float* scale_shift) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float n = 0.f, mean = 0.f, m2 = 0.f;
  for (int b = 0; b < row_blocks; ++b) {
    const float* p = part + int64_t{b} * 3 * C;
    merge(n, mean, m2, p[c], p[C + c], p[2 * C + c]);
  }
  const float var = m2 / static_cast<float>(rows);
  const float invstd = 1.f / sqrtf(var + eps);
  save_mean[c] = mean;
  save_invstd[c] = invstd;
  if (running_mean != nullptr) {
    const float unbiased = m2 / static_cast<float>(rows - 1);
    running_mean[c] = static_cast<W>(momentum * mean + (1.f - momentum) * static_cast<float>(running_mean[c]));
    running_var[c] = static_cast<W>(momentum * unbiased + (1.f - momentum) * static_cast<float>(running_var[c]));
  }
  const float scale = param(weight, c, 1.f) * invstd;
  scale_shift[c] = scale;
  scale_shift[C + c] = param(bias, c, 0.f) - mean * scale;
}

template <typename T>
__global__ void normalize(const T* __restrict__ y, T* __restrict__ out, int64_t rows, int C,
                          const float* __restrict__ scale_shift, Activation act) {
  const int c = blockIdx.y * kLanes + threadIdx.x;
  if (c >= C) return;
  const float scale = scale_shift[c], shift = scale_shift[C + c];
  for (int64_t r = blockIdx.x * kRows + threadIdx.y; r < rows; r += int64_t{gridDim.x} * kRows) {
    const int64_t i = r * C + c;
    out[i] = static_cast<T>(apply_activation(static_cast<float>(y[i]) * scale + shift, act));
  }
}

// d act(z) / dz times g, as torch's backward functions define it.
__device__ inline float through_activation(float g, float z, Activation act) {
  switch (act) {
    case Activation::Relu:
      return z > 0.f ? g : 0.f;
    case Activation::Relu6:
      return (z > 0.f && z < 6.f) ? g : 0.f;
    case Activation::Hardswish:
      return z < -3.f ? 0.f : (z <= 3.f ? g * (z / 3.f + 0.5f) : g);
    case Activation::Silu: {
      const float s = 1.f / (1.f + expf(-z));
      return g * s * (1.f + z * (1.f - s));
    }
    default:
      return g;
  }
}

// Per-channel coefficients of the backward: [scale, shift, mean, invstd] from the forward.
template <typename W>
__device__ inline void forward_coefficients(int c, const W* weight, const W* bias, const float* save_mean,
                                            const float* save_invstd, float& scale, float& shift, float& mean,
                                            float& invstd) {
  mean = save_mean[c];
  invstd = save_invstd[c];
  scale = param(weight, c, 1.f) * invstd;
  shift = param(bias, c, 0.f) - mean * scale;
}

template <typename T, typename W>
__global__ void grad_partial(const T* __restrict__ grad, const T* __restrict__ y, int64_t rows, int C, const W* weight,
                             const W* bias, const float* save_mean, const float* save_invstd, Activation act,
                             float* __restrict__ part) {
  const int c = blockIdx.y * kLanes + threadIdx.x;
  float sum_g = 0.f, sum_gx = 0.f;
  if (c < C) {
    float scale, shift, mean, invstd;
    forward_coefficients(c, weight, bias, save_mean, save_invstd, scale, shift, mean, invstd);
    for (int64_t r = blockIdx.x * kRows + threadIdx.y; r < rows; r += int64_t{gridDim.x} * kRows) {
      const int64_t i = r * C + c;
      const float v = static_cast<float>(y[i]);
      const float g = through_activation(static_cast<float>(grad[i]), v * scale + shift, act);
      sum_g += g;
      sum_gx += g * (v - mean);
    }
  }
  __shared__ float s1[kRows][kLanes], s2[kRows][kLanes];
  s1[threadIdx.y][threadIdx.x] = sum_g;
  s2[threadIdx.y][threadIdx.x] = sum_gx;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  for (int j = 1; j < kRows; ++j) {
    sum_g += s1[j][threadIdx.x];
    sum_gx += s2[j][threadIdx.x];
  }
  float* p = part + int64_t{blockIdx.x} * 2 * C;
  p[c] = sum_g;
  p[C + c] = sum_gx;
}

// Per channel: grad weight and bias, and the terms of
// grad y = scale * (g - mean(g) - (y - mean) * invstd^2 * mean(g * (y - mean))).
template <typename W>
__global__ void grad_final(const float* __restrict__ part, int row_blocks, int C, int64_t rows,
                           const float* save_invstd, W* grad_weight, W* grad_bias, float* terms) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sum_g = 0.f, sum_gx = 0.f;
  for (int b = 0; b < row_blocks; ++b) {
    sum_g += part[int64_t{b} * 2 * C + c];
    sum_gx += part[int64_t{b} * 2 * C + C + c];
  }
  const float invstd = save_invstd[c];
  if (grad_weight != nullptr) grad_weight[c] = static_cast<W>(sum_gx * invstd);
  if (grad_bias != nullptr) grad_bias[c] = static_cast<W>(sum_g);
  terms[c] = sum_g / static_cast<float>(rows);
  terms[C + c] = invstd * invstd * sum_gx / static_cast<float>(rows);
}

template <typename T, typename W>
__global__ void grad_input(const T* __restrict__ grad, const T* __restrict__ y, T* __restrict__ dy, int64_t rows, int C,
                           const W* weight, const W* bias, const float* save_mean, const float* save_invstd,
                           const float* __restrict__ terms, Activation act) {
  const int c = blockIdx.y * kLanes + threadIdx.x;
  if (c >= C) return;
  float scale, shift, mean, invstd;
  forward_coefficients(c, weight, bias, save_mean, save_invstd, scale, shift, mean, invstd);
  const float mean_g = terms[c], k = terms[C + c];
  for (int64_t r = blockIdx.x * kRows + threadIdx.y; r < rows; r += int64_t{gridDim.x} * kRows) {
    const int64_t i = r * C + c;
    const float v = static_cast<float>(y[i]);
    const float g = through_activation(static_cast<float>(grad[i]), v * scale + shift, act);
    dy[i] = static_cast<T>(scale * (g - mean_g - (v - mean) * k));
  }
}

template <typename W>
const W* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<W>() : nullptr;
}
template <typename W>
W* mutable_ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<W>() : nullptr;
}

bool params_float(const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& running_mean) {
  for (const at::Tensor* t : {&weight, &bias, &running_mean}) {
    if (t->defined()) return t->scalar_type() == at::kFloat;
  }
  return true;
}

// Calls F::template run<T, W>(args...) with T the tensor dtype and W the parameters' (T or float).
template <typename F, typename... Args>
void dispatch(const at::Tensor& y, bool float_params, Args&&... args) {
  switch (y.scalar_type()) {
    case at::kFloat:
      F::template run<float, float>(args...);
      break;
    case at::kHalf:
      float_params ? F::template run<at::Half, float>(args...) : F::template run<at::Half, at::Half>(args...);
      break;
    default:
      float_params ? F::template run<at::BFloat16, float>(args...)
                   : F::template run<at::BFloat16, at::BFloat16>(args...);
      break;
  }
}

constexpr int kFinalThreads = 128;

struct ForwardLaunch {
  template <typename T, typename W>
  static void run(const Tiling& t, const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& running_mean, const at::Tensor& running_var, at::Tensor& out, float* part,
                  float* stats, float momentum, float eps, Activation act) {
    const dim3 block(kLanes, kRows);
    const auto stream = at::cuda::getCurrentCUDAStream();
    stats_partial<T><<<t.grid, block, 0, stream>>>(y.data_ptr<T>(), t.rows, t.C, part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    stats_final<W><<<(t.C + kFinalThreads - 1) / kFinalThreads, kFinalThreads, 0, stream>>>(
        part, static_cast<int>(t.grid.x), t.C, t.rows, eps, momentum, ptr<W>(weight), ptr<W>(bias),
        mutable_ptr<W>(running_mean), mutable_ptr<W>(running_var), stats, stats + t.C, stats + 2 * t.C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    normalize<T><<<t.grid, block, 0, stream>>>(y.data_ptr<T>(), out.data_ptr<T>(), t.rows, t.C, stats + 2 * t.C, act);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

struct BackwardLaunch {
  template <typename T, typename W>
  static void run(const Tiling& t, const at::Tensor& grad, const at::Tensor& y, const at::Tensor& weight,
                  const at::Tensor& bias, const float* mean, const float* invstd, at::Tensor& dy, at::Tensor& dw,
                  at::Tensor& db, float* part, float* terms, Activation act) {
    const dim3 block(kLanes, kRows);
    const auto stream = at::cuda::getCurrentCUDAStream();
    grad_partial<T, W><<<t.grid, block, 0, stream>>>(grad.data_ptr<T>(), y.data_ptr<T>(), t.rows, t.C, ptr<W>(weight),
                                                     ptr<W>(bias), mean, invstd, act, part);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_final<W><<<(t.C + kFinalThreads - 1) / kFinalThreads, kFinalThreads, 0, stream>>>(
        part, static_cast<int>(t.grid.x), t.C, t.rows, invstd, mutable_ptr<W>(dw), mutable_ptr<W>(db), terms);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (dy.defined()) {
      grad_input<T, W><<<t.grid, block, 0, stream>>>(grad.data_ptr<T>(), y.data_ptr<T>(), dy.data_ptr<T>(), t.rows, t.C,
                                                     ptr<W>(weight), ptr<W>(bias), mean, invstd, terms, act);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

}  // namespace

bool cuda_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                       const at::Tensor& running_mean) {
  const auto dtype = y.scalar_type();
  if (!y.is_cuda() || y.dim() != 4 || !(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    return false;
  }
  if (!y.is_contiguous(at::MemoryFormat::ChannelsLast) || y.numel() == 0 || y.size(1) == 0) return false;
  if (y.numel() / y.size(1) < 2 || y.size(1) > (int64_t{1} << 30)) return false;
  at::ScalarType params = at::ScalarType::Undefined;
  for (const at::Tensor* t : {&weight, &bias, &running_mean}) {
    if (!t->defined()) continue;
    if (t->device() != y.device() || !t->is_contiguous()) return false;
    if (t->scalar_type() != dtype && t->scalar_type() != at::kFloat) return false;
    if (params != at::ScalarType::Undefined && t->scalar_type() != params) return false;
    params = t->scalar_type();
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_forward(const at::Tensor& y, const at::Tensor& weight,
                                                            const at::Tensor& bias, const at::Tensor& running_mean,
                                                            const at::Tensor& running_var, double momentum, double eps,
                                                            Activation act) {
  const Tiling t = tiling(y);
  const auto f32 = y.options().dtype(at::kFloat);
  at::Tensor out = at::empty_like(y, at::MemoryFormat::ChannelsLast);
  // One allocation for every float32 scratch: partials, mean, invstd, scale and shift.
  at::Tensor scratch = at::empty({int64_t{t.grid.x} * 3 * t.C + 4 * int64_t{t.C}}, f32);
  float* part = scratch.data_ptr<float>();
  float* stats = part + int64_t{t.grid.x} * 3 * t.C;
  at::Tensor save_mean = scratch.narrow(0, int64_t{t.grid.x} * 3 * t.C, t.C);
  at::Tensor save_invstd = scratch.narrow(0, int64_t{t.grid.x} * 3 * t.C + t.C, t.C);
  const at::Tensor rv = running_mean.defined() ? running_var : at::Tensor();
  dispatch<ForwardLaunch>(y, params_float(weight, bias, running_mean), t, y, weight, bias, running_mean, rv, out, part,
                          stats, static_cast<float>(momentum), static_cast<float>(eps), act);
  return {out, save_mean, save_invstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(const at::Tensor& grad_arg, const at::Tensor& y,
                                                             const at::Tensor& weight, const at::Tensor& bias,
                                                             const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                                             Activation act, std::array<bool, 3> mask) {
  const Tiling t = tiling(y);
  const at::Tensor grad = grad_arg.contiguous(at::MemoryFormat::ChannelsLast);
  const bool float_params = params_float(weight, bias, at::Tensor());
  const auto param_options = y.options().dtype(float_params ? at::kFloat : y.scalar_type());
  at::Tensor dy = mask[0] ? at::empty_like(y, at::MemoryFormat::ChannelsLast) : at::Tensor();
  at::Tensor dw = mask[1] && weight.defined() ? at::empty({t.C}, param_options) : at::Tensor();
  at::Tensor db = mask[2] && bias.defined() ? at::empty({t.C}, param_options) : at::Tensor();
  at::Tensor scratch = at::empty({int64_t{t.grid.x} * 2 * t.C + 2 * int64_t{t.C}}, y.options().dtype(at::kFloat));
  float* part = scratch.data_ptr<float>();
  float* terms = part + int64_t{t.grid.x} * 2 * t.C;
  const float* mean = save_mean.data_ptr<float>();
  const float* invstd = save_invstd.data_ptr<float>();
  dispatch<BackwardLaunch>(y, float_params, t, grad, y, weight, bias, mean, invstd, dy, dw, db, part, terms, act);
  return {dy, dw, db};
}

}  // namespace opforge::batch_norm

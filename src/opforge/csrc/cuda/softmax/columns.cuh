// Softmax kernels over an outer dim (inner > 1): a thread per (outer,
// inner) column; consecutive threads read consecutive inner elements, so
// every pass over K is coalesced and no transpose copy is made.
#pragma once

#include "device_math.cuh"

namespace opforge::softmax::gpu {
namespace {

namespace sm = opforge::softmax;

template <typename T, sm::Mode MODE>
__global__ void fwd_cols_kernel(sm::FwdArgs a) {
  using A = Acc<T>;
  const int64_t K = a.K, inner = a.inner, cols = a.outer * a.inner;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * K * inner + col % inner;
    A m = neg_inf<A>();
    for (int64_t k = 0; k < K; ++k) m = max_nan(m, static_cast<A>(in[base + k * inner]));
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += elem_exp(static_cast<A>(in[base + k * inner]) - m);
    if constexpr (MODE == sm::Mode::LogSoftmax) {
      const A l = dev_log(sum);  // (x - m) - log(sum), as normalize
      for (int64_t k = 0; k < K; ++k)
        out[base + k * inner] = static_cast<T>((static_cast<A>(in[base + k * inner]) - m) - l);
    } else {
      const A inv = A(1) / sum;
      for (int64_t k = 0; k < K; ++k)
        out[base + k * inner] = static_cast<T>(elem_exp(static_cast<A>(in[base + k * inner]) - m) * inv);
    }
  }
}

template <typename T, sm::Mode MODE>
__global__ void bwd_cols_kernel(sm::BwdArgs a) {
  using A = Acc<T>;
  const int64_t K = a.K, inner = a.inner, cols = a.outer * a.inner;
  const T* gy = static_cast<const T*>(a.grad);
  const T* yy = static_cast<const T*>(a.out);
  T* gx = static_cast<T*>(a.grad_in);
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
       col += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t base = (col / inner) * K * inner + col % inner;
    A sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = base + k * inner;
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        sum += static_cast<A>(gy[i]);
      } else {
        sum += static_cast<A>(gy[i]) * static_cast<A>(yy[i]);
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = base + k * inner;
      const A g = static_cast<A>(gy[i]), o = static_cast<A>(yy[i]);
      if constexpr (MODE == sm::Mode::LogSoftmax) {
        gx[i] = static_cast<T>(g - elem_exp(o) * sum);
      } else {
        gx[i] = static_cast<T>(o * (g - sum));
      }
    }
  }
}

}  // namespace
}  // namespace opforge::softmax::gpu

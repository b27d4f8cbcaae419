// Asynchronous global -> shared memory copies (cp.async, sm_80 and later):
// a thread queues 16-byte copies, groups them with cp_async_commit(), and
// cp_async_wait<N>() blocks until at most N of its groups are still in
// flight. A thread's own copies are visible to it after the wait; other
// threads' copies need a __syncthreads() as well. Kernels compiled for
// older GPUs must not call cp_async_commit / cp_async_wait (guard with
// __CUDA_ARCH__ >= 800); copy_async, copy_async_zfill and cp_async16 fall
// back to plain copies there.
#pragma once

#include <cstdint>

namespace opforge::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An asynchronous copy of B = 4, 8 or 16 bytes (16 bypass L1) to a
// shared-memory address (smem_u32) that writes B zero bytes instead,
// reading nothing, where `pred` is false: one instruction either way, no
// branch (halos and padding).
template <int B>
__device__ __forceinline__ void copy_async_zfill(uint32_t smem, const void* gmem, bool pred) {
  static_assert(B == 4 || B == 8 || B == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int n = pred ? B : 0;
  if constexpr (B == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem), "l"(gmem), "n"(B), "r"(n));
  }
#elif defined(__CUDA_ARCH__)
  // Older GPUs: a plain copy (a shared address from smem_u32 is an offset in
  // the shared window).
  uint32_t v[B / 4] = {};
  if (pred) {
#pragma unroll
    for (int i = 0; i < B / 4; ++i) v[i] = static_cast<const uint32_t*>(gmem)[i];
  }
#pragma unroll
  for (int i = 0; i < B / 4; ++i) asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(smem + 4 * i), "r"(v[i]));
#endif
}

// 16-byte async copy, bypassing L1; with pred false nothing is read and 16
// zero bytes are written.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred = true) {
  copy_async_zfill<16>(dst, src, pred);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copies B = 4, 8 or 16 bytes (both addresses aligned to B) from global to
// shared memory asynchronously on sm_80 and later (16 bytes bypass L1);
// compiled for older GPUs it is a plain copy. Pair with copy_async_wait_all().
template <int B>
__device__ __forceinline__ void copy_async(void* smem, const void* gmem) {
  static_assert(B == 4 || B == 8 || B == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t s = smem_u32(smem);
  if constexpr (B == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(B));
  }
#else
  if constexpr (B == 16) {
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(smem) = *reinterpret_cast<const uint2*>(gmem);
  } else {
    *reinterpret_cast<unsigned*>(smem) = *reinterpret_cast<const unsigned*>(gmem);
  }
#endif
}

// Waits for all of this thread's copy_async copies (no-op below sm_80).
__device__ __forceinline__ void copy_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace opforge::cuda

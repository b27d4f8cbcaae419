// Asynchronous global -> shared memory copies (cp.async, sm_80 and later):
// a thread queues 16-byte copies, groups them with cp_async_commit(), and
// cp_async_wait<N>() blocks until at most N of its groups are still in
// flight. A thread's own copies are visible to it after the wait; other
// threads' copies need a __syncthreads() as well. Kernels compiled for
// older GPUs must not call these (guard with __CUDA_ARCH__ >= 800).
#pragma once

#include <cstdint>

namespace opforge::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy, bypassing L1; with pred false nothing is read and 16
// zero bytes are written.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred = true) {
  const int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_size));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace opforge::cuda

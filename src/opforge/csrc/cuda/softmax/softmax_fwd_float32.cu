// The softmax forward row kernels for float32, all three modes (one dtype
// per file: nvcc builds the files in parallel), and clusters_available,
// which asks about one of them.
#include "launch_forward.cuh"

#include <array>
#include <atomic>

namespace opforge::softmax::gpu {

template <>
void forward_rows<float>(Mode mode, const FwdArgs& a, const at::Tensor& x, const PlanRequest* req) {
  with_mode(mode, [&](auto m) { forward_rows_impl<float, decltype(m)::value>(a, x, req); });
}

// Whether this build's kernels can use clusters at all on the current GPU.
// Asked by every launch: answered once per device, then read without the
// occupancy cache's lock.
bool clusters_available() {
  static std::array<std::atomic<int8_t>, 64> known{};  // 0 not asked yet, 1 no, 2 yes
  auto ask = [] { return cluster_launchable(fwd_rows_kernel<float, 4, 1, sm::Mode::Softmax>, 2, kMaxGroup); };
  const int dev = c10::cuda::current_device();
  if (dev < 0 || dev >= static_cast<int>(known.size())) return ask();
  int8_t v = known[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    v = ask() ? 2 : 1;
    known[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace opforge::softmax::gpu

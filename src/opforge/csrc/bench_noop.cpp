// opforge_bench::noop, the floor of `opforge bench overhead`: a registered op
// that does no work, so its per-call time is the dispatcher's and the Python
// binding's alone. One device-neutral kernel; no autograd kernel, so an input
// that requires grad goes through torch's autograd fallback.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace {

// Returns an empty tensor of x's dtype and device: allocating zero bytes
// launches nothing on any device.
at::Tensor noop(const at::Tensor& x) { return at::empty({0}, x.options()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(opforge_bench, m) { m.def("noop(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(opforge_bench, CompositeExplicitAutograd, m) { m.impl("noop", &noop); }

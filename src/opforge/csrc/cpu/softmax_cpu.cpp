// CPU entry points of the softmax family: the argument checks and the
// kernel arguments (softmax_host.h), then the loops compiled for this CPU's best ISA
// (cpu/softmax_kernels.h).
#include <torch/library.h>

#include <opforge/cpu_isa.h>

#include "softmax_host.h"

OPFORGE_CPU_DECLARE(void, softmax_forward, const opforge::softmax::FwdArgs&)
OPFORGE_CPU_DECLARE(void, softmax_backward, const opforge::softmax::BwdArgs&)

namespace {

namespace sm = opforge::softmax;

at::Tensor run_forward(sm::Prepared p) {
  if (p.out.numel() > 0) OPFORGE_CPU_SELECT(softmax_forward)(p.args);
  return p.out;
}

at::Tensor run_backward(sm::PreparedBwd p) {
  if (p.grad_in.numel() > 0) OPFORGE_CPU_SELECT(softmax_backward)(p.args);
  return p.grad_in;
}

at::Tensor softmax_cpu(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  const int64_t d = sm::check_softmax_args("opforge.softmax", x, dim, dtype);
  return run_forward(sm::prepare_softmax(sm::Mode::Softmax, x, d, dtype));
}

at::Tensor log_softmax_cpu(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  const int64_t d = sm::check_softmax_args("opforge.log_softmax", x, dim, dtype);
  return run_forward(sm::prepare_softmax(sm::Mode::LogSoftmax, x, d, dtype));
}

at::Tensor scaled_masked_softmax_cpu(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                     bool causal) {
  sm::check_scaled_masked_args("opforge.scaled_masked_softmax", x, mask);
  return run_forward(sm::prepare_scaled_masked(x, mask, scale, causal));
}

at::Tensor softmax_backward_cpu(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  const int64_t d = sm::check_backward_args("opforge._softmax_backward", grad, output, dim);
  return run_backward(sm::prepare_backward(sm::Mode::Softmax, grad, output, d, 1.0));
}

at::Tensor log_softmax_backward_cpu(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  const int64_t d = sm::check_backward_args("opforge._log_softmax_backward", grad, output, dim);
  return run_backward(sm::prepare_backward(sm::Mode::LogSoftmax, grad, output, d, 1.0));
}

at::Tensor scaled_masked_softmax_backward_cpu(const at::Tensor& grad, const at::Tensor& output, double scale) {
  const int64_t d = sm::check_backward_args("opforge._scaled_masked_softmax_backward", grad, output, -1);
  return run_backward(sm::prepare_backward(sm::Mode::ScaledMasked, grad, output, d, scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("softmax", &softmax_cpu);
  m.impl("log_softmax", &log_softmax_cpu);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_cpu);
  m.impl("_softmax_backward", &softmax_backward_cpu);
  m.impl("_log_softmax_backward", &log_softmax_backward_cpu);
  m.impl("_scaled_masked_softmax_backward", &scaled_masked_softmax_backward_cpu);
}

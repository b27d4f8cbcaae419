// Host side of conv2d_batch_norm's own CPU engine: which tensors it takes,
// the outputs and their layout, then the loops compiled for this CPU's best
// ISA (cpu/batch_norm_act_kernels.h).
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <opforge/cpu_isa.h>

#include "cpu/batch_norm_act_cpu.h"
#include "cpu/batch_norm_act_params.h"

OPFORGE_CPU_DECLARE(void, batch_norm_act_forward, const opforge::batch_norm::CpuForwardArgs&)
OPFORGE_CPU_DECLARE(void, batch_norm_act_backward, const opforge::batch_norm::CpuBackwardArgs&)

namespace opforge::batch_norm {
namespace {

CpuLayout layout_of(const at::Tensor& y) {
  return {y.size(0), y.size(1), y.size(2) * y.size(3),
          !y.is_contiguous() && y.is_contiguous(at::MemoryFormat::ChannelsLast)};
}

// The parameters' dtype: the first one given, else y's (none is read).
at::ScalarType param_type(const at::Tensor& y, std::initializer_list<const at::Tensor*> params) {
  for (const at::Tensor* t : params) {
    if (t->defined()) return t->scalar_type();
  }
  return y.scalar_type();
}

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }
void* mutable_ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

}  // namespace

bool cpu_engine_takes(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& running_mean) {
  if (!y.defined() || !y.device().is_cpu() || at::isTensorSubclassLike(y) ||
      y.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const auto dtype = y.scalar_type();
  if (y.dim() != 4 || !(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) return false;
  if (!y.is_contiguous() && !y.is_contiguous(at::MemoryFormat::ChannelsLast)) return false;
  if (y.numel() == 0 || y.numel() / y.size(1) < 2) return false;
  at::ScalarType params = at::ScalarType::Undefined;
  for (const at::Tensor* t : {&weight, &bias, &running_mean}) {
    if (!t->defined()) continue;
    if (at::isTensorSubclassLike(*t) || !t->device().is_cpu() || t->dim() != 1 || !t->is_contiguous()) return false;
    if (t->scalar_type() != dtype && t->scalar_type() != at::kFloat) return false;
    if (params != at::ScalarType::Undefined && t->scalar_type() != params) return false;
    params = t->scalar_type();
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> cpu_forward(const at::Tensor& y, const at::Tensor& weight, const at::Tensor& bias,
                                               const at::Tensor& running_mean, const at::Tensor& running_var,
                                               double momentum, double eps, Activation act) {
  // Same strides as y (what ATen's batch norm gives either layout).
  at::Tensor out = at::empty_like(y);
  at::Tensor stats = at::empty({kCpuStats, y.size(1)}, y.options().dtype(at::kFloat));
  // running_var is checked as running_mean is (the op's checks: same shape, given together).
  TORCH_CHECK(!running_var.defined() ||
                  (running_var.is_contiguous() && running_var.scalar_type() == running_mean.scalar_type()),
              "opforge.conv2d_batch_norm: running_var must be contiguous with running_mean's dtype");
  CpuForwardArgs a{};
  a.layout = layout_of(y);
  a.dtype = y.scalar_type();
  a.param_dtype = param_type(y, {&weight, &bias, &running_mean});
  a.y = y.const_data_ptr();
  a.out = out.data_ptr();
  a.weight = ptr_or_null(weight);
  a.bias = ptr_or_null(bias);
  a.running_mean = mutable_ptr_or_null(running_mean);
  a.running_var = running_mean.defined() ? mutable_ptr_or_null(running_var) : nullptr;
  a.momentum = momentum;
  a.eps = eps;
  a.act = act;
  a.stats = stats.data_ptr<float>();
  OPFORGE_CPU_SELECT(batch_norm_act_forward)(a);
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_backward(const at::Tensor& grad_arg, const at::Tensor& y,
                                                            const at::Tensor& weight, const at::Tensor& bias,
                                                            const at::Tensor& stats, Activation act,
                                                            std::array<bool, 3> mask) {
  // The gradient laid out as y, so that both are walked alike.
  const at::Tensor grad = grad_arg.strides() == y.strides() ? grad_arg : at::empty_like(y).copy_(grad_arg);
  at::Tensor dy = mask[0] ? at::empty_like(y) : at::Tensor();
  // As ATen's native_batch_norm_backward: the parameters' dtype (y's without them).
  const auto param_options = y.options().dtype(param_type(y, {&weight, &bias}));
  at::Tensor dw = mask[1] ? at::empty({y.size(1)}, param_options) : at::Tensor();
  at::Tensor db = mask[2] ? at::empty({y.size(1)}, param_options) : at::Tensor();
  CpuBackwardArgs a{};
  a.layout = layout_of(y);
  a.dtype = y.scalar_type();
  a.param_dtype = param_options.dtype().toScalarType();
  a.grad = grad.const_data_ptr();
  a.y = y.const_data_ptr();
  a.dy = mutable_ptr_or_null(dy);
  a.grad_weight = mutable_ptr_or_null(dw);
  a.grad_bias = mutable_ptr_or_null(db);
  a.stats = stats.const_data_ptr<float>();
  a.act = act;
  OPFORGE_CPU_SELECT(batch_norm_act_backward)(a);
  return {dy, dw, db};
}

}  // namespace opforge::batch_norm

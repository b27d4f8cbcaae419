// The engine choice of batch_norm_train.h: opforge's own engines where they
// take y, else ATen's batch norm and the activation (the kernels torch's
// modules run, so values, gradients and running statistics equal theirs).
#include "batch_norm_train.h"

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/TensorSubclassLikeUtils.h>

#include <algorithm>

#include <opforge/checks.h>

#include "activation_aten.h"
#include "cpu/batch_norm_act_cpu.h"
#ifdef OPFORGE_WITH_CUDA
#include "cuda/batch_norm_act.h"
#endif

namespace opforge::batch_norm {

void check_channel_tensor(const char* op, const at::Tensor& x, const char* x_name, const at::Tensor& t,
                          const char* name, const c10::SymInt& K, const char* channels) {
  if (!t.defined()) return;
  opforge::check_float_tensor(t, op, name);
  opforge::check_same_device(x, x_name, t, name, op);
  TORCH_CHECK(t.dim() == 1 && t.sym_size(0) == K, op, ": ", name, " must have shape [", opforge::num(K), "] (",
              channels, "), got ", opforge::shape(t.sym_sizes()));
}

void check_running_stats(const char* op, const at::Tensor& x, const at::Tensor& running_mean,
                         const at::Tensor& running_var, const at::Tensor& num_batches_tracked) {
  TORCH_CHECK_VALUE(running_mean.defined() == running_var.defined(), op,
                    ": running_mean and running_var must be given together (or both None)");
  if (num_batches_tracked.defined()) {
    opforge::check_same_device(x, "x", num_batches_tracked, "num_batches_tracked", op);
    TORCH_CHECK(num_batches_tracked.numel() == 1, op, ": num_batches_tracked must have one element, got shape ",
                opforge::shape(num_batches_tracked.sym_sizes()));
  }
}

void check_residual(const char* op, const char* what, const at::Tensor& y, const at::Tensor& residual) {
  if (!residual.defined()) return;
  opforge::check_same_device(y, what, residual, "residual", op);
  TORCH_CHECK_TYPE(residual.scalar_type() == y.scalar_type(), op, ": residual must have ", what, "'s dtype ",
                   opforge::dtype_name(y.scalar_type()), ", got ", opforge::dtype_name(residual.scalar_type()));
  TORCH_CHECK_VALUE(residual.sym_sizes().equals(y.sym_sizes()), op, ": residual must have ", what, "'s shape ",
                    opforge::shape(y.sym_sizes()), ", got ", opforge::shape(residual.sym_sizes()));
}

#ifdef OPFORGE_WITH_CUDA
namespace {

// The own engine reads the residual as it reads y: the same strides (both walked as one array).
bool laid_out_as(const at::Tensor& residual, const at::Tensor& y) {
  return !residual.defined() || (residual.strides() == y.strides() && !at::isTensorSubclassLike(residual));
}

}  // namespace
#endif

Normalized normalize(const char* op, const char* what, const at::Tensor& y, const at::Tensor& weight,
                     const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                     const at::Tensor& num_batches_tracked, double momentum, double eps, Activation act,
                     bool keep_pre_act, const at::Tensor& residual) {
  // Checked where sizes are concrete (a symbolic trace checks when it runs).
  if (!y.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    const int64_t per_channel = y.numel() / std::max<int64_t>(y.size(1), 1);
    TORCH_CHECK_VALUE(per_channel > 1 || y.numel() == 0, op,
                      ": expected more than 1 value per channel when training (as nn.BatchNorm2d), got ", what,
                      " of shape ", opforge::shape(y.sym_sizes()));
  }
  if (num_batches_tracked.defined() && running_mean.defined()) num_batches_tracked.add_(1);
  Normalized r;
#ifdef OPFORGE_WITH_CUDA
  if (cuda_engine_takes(y, weight, bias, running_mean) && laid_out_as(residual, y)) {
    std::tie(r.out, r.reserve) = cuda_forward(y, weight, bias, running_mean, running_var, momentum, eps, act, residual);
    r.impl_index = kOwnEngine;
    return r;
  }
#endif
  if (!residual.defined() && cpu_engine_takes(y, weight, bias, running_mean)) {
    std::tie(r.out, r.reserve) = cpu_forward(y, weight, bias, running_mean, running_var, momentum, eps, act);
    r.impl_index = kOwnEngine;
    return r;
  }
  at::Tensor normed;
  std::tie(normed, r.save_mean, r.save_invstd, r.reserve, r.impl_index) =
      at::_batch_norm_impl_index(y, weight, bias, running_mean, running_var, /*training=*/true, momentum, eps,
                                 at::globalContext().userEnabledCuDNN());
  if (residual.defined()) normed.add_(residual);
  if (keep_pre_act && !opforge::derivative_from_output(act) && act != Activation::None) {
    // The derivative reads the pre-activation: the activation writes a tensor of its own.
    r.pre_act = normed;
    r.out = opforge::activation_aten(normed, act);
  } else {
    opforge::activation_inplace_aten(normed, act);
    r.out = normed;
  }
  return r;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> normalize_backward(
    const at::Tensor& grad_out, Activation act, const at::Tensor& kept, const at::Tensor& y, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& save_mean,
    const at::Tensor& save_invstd, const at::Tensor& reserve, int64_t engine, double eps, std::array<bool, 3> mask,
    const at::Tensor& residual, at::Tensor* grad_residual) {
  // Without an activation the residual's gradient is the output's.
  if (grad_residual != nullptr && act == Activation::None) *grad_residual = grad_out;
  if (engine == kOwnEngine) {
#ifdef OPFORGE_WITH_CUDA
    if (y.is_cuda()) {
      auto [dy, dw, db, dres] =
          cuda_backward(grad_out, y, weight, bias, reserve, act, mask, residual, grad_residual != nullptr);
      if (grad_residual != nullptr && act != Activation::None) *grad_residual = std::move(dres);
      return {dy, dw, db};
    }
#endif
    return cpu_backward(grad_out, y, weight, bias, reserve, act, mask);
  }
  const at::Tensor grad = opforge::activation_backward(grad_out, act, kept);
  if (grad_residual != nullptr && act != Activation::None) *grad_residual = grad;
  // ATen's engines called by name where they can be: their shape functions trace with symbolic
  // sizes, which the by-index dispatcher's empty-batch test does not.
  if (y.sym_numel() != 0 && engine == 0) {
    return at::native_batch_norm_backward(grad, y, weight, running_mean, running_var, save_mean, save_invstd,
                                          /*train=*/true, eps, mask);
  }
  if (y.sym_numel() != 0 && engine == 1) {
    return at::cudnn_batch_norm_backward(y, grad, weight, running_mean, running_var, save_mean, save_invstd, eps,
                                         reserve);
  }
  return at::_batch_norm_impl_index_backward(engine, y, grad, weight, running_mean, running_var, save_mean, save_invstd,
                                             /*train=*/true, eps, mask, reserve);
}

}  // namespace opforge::batch_norm

// The squeeze-and-excitation family's home: its schema, checks and kernel.
//
//   y = x * scale_activation(fc2(activation(fc1(mean over H, W of x))))
//
// with fc1, fc2 the 1x1 convolutions (or linear layers) of a squeeze block
// such as torchvision's SqueezeExcitation. In a model these are six or seven
// module calls, each a Python call and one or two kernel launches on tensors
// of a few hundred numbers; at small batches their host time is the block's
// cost. This op runs the block as one call: the pooling, the two matrix
// products (the first with its ReLU in cuBLAS's epilogue where it has one)
// and the scaling, as ATen kernels called from C++. It is registered
// CompositeImplicitAutograd: autograd differentiates those ATen ops and
// torch.compile traces them, so its gradients and compiled graphs are
// torch's own; torch.export keeps it as one node until run_decompositions().
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

#include <opforge/checks.h>

#include <string>

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def(
      "squeeze_excitation(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, "
      "str activation=\"relu\", str scale_activation=\"sigmoid\") -> Tensor");
}

namespace {

constexpr const char* kOp = "opforge.squeeze_excitation";

// A 1x1 conv's (K, C, 1, 1) weight or a linear layer's (K, C), as (K, C).
at::Tensor as_matrix(const at::Tensor& w, const char* name) {
  opforge::check_float_tensor(w, kOp, name);
  const bool conv = w.dim() == 4 && w.sym_size(2) == 1 && w.sym_size(3) == 1;
  TORCH_CHECK(w.dim() == 2 || conv, kOp, ": ", name, " must be (out, in) or (out, in, 1, 1), got shape ",
              opforge::shape(w.sym_sizes()));
  return conv ? w.flatten(1) : w;
}

void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& w, const char* name, const char* w_name) {
  if (!bias.has_value() || !bias->defined()) return;
  opforge::check_float_tensor(*bias, kOp, name);
  opforge::check_same_dtype(w, w_name, *bias, name, kOp);
  opforge::check_same_device(w, w_name, *bias, name, kOp);
  TORCH_CHECK(bias->dim() == 1 && bias->sym_size(0) == w.sym_size(0), kOp, ": ", name, " must be (",
              opforge::num(w.sym_size(0)), ",), got shape ", opforge::shape(bias->sym_sizes()));
}

bool is_activation(const std::string& a) { return a == "relu" || a == "relu6" || a == "silu" || a == "hardswish"; }

// bias + a @ w.T, then the activation: in place and, for ReLU, in cuBLASLt's
// epilogue where nothing is recorded for autograd (_addmm_activation has no
// derivative, and an in-place activation may overwrite what its backward reads).
at::Tensor linear_act(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const std::string& act, bool records) {
  const bool has_bias = bias.has_value() && bias->defined();
  if (act == "relu" && has_bias && !records) return at::_addmm_activation(*bias, a, w.t());
  at::Tensor z = has_bias ? at::addmm(*bias, a, w.t()) : at::mm(a, w.t());
  if (act == "relu") return records ? at::relu(z) : at::relu_(z);
  if (act == "relu6") return records ? at::hardtanh(z, 0.0, 6.0) : at::hardtanh_(z, 0.0, 6.0);
  if (act == "silu") return records ? at::silu(z) : at::silu_(z);
  if (act == "hardswish") return records ? at::hardswish(z) : at::hardswish_(z);
  if (act == "sigmoid") return records ? at::sigmoid(z) : at::sigmoid_(z);
  return records ? at::hardsigmoid(z) : at::hardsigmoid_(z);
}

bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() && t->requires_grad(); }

at::Tensor squeeze_excitation(const at::Tensor& x, const at::Tensor& fc1_weight,
                              const std::optional<at::Tensor>& fc1_bias, const at::Tensor& fc2_weight,
                              const std::optional<at::Tensor>& fc2_bias, c10::string_view activation,
                              c10::string_view scale_activation) {
  opforge::check_float_tensor(x, kOp, "x");
  TORCH_CHECK(x.dim() == 4 || x.dim() == 3, kOp, ": x must be (N, C, H, W) or unbatched (C, H, W), got shape ",
              opforge::shape(x.sym_sizes()));
  const std::string act(activation), scale_act(scale_activation);
  TORCH_CHECK_VALUE(is_activation(act), kOp, ": activation must be 'relu', 'relu6', 'silu' or 'hardswish', got '", act,
                    "'");
  TORCH_CHECK_VALUE(scale_act == "sigmoid" || scale_act == "hardsigmoid", kOp,
                    ": scale_activation must be 'sigmoid' or 'hardsigmoid', got '", scale_act, "'");
  const at::Tensor w1 = as_matrix(fc1_weight, "fc1_weight");
  const at::Tensor w2 = as_matrix(fc2_weight, "fc2_weight");
  for (const auto& [w, name] : {std::pair{&fc1_weight, "fc1_weight"}, std::pair{&fc2_weight, "fc2_weight"}}) {
    opforge::check_same_dtype(x, "x", *w, name, kOp);
    opforge::check_same_device(x, "x", *w, name, kOp);
  }
  const bool unbatched = x.dim() == 3;
  const at::Tensor xb = unbatched ? x.unsqueeze(0) : x;
  const c10::SymInt channels = xb.sym_size(1);
  TORCH_CHECK(w1.sym_size(1) == channels, kOp, ": fc1_weight must take x's ", opforge::num(channels),
              " channels, got shape ", opforge::shape(fc1_weight.sym_sizes()));
  TORCH_CHECK(w2.sym_size(1) == w1.sym_size(0) && w2.sym_size(0) == channels, kOp, ": fc2_weight must be (",
              opforge::num(channels), ", ", opforge::num(w1.sym_size(0)),
              ") to map fc1's outputs back to x's channels, ", "got shape ", opforge::shape(fc2_weight.sym_sizes()));
  check_bias(fc1_bias, w1, "fc1_bias", "fc1_weight");
  check_bias(fc2_bias, w2, "fc2_bias", "fc2_weight");
  // (N, C): the mean over each plane; an empty plane gives NaN, as adaptive_avg_pool2d's does.
  const bool records =
      at::GradMode::is_enabled() && (x.requires_grad() || fc1_weight.requires_grad() || fc2_weight.requires_grad() ||
                                     requires_grad(fc1_bias) || requires_grad(fc2_bias));
  const at::Tensor pooled = xb.mean({-2, -1});
  const at::Tensor hidden = linear_act(pooled, w1, fc1_bias, act, records);
  const at::Tensor gate = linear_act(hidden, w2, fc2_bias, scale_act, records);
  // x's memory format is kept: the gate broadcasts over H and W.
  const at::Tensor y = xb * gate.unsqueeze(-1).unsqueeze(-1);
  return unbatched ? y.squeeze(0) : y;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeImplicitAutograd, m) { m.impl("squeeze_excitation", &squeeze_excitation); }

// The add family's home: schemas, shape functions and autograd. Kernels:
// cpu/add_cpu.cpp, cuda/add.cu (their shared arithmetic: add.h; the one
// argument check and shape function: opforge/elementwise.h). The backward
// is an op of its own so that opcheck and torch.compile see it.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <opforge/autograd.h>
#include <opforge/elementwise.h>
#include <opforge/ops.h>

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  // relu(a + b) in one pass: the seeds' `slow_add`, fused.
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  // A Python number as either operand, as torch.add takes one: it becomes a
  // 0-d tensor of the other operand's dtype and device.
  m.def("add.number_b(Tensor a, Scalar b) -> Tensor");
  m.def("add.number_a(Scalar a, Tensor b) -> Tensor");
  m.def("add_relu.number_b(Tensor a, Scalar b) -> Tensor");
  m.def("add_relu.number_a(Scalar a, Tensor b) -> Tensor");
  // grad * (result > 0) in one pass; `result` is add_relu's output.
  m.def("_add_relu_backward(Tensor grad, Tensor result) -> Tensor");
}

namespace {

using opforge::autograd::Context;
using opforge::autograd::Tensors;

// ------------------------------------------------------------ shape functions

at::Tensor add_meta(const at::Tensor& a, const at::Tensor& b) {
  return opforge::elementwise_meta("opforge.add", {a, b}, {"a", "b"});
}

at::Tensor add_relu_meta(const at::Tensor& a, const at::Tensor& b) {
  return opforge::elementwise_meta("opforge.add_relu", {a, b}, {"a", "b"});
}

at::Tensor add_relu_backward_meta(const at::Tensor& grad, const at::Tensor& result) {
  return opforge::elementwise_meta("opforge._add_relu_backward", {grad, result}, {"grad", "result"});
}

// ------------------------------------------------------------------ autograd

// Saves what both inputs' gradients need: their shapes and dtypes.
void save_inputs(Context* ctx, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out) {
  opforge::autograd::save_input_meta(ctx, "a", a, out);
  opforge::autograd::save_input_meta(ctx, "b", b, out);
}

// The output gradient `g` as the gradients of a and b (summed over the
// broadcast dims, in each input's dtype); none for inputs that need none.
Tensors input_grads(Context* ctx, const at::Tensor& g) {
  return {ctx->needs_input_grad(0) ? opforge::autograd::to_input(ctx, "a", g) : at::Tensor(),
          ctx->needs_input_grad(1) ? opforge::autograd::to_input(ctx, "b", g) : at::Tensor()};
}

struct AddFunction : torch::autograd::Function<AddFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& a, const at::Tensor& b) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = opforge::add(a, b);
    }
    save_inputs(ctx, a, b, out);
    return out;
  }
  static Tensors backward(Context* ctx, Tensors grads) { return input_grads(ctx, grads[0]); }
};

struct AddReluFunction : torch::autograd::Function<AddReluFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& a, const at::Tensor& b) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = opforge::add_relu(a, b);
    }
    save_inputs(ctx, a, b, out);
    ctx->save_for_backward({out});
    return out;
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const at::Tensor result = ctx->get_saved_variables()[0];
    return input_grads(ctx, opforge::_add_relu_backward(grads[0], result));
  }
};

// d/d(grad) of grad * (result > 0) is the same mask; d/d(result) is zero
// almost everywhere, so second derivatives of add_relu are exact.
struct AddReluBackwardFunction : torch::autograd::Function<AddReluBackwardFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& grad, const at::Tensor& result) {
    ctx->save_for_backward({result});
    at::AutoDispatchBelowADInplaceOrView below;
    return opforge::_add_relu_backward(grad, result);
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const at::Tensor result = ctx->get_saved_variables()[0];
    return {ctx->needs_input_grad(0) ? opforge::_add_relu_backward(grads[0], result) : at::Tensor(), at::Tensor()};
  }
};

// Without a graph to record, straight to the kernel below autograd.
template <typename Function, at::Tensor (*Op)(const at::Tensor&, const at::Tensor&)>
at::Tensor autograd_kernel(const at::Tensor& a, const at::Tensor& b) {
  if (!opforge::autograd::records_graph(a, b)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return Op(a, b);
  }
  return Function::apply(a, b);
}

// ------------------------------------------------------- number operands

// The number as a 0-d tensor like `other` (its dtype and device); an other
// that is not a tensor of a supported float dtype is refused by the op.
at::Tensor number_like(const at::Scalar& number, const at::Tensor& other) {
  return at::scalar_tensor(number, other.options());
}

template <at::Tensor (*Op)(const at::Tensor&, const at::Tensor&)>
at::Tensor with_number_b(const at::Tensor& a, const at::Scalar& b) {
  return Op(a, number_like(b, a));
}

template <at::Tensor (*Op)(const at::Tensor&, const at::Tensor&)>
at::Tensor with_number_a(const at::Scalar& a, const at::Tensor& b) {
  return Op(number_like(a, b), b);
}

}  // namespace

// The number overloads decompose into the tensor ones (whose autograd and
// shape functions they use), under torch.compile too.
TORCH_LIBRARY_IMPL(opforge, CompositeImplicitAutograd, m) {
  m.impl("add.number_b", &with_number_b<opforge::add>);
  m.impl("add.number_a", &with_number_a<opforge::add>);
  m.impl("add_relu.number_b", &with_number_b<opforge::add_relu>);
  m.impl("add_relu.number_a", &with_number_a<opforge::add_relu>);
}

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("add", &add_meta);
  m.impl("add_relu", &add_relu_meta);
  m.impl("_add_relu_backward", &add_relu_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("add", &autograd_kernel<AddFunction, opforge::add>);
  m.impl("add_relu", &autograd_kernel<AddReluFunction, opforge::add_relu>);
  m.impl("_add_relu_backward", &autograd_kernel<AddReluBackwardFunction, opforge::_add_relu_backward>);
}

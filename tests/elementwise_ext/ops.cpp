// Test ops built on opforge's N-input elementwise helpers: schemas, shape
// functions, CPU kernels and autograd in one translation unit (the per-ISA
// loops are cpu/kernels.h; the CUDA kernels cuda/ops.cu).
//
//   fma3(x, y, z)                  = x * y + z
//   gelu_bias(x, bias)             = gelu_tanh(x + bias)
//   _gelu_bias_backward(grad, x, bias) = grad * gelu_tanh'(x + bias), full size
//
// gelu_bias's backward reads its inputs, not its output, and reduces the
// full-size gradient to each input's shape (sum_to_size over the broadcast dims).
#include <torch/library.h>

#include <opforge/autograd.h>
#include <opforge/cpu_elementwise.h>
#include <opforge/cpu_isa.h>
#include <opforge/elementwise.h>

#define NARY_LOOP_ARGS c10::ScalarType, char**, const int64_t*, int64_t, int64_t
OPFORGE_CPU_DECLARE(void, nary_test_fma3_loop, NARY_LOOP_ARGS)
OPFORGE_CPU_DECLARE(void, nary_test_gelu_bias_loop, NARY_LOOP_ARGS)
OPFORGE_CPU_DECLARE(void, nary_test_gelu_bias_backward_loop, NARY_LOOP_ARGS)
OPFORGE_CPU_DECLARE(int, nary_test_isa)

TORCH_LIBRARY(opforge_nary_test, m) {
  m.def("fma3(Tensor x, Tensor y, Tensor z) -> Tensor");
  m.def("gelu_bias(Tensor x, Tensor bias) -> Tensor");
  m.def("_gelu_bias_backward(Tensor grad, Tensor x, Tensor bias) -> Tensor");
  // Which ISA's loops run on this CPU: 0 DEFAULT, 1 AVX2, 2 AVX512.
  m.def("cpu_isa() -> int");
}

namespace {

using opforge::autograd::Context;
using opforge::autograd::Tensors;

constexpr const char* kFma3 = "opforge_nary_test.fma3";
constexpr const char* kGelu = "opforge_nary_test.gelu_bias";
constexpr const char* kGeluBackward = "opforge_nary_test._gelu_bias_backward";

at::Tensor fma3_cpu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(nary_test_fma3_loop), kFma3, {x, y, z}, {"x", "y", "z"});
}

at::Tensor gelu_bias_cpu(const at::Tensor& x, const at::Tensor& bias) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(nary_test_gelu_bias_loop), kGelu, {x, bias}, {"x", "bias"});
}

at::Tensor gelu_bias_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  return opforge::cpu::run_elementwise(OPFORGE_CPU_SELECT(nary_test_gelu_bias_backward_loop), kGeluBackward,
                                       {grad, x, bias}, {"grad", "x", "bias"});
}

at::Tensor fma3_meta(const at::Tensor& x, const at::Tensor& y, const at::Tensor& z) {
  return opforge::elementwise_meta(kFma3, {x, y, z}, {"x", "y", "z"});
}

at::Tensor gelu_bias_meta(const at::Tensor& x, const at::Tensor& bias) {
  return opforge::elementwise_meta(kGelu, {x, bias}, {"x", "bias"});
}

at::Tensor gelu_bias_backward_meta(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  return opforge::elementwise_meta(kGeluBackward, {grad, x, bias}, {"grad", "x", "bias"});
}

int64_t cpu_isa() { return OPFORGE_CPU_SELECT(nary_test_isa)(); }

at::Tensor call_gelu_bias(const at::Tensor& x, const at::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opforge_nary_test::gelu_bias", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x, bias);
}

at::Tensor call_gelu_bias_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("opforge_nary_test::_gelu_bias_backward", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(grad, x, bias);
}

// The backward needs x and bias (z = x + bias), not the output. One kernel
// gives the full-size d(loss)/dz; each input's gradient is that summed over
// the dims it was broadcast along, in its own dtype (autograd.h to_input).
struct GeluBiasFunction : torch::autograd::Function<GeluBiasFunction> {
  static at::Tensor forward(Context* ctx, const at::Tensor& x, const at::Tensor& bias) {
    at::Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = call_gelu_bias(x, bias);
    }
    opforge::autograd::save_input_meta(ctx, "x", x, out);
    opforge::autograd::save_input_meta(ctx, "bias", bias, out);
    ctx->save_for_backward({x, bias});
    return out;
  }
  static Tensors backward(Context* ctx, Tensors grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dz = call_gelu_bias_backward(grads[0], saved[0], saved[1]);
    return {ctx->needs_input_grad(0) ? opforge::autograd::to_input(ctx, "x", dz) : at::Tensor(),
            ctx->needs_input_grad(1) ? opforge::autograd::to_input(ctx, "bias", dz) : at::Tensor()};
  }
};

at::Tensor gelu_bias_autograd(const at::Tensor& x, const at::Tensor& bias) {
  if (!opforge::autograd::records_graph(x, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return call_gelu_bias(x, bias);
  }
  return GeluBiasFunction::apply(x, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge_nary_test, CPU, m) {
  m.impl("fma3", &fma3_cpu);
  m.impl("gelu_bias", &gelu_bias_cpu);
  m.impl("_gelu_bias_backward", &gelu_bias_backward_cpu);
}

TORCH_LIBRARY_IMPL(opforge_nary_test, Meta, m) {
  m.impl("fma3", &fma3_meta);
  m.impl("gelu_bias", &gelu_bias_meta);
  m.impl("_gelu_bias_backward", &gelu_bias_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge_nary_test, Autograd, m) { m.impl("gelu_bias", &gelu_bias_autograd); }

TORCH_LIBRARY_IMPL(opforge_nary_test, CompositeExplicitAutograd, m) { m.impl("cpu_isa", &cpu_isa); }

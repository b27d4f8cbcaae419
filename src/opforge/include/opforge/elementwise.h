// Shared set-up for elementwise ops over any number of tensor inputs:
// checks, type promotion and a TensorIterator that handles broadcasting,
// strides and the output's memory format exactly as torch's own elementwise
// ops do. Backends only supply the loop (cpu_loops.h, cuda_loops.cuh); the
// CPU driver that runs one is cpu_elementwise.h.
//
// Inputs and their names come as two lists of the same length, e.g.
//   opforge::make_float_iter("myops.fma3", {x, y, z}, {"x", "y", "z"});
// and every message names the op and the argument(s) at fault.
#pragma once

#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/TypeProperties.h>
#include <ATen/ops/add.h>

#include <opforge/checks.h>

#include <string>

namespace opforge {

// A bug in the op's own C++ code, not in the caller's input: said as such.
inline void check_names(const char* op, at::ArrayRef<at::Tensor> inputs, at::ArrayRef<const char*> names) {
  TORCH_CHECK(!inputs.empty() && inputs.size() == names.size(), op, ": the op's C++ code passes ",
              num(static_cast<int64_t>(inputs.size())), " inputs and ", num(static_cast<int64_t>(names.size())),
              " names to opforge's elementwise helpers; they must be as many, and at least one");
}

// The common case needs no TensorIterator: one dtype (a supported float),
// one shape, every input contiguous, one device. A flat loop over the
// elements then gives torch's result (a contiguous output) with less set-up
// cost. Nothing else needs checking then: every check below passes.
inline bool is_flat(at::ArrayRef<at::Tensor> inputs) {
  if (inputs.empty() || !inputs[0].defined()) return false;
  const at::Tensor& first = inputs[0];
  if (!is_supported_float(first.scalar_type()) || !first.is_contiguous()) return false;
  for (size_t k = 1; k < inputs.size(); ++k) {
    const at::Tensor& t = inputs[k];
    if (!t.defined() || t.scalar_type() != first.scalar_type() || t.device() != first.device() ||
        !t.sizes().equals(first.sizes()) || !t.is_contiguous())
      return false;
  }
  return true;
}

inline bool is_flat_binary(const at::Tensor& a, const at::Tensor& b) { return is_flat({a, b}); }

// The argument contract of an elementwise op, shared by its CPU and CUDA
// kernels and its shape function: every input a float tensor (TypeError
// naming it), all on the first input's device, shapes that broadcast
// (RuntimeError naming the two that do not, as torch raises for its own
// ops). Sizes are read as SymInts, so shape functions under torch.compile's
// dynamic shapes share it.
inline void check_float_inputs(const char* op, at::ArrayRef<at::Tensor> inputs, at::ArrayRef<const char*> names) {
  check_names(op, inputs, names);
  for (size_t k = 0; k < inputs.size(); ++k) check_float_tensor(inputs[k], op, names[k]);
  for (size_t k = 1; k < inputs.size(); ++k) check_same_device(inputs[0], names[0], inputs[k], names[k], op);
  int64_t ndim = 0;
  for (const auto& t : inputs) ndim = std::max<int64_t>(ndim, t.dim());
  for (int64_t i = 0; i < ndim; ++i) {  // i counts dimensions from the right
    // `size` is the broadcast size so far, set by input `from` (or 1).
    auto size_of = [&](size_t k) {
      const auto sizes = inputs[k].sym_sizes();
      const int64_t d = static_cast<int64_t>(sizes.size());
      return i < d ? sizes[d - 1 - i] : c10::SymInt(1);
    };
    c10::SymInt size = size_of(0);
    size_t from = 0;
    for (size_t k = 1; k < inputs.size(); ++k) {
      const c10::SymInt s = size_of(k);
      // The test in this order (equal first) asks no more of symbolic sizes
      // than torch's own broadcasting does.
      TORCH_CHECK(s == size || s == 1 || size == 1, op, ": ", names[from], " with shape ",
                  shape(inputs[from].sym_sizes()), " and ", names[k], " with shape ", shape(inputs[k].sym_sizes()),
                  " are not broadcastable (dimension ", num(ndim - 1 - i), ": ", num(size), " vs ", num(s), ")");
      if (size == 1) {
        size = s;
        from = k;
      }
    }
  }
}

inline void check_binary_args(const char* op, const at::Tensor& a, const char* a_name, const at::Tensor& b,
                              const char* b_name) {
  check_float_inputs(op, {a, b}, {a_name, b_name});
}

// The dtype torch's elementwise ops give these inputs: the common type of
// the dimensioned ones, 0-d tensors only where they are of a higher
// category (float16 + float32 -> float32, a 0-d float64 + float16 -> float16).
inline c10::ScalarType float_result_type(at::ArrayRef<at::Tensor> inputs) {
  at::native::ResultTypeState state;
  for (const auto& t : inputs) state = at::native::update_result_type_state(t, state);
  return at::native::result_type(state);
}

// An iterator over `inputs` promoted to their result type, with
// `n_outputs` freshly allocated outputs (operands 0 .. n_outputs - 1) of
// that dtype, the broadcast shape and torch's memory-format rules
// (channels-last in, channels-last out). Checks nothing: call
// check_float_inputs first, or use make_float_iter.
inline at::TensorIterator make_float_iter_unchecked(at::ArrayRef<at::Tensor> inputs, int n_outputs = 1) {
  const auto common = float_result_type(inputs);
  at::TensorIteratorConfig config;
  for (int k = 0; k < n_outputs; ++k) config.add_owned_output(at::Tensor());
  // Owned operands: the promoted copies die with the caller's frame, the
  // iterator keeps them alive as long as it lives.
  for (const auto& t : inputs) config.add_owned_const_input(t.scalar_type() == common ? t : t.to(common));
  return config.build();
}

// check_float_inputs, then make_float_iter_unchecked: all an elementwise
// op needs before its loop. `n_outputs` > 1 is for backward passes that
// give several full-size results at once (see docs/cpp_helpers.md for the
// gradient of a broadcast input: sum_to_size).
inline at::TensorIterator make_float_iter(const char* op, at::ArrayRef<at::Tensor> inputs,
                                          at::ArrayRef<const char*> names, int n_outputs = 1) {
  check_float_inputs(op, inputs, names);
  return make_float_iter_unchecked(inputs, n_outputs);
}

inline at::TensorIterator make_binary_float_iter(const at::Tensor& a, const at::Tensor& b) {
  return make_float_iter_unchecked({a, b});
}

// The shape function of an elementwise op (its Meta kernel): the checks,
// then an output of the shape, dtype and memory format make_float_iter
// gives, symbolic sizes included (a TensorIterator needs concrete sizes, so
// this folds aten's add over the inputs: the same rules, one pair at a
// time). Its values are meaningless; only its metadata counts.
inline at::Tensor elementwise_meta(const char* op, at::ArrayRef<at::Tensor> inputs, at::ArrayRef<const char*> names) {
  check_float_inputs(op, inputs, names);
  if (inputs.size() == 1) return at::add(inputs[0], 0);
  at::Tensor out = at::add(inputs[0], inputs[1]);
  for (size_t k = 2; k < inputs.size(); ++k) out = at::add(out, inputs[k]);
  return out;
}

}  // namespace opforge

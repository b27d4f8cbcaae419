// The C++ test's checking helpers: comparisons with ATen's results and
// gradients, and a runner that prints one line per check. Only
// tests/cpp/test_ops.cpp includes this (one translation unit).
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/randn_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace opforge_test {

using Tensors = std::vector<at::Tensor>;
using Fn = std::function<at::Tensor(const Tensors&)>;

// A result that differs from ATen's (an exception from an op is reported as is).
struct Mismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline constexpr at::ScalarType kDtypes[] = {at::kFloat, at::kDouble};

inline const char* dtype_name(at::ScalarType t) { return t == at::kDouble ? "float64" : "float32"; }

inline std::string shape(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// |got - want| <= atol + rtol * |want|: float64 close to exact, float32 with
// room for a different summation order (vectorised kernels, conv sums).
inline void expect_close(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined()) throw Mismatch(what + ": undefined (no gradient came back)");
  if (!got.sizes().equals(want.sizes()))
    throw Mismatch(what + ": shape " + shape(got.sizes()) + ", ATen's is " + shape(want.sizes()));
  if (got.scalar_type() != want.scalar_type())
    throw Mismatch(what + ": dtype " + std::string(c10::toString(got.scalar_type())) + ", ATen's is " +
                   c10::toString(want.scalar_type()));
  const bool f64 = want.scalar_type() == at::kDouble;
  const double rtol = f64 ? 1e-9 : 1e-4, atol = f64 ? 1e-10 : 1e-5;
  if (!at::allclose(got, want, rtol, atol)) {
    const double diff = (got - want).abs().max().item<double>();
    throw Mismatch(what + ": max |difference| " + std::to_string(diff) + " (rtol " + std::to_string(rtol) + ", atol " +
                   std::to_string(atol) + ")");
  }
}

// dtype, shape and the first values, on one line.
inline std::string values(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream out;
  out << c10::toString(t.scalar_type()) << shape(t.sizes()) << " [";
  const at::Tensor flat = t.reshape(-1).to(at::kDouble);
  for (int64_t i = 0; i < std::min<int64_t>(flat.numel(), 20); ++i) out << (i ? ", " : "") << flat[i].item<double>();
  out << (flat.numel() > 20 ? ", ...]" : "]");
  return out.str();
}

inline void expect_equal(const std::string& what, const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined() || got.scalar_type() != want.scalar_type() || !got.sizes().equals(want.sizes()) ||
      !at::equal(got, want))
    throw Mismatch(what + ": got " + values(got) + ", expected " + values(want));
}

// The first two non-empty lines of a message: a c10::Error's context can
// run long, and a wrong-signature error starts with a newline.
inline std::string headline(const std::string& message) {
  std::istringstream in(message);
  std::string line, out;
  for (int kept = 0; kept < 2 && std::getline(in, line);) {
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos) continue;
    out += (kept++ ? " " : "") + line.substr(start);
  }
  return out;
}

// Runs named checks, printing one line each; any exception fails the check.
class Checks {
 public:
  template <typename Body>
  bool run(const std::string& name, Body&& body) {
    ++count_;
    std::string why;
    try {
      body();
    } catch (const Mismatch& e) {
      why = e.what();
    } catch (const c10::Error& e) {
      why = std::string("c10::Error: ") + headline(e.what_without_backtrace());
    } catch (const std::exception& e) {
      why = std::string("exception: ") + headline(e.what());
    }
    if (why.empty()) {
      std::cout << "ok    " << name << std::endl;
      return true;
    }
    ++failed_;
    std::cout << "FAIL  " << name << ": " << why << std::endl;
    return false;
  }
  // A family whose ops cannot be called as ops.h declares them (the probe
  // failed) skips its other checks: they would all fail the same way.
  void skip(const std::string& family) {
    std::cout << "skip  the other " << family << " checks: they need the ops above" << std::endl;
  }
  int count() const { return count_; }
  int failed() const { return failed_; }

 private:
  int count_ = 0, failed_ = 0;
};

inline at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::randn(sizes, at::TensorOptions(dtype));
}

// `ours` and `ref` on the same inputs.
inline void check_forward(Checks& checks, const std::string& name, const Fn& ours, const Fn& ref,
                          const Tensors& inputs) {
  checks.run(name, [&] { expect_close("output", ours(inputs), ref(inputs)); });
}

// y and the gradients of sum(y * g) for the inputs, on leaf copies of them.
inline Tensors value_and_grads(const Fn& fn, const Tensors& inputs, const at::Tensor& g) {
  Tensors leaves;
  for (const auto& x : inputs) leaves.push_back(x.detach().clone().requires_grad_(true));
  const at::Tensor y = fn(leaves);
  if (!y.requires_grad()) throw Mismatch("the output does not require grad: no autograd kernel recorded a graph");
  // Without an Autograd kernel registered in C++ torch's fallback records a
  // node that gives no gradient (the op's autograd lives in Python only).
  const std::string node = y.grad_fn()->name();
  if (node.find("NotImplemented") != std::string::npos)
    throw Mismatch("no Autograd kernel registered in C++ (torch's fallback node " + node + ")");
  Tensors out = {y.detach()};
  for (auto& gx : torch::autograd::grad({y}, leaves, {g})) out.push_back(gx);
  return out;
}

// Forward and backward of `ours` against ATen's autograd through `ref`,
// with one random output gradient for both.
inline void check_backward(Checks& checks, const std::string& name, const Fn& ours, const Fn& ref,
                           const Tensors& inputs) {
  checks.run(name, [&] {
    at::Tensor g;
    {
      at::NoGradGuard no_grad;
      g = at::randn_like(ref(inputs));
    }
    const Tensors want = value_and_grads(ref, inputs, g);
    const Tensors got = value_and_grads(ours, inputs, g);
    expect_close("output", got[0], want[0]);
    for (size_t i = 1; i < want.size(); ++i) expect_close("grad of input " + std::to_string(i - 1), got[i], want[i]);
  });
}

inline void check_both(Checks& checks, const std::string& name, const Fn& ours, const Fn& ref, const Tensors& inputs) {
  check_forward(checks, name + " forward", ours, ref, inputs);
  check_backward(checks, name + " backward", ours, ref, inputs);
}

// Runs `call` and expects it to throw E (a c10::Error subclass) whose
// message contains every piece of `expected`.
template <typename E, typename Call>
inline void expect_throws(const char* type_name, Call&& call, std::initializer_list<const char*> expected) {
  try {
    call();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if constexpr (!std::is_same_v<E, c10::Error>)
      if (!dynamic_cast<const E*>(&e))
        throw Mismatch(std::string("threw another c10::Error than ") + type_name + ": " + message);
    for (const char* piece : expected)
      if (message.find(piece) == std::string::npos)
        throw Mismatch(std::string("message lacks \"") + piece + "\": " + message);
    return;
  }
  throw Mismatch(std::string("no exception; expected ") + type_name);
}

}  // namespace opforge_test

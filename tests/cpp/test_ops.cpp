// Calls every op of <opforge/ops.h> from a C++ program that neither links
// nor starts Python, and compares forward results and gradients with ATen's
// on the CPU, in float32 and float64.
//
//   test_ops [LIBRARY.so ...] [FAMILY ...]
//
// Each LIBRARY (an argument ending in ".so", e.g. opforge/_C.abi3.so) is
// dlopen'ed first: the program links libtorch only, so it tests the
// library a Python install uses and needs no rebuild when the kernels
// change. A program linked against the library itself passes none.
// FAMILYs (add, softmax, conv, nms) select checks; none means all; --list
// prints them. Inputs are random, seeded by $OPFORGE_TEST_CASE_SEED (the
// pytest run's seed) or 0. One line per check; the exit status is 1 when
// any check failed, 2 on bad usage or a library that does not load.
#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <dlfcn.h>

#include <opforge/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "checks.h"

namespace {

using namespace opforge_test;

// ------------------------------------------------------------------ add family

void add_family(Checks& checks) {
  if (!checks.run("add ops callable as ops.h declares them", [] {
        const at::Tensor t = at::ones({2});
        opforge::add(t, t);
        opforge::add_relu(t, t);
        opforge::_add_relu_backward(t, t);
      }))
    return checks.skip("add");
  const Fn add = [](const Tensors& t) { return opforge::add(t[0], t[1]); };
  const Fn add_ref = [](const Tensors& t) { return t[0] + t[1]; };
  const Fn add_relu = [](const Tensors& t) { return opforge::add_relu(t[0], t[1]); };
  const Fn add_relu_ref = [](const Tensors& t) { return at::relu(t[0] + t[1]); };
  for (const auto dtype : kDtypes) {
    const std::string d = dtype_name(dtype);
    // Same shapes (the flat path), then both operands broadcast (gradients summed back).
    const Tensors same = {randn({4, 33}, dtype), randn({4, 33}, dtype)};
    const Tensors broadcast = {randn({3, 1, 5}, dtype), randn({4, 1}, dtype)};
    check_both(checks, "add " + d, add, add_ref, same);
    check_both(checks, "add " + d + " broadcast", add, add_ref, broadcast);
    check_both(checks, "add_relu " + d, add_relu, add_relu_ref, same);
    check_both(checks, "add_relu " + d + " broadcast", add_relu, add_relu_ref, broadcast);
    check_forward(
        checks, "_add_relu_backward " + d, [](const Tensors& t) { return opforge::_add_relu_backward(t[0], t[1]); },
        [](const Tensors& t) { return t[0] * (t[1] > 0); }, {randn({4, 33}, dtype), at::relu(randn({4, 33}, dtype))});
  }
  // Bad input: opforge's checks throw c10::Error subclasses with its messages.
  checks.run("add_relu bad shapes throw c10::Error", [] {
    expect_throws<c10::Error>("c10::Error", [] { opforge::add_relu(at::ones({2, 3}), at::ones({4, 5})); },
                              {"opforge.add_relu: a with shape [2, 3] and b with shape [4, 5] are not broadcastable"});
  });
  checks.run("add_relu int64 input throws c10::TypeError", [] {
    expect_throws<c10::TypeError>(
        "c10::TypeError", [] { opforge::add_relu(at::ones({2}, at::kLong), at::ones({2})); },
        {"opforge.add_relu: a must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"});
  });
}

// -------------------------------------------------------------- softmax family

// softmax(x * scale + mask) as ATen composes it: a bool mask (True = masked
// out) and `causal` (key j > query i masked) become -inf.
at::Tensor masked_softmax_ref(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale, bool causal) {
  at::Tensor s = x * scale;
  if (mask && mask->scalar_type() == at::kBool) s = s.masked_fill(*mask, -INFINITY);
  if (mask && mask->scalar_type() != at::kBool) s = s + *mask;
  if (causal) {
    const int64_t lq = x.size(-2), lk = x.size(-1);
    s = s.masked_fill(at::ones({lq, lk}, at::kBool).triu(1), -INFINITY);
  }
  return at::softmax(s, -1);
}

void softmax_family(Checks& checks) {
  if (!checks.run("softmax ops callable as ops.h declares them", [] {
        const at::Tensor t = at::ones({2, 2});
        opforge::softmax(t);
        opforge::log_softmax(t);
        opforge::scaled_masked_softmax(t, std::nullopt, 1.0, true);
        opforge::_softmax_backward(t, t, -1);
        opforge::_log_softmax_backward(t, t, -1);
        opforge::_scaled_masked_softmax_backward(t, t, 1.0);
      }))
    return checks.skip("softmax");
  for (const auto dtype : kDtypes) {
    const std::string d = dtype_name(dtype);
    const Tensors x = {randn({3, 5, 17}, dtype)};
    for (const int64_t dim : {-1, 1, 0}) {
      const std::string at_dim = " dim " + std::to_string(dim);
      check_both(
          checks, "softmax " + d + at_dim, [dim](const Tensors& t) { return opforge::softmax(t[0], dim); },
          [dim](const Tensors& t) { return at::softmax(t[0], dim); }, x);
      check_both(
          checks, "log_softmax " + d + at_dim, [dim](const Tensors& t) { return opforge::log_softmax(t[0], dim); },
          [dim](const Tensors& t) { return at::log_softmax(t[0], dim); }, x);
      // The backward ops alone, on (grad, output): the formulas of ATen's own backward.
      const Tensors grad_softmax = {randn({3, 5, 17}, dtype), at::softmax(x[0], dim)};
      check_forward(
          checks, "_softmax_backward " + d + at_dim,
          [dim](const Tensors& t) { return opforge::_softmax_backward(t[0], t[1], dim); },
          [dim](const Tensors& t) { return t[1] * (t[0] - (t[0] * t[1]).sum(dim, true)); }, grad_softmax);
      const Tensors grad_log_softmax = {randn({3, 5, 17}, dtype), at::log_softmax(x[0], dim)};
      check_forward(
          checks, "_log_softmax_backward " + d + at_dim,
          [dim](const Tensors& t) { return opforge::_log_softmax_backward(t[0], t[1], dim); },
          [dim](const Tensors& t) { return t[0] - t[1].exp() * t[0].sum(dim, true); }, grad_log_softmax);
    }
    // dtype=: the input is converted first (float32 in, float64 out and back).
    const at::ScalarType other = dtype == at::kDouble ? at::kFloat : at::kDouble;
    check_forward(
        checks, "softmax " + d + " dtype " + dtype_name(other),
        [other](const Tensors& t) { return opforge::softmax(t[0], -1, other); },
        [other](const Tensors& t) { return at::softmax(t[0], -1, other); }, x);

    // Attention scores (B, H, Lq, Lk); no row fully masked (key 0 is always seen).
    const Tensors scores = {randn({2, 3, 5, 7}, dtype)};
    at::Tensor bool_mask = at::rand({5, 7}) > 0.6;
    bool_mask.select(1, 0).fill_(false);
    const at::Tensor additive = randn({1, 5, 7}, dtype);
    struct Case {
      const char* name;
      std::optional<at::Tensor> mask;
      double scale;
      bool causal;
    };
    const Case cases[] = {{"no mask", std::nullopt, 0.5, false},
                          {"bool mask", bool_mask, 0.125, false},
                          {"additive mask", additive, 1.0, false},
                          {"causal", std::nullopt, 0.25, true},
                          {"bool mask causal", bool_mask, 2.0, true}};
    for (const Case& c : cases) {
      check_both(
          checks, "scaled_masked_softmax " + d + " " + c.name,
          [&c](const Tensors& t) { return opforge::scaled_masked_softmax(t[0], c.mask, c.scale, c.causal); },
          [&c](const Tensors& t) { return masked_softmax_ref(t[0], c.mask, c.scale, c.causal); }, scores);
    }
    const Tensors grad_scaled = {randn({2, 3, 5, 7}, dtype), at::softmax(scores[0] * 0.5, -1)};
    check_forward(
        checks, "_scaled_masked_softmax_backward " + d,
        [](const Tensors& t) { return opforge::_scaled_masked_softmax_backward(t[0], t[1], 0.5); },
        [](const Tensors& t) { return 0.5 * t[1] * (t[0] - (t[0] * t[1]).sum(-1, true)); }, grad_scaled);
  }
}

// ----------------------------------------------------------------- conv family

// _conv2d_3x3_backward alone against ATen's autograd of (relu of) conv2d;
// gradients left out of output_mask must come back empty.
void check_conv_backward_op(Checks& checks, const std::string& name, const Tensors& inputs, int64_t stride,
                            int64_t padding, int64_t groups, bool relu, std::array<bool, 3> mask) {
  checks.run(name, [&] {
    Tensors leaves;
    for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
    at::Tensor y = at::conv2d(leaves[0], leaves[1], leaves[2], stride, padding, 1, groups);
    if (relu) y = at::relu(y);
    const at::Tensor g = at::randn_like(y);
    const Tensors want = torch::autograd::grad({y}, leaves, {g});
    const auto result = relu ? std::optional<at::Tensor>(y.detach()) : std::nullopt;
    const auto [gx, gw, gb] =
        opforge::_conv2d_3x3_backward(g, result, inputs[0], inputs[1], stride, padding, groups, mask);
    const at::Tensor got[] = {gx, gw, gb};
    const char* names[] = {"grad x", "grad weight", "grad bias"};
    for (int i = 0; i < 3; ++i) {
      if (mask[i]) {
        expect_close(names[i], got[i], want[i]);
      } else if (got[i].defined() && got[i].numel() != 0) {
        throw Mismatch(std::string(names[i]) + ": not asked for, yet has shape " + shape(got[i].sizes()));
      }
    }
  });
}

void conv_family(Checks& checks) {
  if (!checks.run("conv ops callable as ops.h declares them", [] {
        const at::Tensor x = at::ones({1, 1, 4, 4}), w = at::ones({1, 1, 3, 3});
        opforge::conv2d_3x3(x, w);
        opforge::conv2d_3x3(x, w, std::nullopt, 1, "same");
        opforge::_conv2d_3x3_backward(at::ones({1, 1, 2, 2}), std::nullopt, x, w, 1, 0, 1, {true, true, true});
      }))
    return checks.skip("conv");
  for (const auto dtype : kDtypes) {
    const std::string d = dtype_name(dtype);
    const int64_t c = 4;
    const at::Tensor x = randn({2, c, 9, 8}, dtype);
    struct Kind {
      const char* name;
      at::Tensor weight;
      int64_t groups;
    };
    // Dense, and depthwise with a channel multiplier of 2.
    const Kind kinds[] = {{"dense", randn({6, c, 3, 3}, dtype), 1}, {"depthwise", randn({2 * c, 1, 3, 3}, dtype), c}};
    for (const Kind& k : kinds) {
      const Tensors inputs = {x, k.weight, randn({k.weight.size(0)}, dtype)};
      const int64_t groups = k.groups;
      for (const int64_t stride : {1, 2}) {
        for (const int64_t padding : {0, 1}) {
          for (const bool relu : {false, true}) {
            const std::string name = "conv2d_3x3 " + d + " " + k.name + " stride " + std::to_string(stride) +
                                     " padding " + std::to_string(padding) + (relu ? " relu" : "");
            const std::optional<std::string_view> act = relu ? std::optional<std::string_view>("relu") : std::nullopt;
            check_both(
                checks, name,
                [=](const Tensors& t) { return opforge::conv2d_3x3(t[0], t[1], t[2], stride, padding, groups, act); },
                [=](const Tensors& t) {
                  const at::Tensor y = at::conv2d(t[0], t[1], t[2], stride, padding, 1, groups);
                  return relu ? at::relu(y) : y;
                },
                inputs);
          }
        }
      }
      // The string-padding overload ("same" is 1 and "valid" 0 at stride 1).
      for (const char* pad : {"same", "valid"}) {
        const std::string padding = pad;
        check_both(
            checks, "conv2d_3x3 " + d + " " + k.name + " padding '" + padding + "'",
            [=](const Tensors& t) { return opforge::conv2d_3x3(t[0], t[1], t[2], 1, padding, groups); },
            [=](const Tensors& t) { return at::conv2d(t[0], t[1], t[2], 1, padding, 1, groups); }, inputs);
      }
      // Unbatched (C, H, W) input, no bias, stride given as a pair.
      check_both(
          checks, "conv2d_3x3 " + d + " " + k.name + " unbatched",
          [=](const Tensors& t) {
            return opforge::conv2d_3x3(t[0], t[1], std::nullopt, {2, 2}, {1, 1}, groups, "relu");
          },
          [=](const Tensors& t) { return at::relu(at::conv2d(t[0], t[1], std::nullopt, 2, 1, 1, groups)); },
          {x[0], k.weight});
      const std::string op = "_conv2d_3x3_backward " + d + " " + k.name;
      check_conv_backward_op(checks, op + " relu", inputs, 1, 1, groups, true, {true, true, true});
      check_conv_backward_op(checks, op + " stride 2 no grad weight", inputs, 2, 0, groups, false, {true, false, true});
    }
  }
}

// ------------------------------------------------------------------ nms family

// Greedy NMS as torchvision defines it, in the boxes' dtype: candidates
// (score > score_threshold) by decreasing score, ties by index; a box is
// dropped when its IoU with a kept box (of its class, given idxs) is > thr.
template <typename T>
at::Tensor reference_nms(const at::Tensor& boxes_t, const at::Tensor& scores_t, const at::Tensor& idxs_t, double thr,
                         std::optional<double> score_threshold = std::nullopt,
                         std::optional<int64_t> max_output = std::nullopt) {
  const auto boxes = boxes_t.contiguous();
  const auto b = boxes.accessor<T, 2>();
  const auto s = scores_t.accessor<T, 1>();
  const at::Tensor classes = idxs_t.defined() ? idxs_t.to(at::kLong) : at::zeros({boxes.size(0)}, at::kLong);
  const auto cls = classes.accessor<int64_t, 1>();
  std::vector<int64_t> order;
  for (int64_t i = 0; i < boxes.size(0); ++i)
    if (!score_threshold || static_cast<double>(s[i]) > *score_threshold) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return s[i] > s[j]; });
  const auto area = [&](int64_t i) { return (b[i][2] - b[i][0]) * (b[i][3] - b[i][1]); };
  const auto iou = [&](int64_t i, int64_t j) {
    const T w = std::max(T(0), std::min(b[i][2], b[j][2]) - std::max(b[i][0], b[j][0]));
    const T h = std::max(T(0), std::min(b[i][3], b[j][3]) - std::max(b[i][1], b[j][1]));
    const T inter = w * h;
    return inter / (area(i) + area(j) - inter);
  };
  std::vector<int64_t> kept;
  for (const int64_t i : order) {
    const bool dropped =
        std::any_of(kept.begin(), kept.end(), [&](int64_t j) { return cls[i] == cls[j] && iou(i, j) > thr; });
    if (!dropped) kept.push_back(i);
  }
  if (max_output && static_cast<int64_t>(kept.size()) > *max_output) kept.resize(*max_output);
  return at::tensor(kept, at::kLong);
}

at::Tensor random_boxes(int64_t n, at::ScalarType dtype) {
  const at::Tensor corner = at::rand({n, 2}, at::TensorOptions(dtype)) * 10;
  const at::Tensor size = at::rand({n, 2}, at::TensorOptions(dtype)) * 4 + 1;
  return at::cat(Tensors{corner, corner + size}, 1);
}

void nms_family(Checks& checks) {
  if (!checks.run("nms ops callable as ops.h declares them", [] {
        const at::Tensor boxes = at::ones({2, 4}), scores = at::ones({2}), idxs = at::zeros({2}, at::kLong);
        opforge::nms(boxes, scores, 0.5);
        opforge::batched_nms(boxes, scores, idxs, 0.5);
        opforge::nms_padded(boxes, scores, 0.5, 2);
      }))
    return checks.skip("nms");
  // torchvision's documented example: box 1 overlaps box 0 (IoU 0.68) and goes.
  checks.run("nms known case", [] {
    const at::Tensor boxes =
        at::tensor({0.0f, 0.0f, 10.0f, 10.0f, 1.0f, 1.0f, 11.0f, 11.0f, 20.0f, 20.0f, 30.0f, 30.0f}).view({3, 4});
    const at::Tensor scores = at::tensor({0.9f, 0.8f, 0.7f});
    expect_equal("nms", opforge::nms(boxes, scores, 0.5), at::tensor({0L, 2L}));
    const auto [padded, count] = opforge::nms_padded(boxes, scores, 0.5, 4);
    expect_equal("nms_padded indices", padded, at::tensor({0L, 2L, -1L, -1L}));
    expect_equal("nms_padded count", count, at::scalar_tensor(2L, at::kLong));
    expect_equal("nms at IoU threshold 0.7", opforge::nms(boxes, scores, 0.7), at::tensor({0L, 1L, 2L}));
  });
  for (const auto dtype : kDtypes) {
    const std::string d = dtype_name(dtype);
    const at::Tensor boxes = random_boxes(60, dtype);
    const at::Tensor scores = at::rand({60}, at::TensorOptions(dtype));
    const at::Tensor idxs = at::randint(0, 3, {60}, at::kLong);
    const auto ref = [&](const at::Tensor& classes, double thr, std::optional<double> st = std::nullopt,
                         std::optional<int64_t> mo = std::nullopt) {
      return dtype == at::kDouble ? reference_nms<double>(boxes, scores, classes, thr, st, mo)
                                  : reference_nms<float>(boxes, scores, classes, thr, st, mo);
    };
    for (const double thr : {0.2, 0.5}) {
      const std::string t = " iou " + std::to_string(thr).substr(0, 3);
      checks.run("nms " + d + t, [&] { expect_equal("kept", opforge::nms(boxes, scores, thr), ref({}, thr)); });
      checks.run("nms " + d + t + " score_threshold max_output",
                 [&] { expect_equal("kept", opforge::nms(boxes, scores, thr, 0.3, 5), ref({}, thr, 0.3, 5)); });
      checks.run("batched_nms " + d + t, [&] {
        expect_equal("kept int64 idxs", opforge::batched_nms(boxes, scores, idxs, thr), ref(idxs, thr));
        expect_equal("kept int32 idxs", opforge::batched_nms(boxes, scores, idxs.to(at::kInt), thr), ref(idxs, thr));
        expect_equal("kept with options", opforge::batched_nms(boxes, scores, idxs, thr, 0.4, 7),
                     ref(idxs, thr, 0.4, 7));
      });
      for (const int64_t max_output : {int64_t{4}, int64_t{80}}) {
        for (const bool per_class : {false, true}) {
          const std::string name =
              "nms_padded " + d + t + " max_output " + std::to_string(max_output) + (per_class ? " per class" : "");
          checks.run(name, [&] {
            const at::Tensor classes = per_class ? idxs : at::Tensor();
            const auto [padded, count] =
                opforge::nms_padded(boxes, scores, thr, max_output, per_class ? std::optional(idxs) : std::nullopt);
            const at::Tensor kept = ref(classes, thr, std::nullopt, max_output);
            const at::Tensor want = at::full({max_output}, -1, at::kLong);
            want.narrow(0, 0, kept.size(0)).copy_(kept);
            expect_equal("indices", padded, want);
            expect_equal("count", count, at::scalar_tensor(kept.size(0), at::kLong));
          });
        }
      }
    }
  }
}

// -------------------------------------------------------------------- program

// The process must run without Python: neither libpython nor libtorch_python mapped.
void check_no_python(Checks& checks) {
  checks.run("no Python in the process", [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line))
      if (line.find("libpython") != std::string::npos || line.find("libtorch_python") != std::string::npos)
        throw Mismatch("mapped: " + line.substr(line.find('/')));
  });
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, void (*)(Checks&)> families = {
      {"add", add_family}, {"softmax", softmax_family}, {"conv", conv_family}, {"nms", nms_family}};
  std::vector<std::string> selected;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--list") {
      for (const auto& [name, _] : families) std::cout << name << "\n";
      return 0;
    }
    if (ends_with(arg, ".so")) {
      // Loading runs the library's TORCH_LIBRARY registrations.
      if (!dlopen(arg.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        std::cerr << "test_ops: cannot load " << arg << ": " << dlerror() << "\n";
        return 2;
      }
    } else if (families.count(arg)) {
      selected.push_back(arg);
    } else {
      std::cerr << "test_ops: unknown family '" << arg
                << "'\nusage: test_ops [--list] [LIBRARY.so ...] [add|softmax|conv|nms ...]\n";
      return 2;
    }
  }
  if (!c10::Dispatcher::singleton().findSchema({"opforge::add", ""})) {
    std::cerr << "test_ops: opforge's ops are not registered: pass the path of opforge/_C.abi3.so "
                 "or link the program against it\n";
    return 2;
  }
  if (selected.empty())
    for (const auto& [name, _] : families) selected.push_back(name);

  const char* seed = std::getenv("OPFORGE_TEST_CASE_SEED");
  at::manual_seed(seed ? std::stoull(seed) : 0);
  std::cout << "seed " << (seed ? seed : "0") << "\n";
  Checks checks;
  check_no_python(checks);
  for (const auto& name : selected) {
    std::cout << "--- " << name << "\n";
    families.at(name)(checks);
  }
  std::cout << checks.count() - checks.failed() << " passed, " << checks.failed() << " failed\n";
  return checks.failed() ? 1 : 0;
}

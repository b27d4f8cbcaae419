// The nms family's home: schemas, nms_padded's shape function and the check
// op behind nms's and batched_nms's fake kernels. Kernels: cpu/nms_cpu.cpp,
// cuda/nms.cu; the one argument contract: nms.h. The outputs are indices, so
// there is no backward.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "nms.h"

TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // Indices (int64) of the kept boxes, in decreasing score order.
  m.def(
      "nms(Tensor boxes, Tensor scores, float iou_threshold, *, float? score_threshold=None, "
      "int? max_output=None) -> Tensor");
  // Per-class NMS: boxes of different idxs never suppress each other.
  m.def(
      "batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, *, "
      "float? score_threshold=None, int? max_output=None) -> Tensor");
  // (indices padded with -1 to max_output, count): a shape that does not
  // depend on the data; idxs given: per class, as batched_nms.
  m.def(
      "nms_padded(Tensor boxes, Tensor scores, float iou_threshold, int max_output, *, Tensor? idxs=None, "
      "float? score_threshold=None) -> (Tensor, Tensor)");
  // nms's (idxs None) or batched_nms's (idxs given) argument checks alone:
  // their output size depends on the data, so their fake kernels stay in
  // Python (ops/nms.py) and run these C++ checks through this op.
  m.def("_nms_check(Tensor boxes, Tensor scores, Tensor? idxs, float? score_threshold, int? max_output) -> ()");
}

namespace {

// The real kernels' outputs: a contiguous (max_output,) int64 tensor and a
// 0-d count, on the boxes' device.
std::tuple<at::Tensor, at::Tensor> nms_padded_meta(const at::Tensor& boxes, const at::Tensor& scores,
                                                   double /*iou_threshold*/, int64_t max_output,
                                                   const std::optional<at::Tensor>& idxs,
                                                   std::optional<double> score_threshold) {
  opforge::nms::check_padded_args(boxes, scores, idxs, score_threshold, max_output);
  const auto long_opts = boxes.options().dtype(at::kLong);
  return {at::empty({max_output}, long_opts), at::empty({}, long_opts)};
}

void nms_check(const at::Tensor& boxes, const at::Tensor& scores, const std::optional<at::Tensor>& idxs,
               std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  opforge::nms::check_args(idxs.has_value() ? "opforge.batched_nms" : "opforge.nms", boxes, scores, idxs,
                           score_threshold, max_output);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) { m.impl("nms_padded", &nms_padded_meta); }

// Every backend, Meta included: FakeTensor (torch.compile, opcheck) runs it
// on fake tensors, with symbolic sizes under dynamic shapes.
TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) { m.impl("_nms_check", &nms_check); }

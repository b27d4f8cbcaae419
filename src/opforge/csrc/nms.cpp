// The nms family's schemas. Kernels: cpu/nms_cpu.cpp, cuda/nms.cu (their
// shared checks: nms.h); Python wrapper and fake kernels: ops/nms.py.
#include <torch/library.h>

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
}

// Every opforge op's schema, in one place. Kernels are registered per backend
// in cpu/<op>.cpp and cuda/<op>.cu; Python wrappers, fake kernels and
// autograd live in ops/<op>.py. Backward passes are ops of their own so that
// opcheck and torch.compile see them.
#include <torch/library.h>

// ---- add family (ops/add.py) ------------------------------------------------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  m.def("add(Tensor a, Tensor b) -> Tensor");
  // relu(a + b) in one pass: the seeds' `slow_add`, fused.
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  // grad * (result > 0) in one pass; `result` is add_relu's output.
  m.def("_add_relu_backward(Tensor grad, Tensor result) -> Tensor");
}

// ---- nms family (ops/nms.py) ------------------------------------------------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // Indices (int64) of the kept boxes, in decreasing score order.
  m.def("nms(Tensor boxes, Tensor scores, float iou_threshold, *, float? score_threshold=None, "
        "int? max_output=None) -> Tensor");
  // Per-class NMS: boxes of different idxs never suppress each other.
  m.def("batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold, *, "
        "float? score_threshold=None, int? max_output=None) -> Tensor");
  // (indices padded with -1 to max_output, count): a shape that does not
  // depend on the data; idxs given: per class, as batched_nms.
  m.def("nms_padded(Tensor boxes, Tensor scores, float iou_threshold, int max_output, *, Tensor? idxs=None, "
        "float? score_threshold=None) -> (Tensor, Tensor)");
}

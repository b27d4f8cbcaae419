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

// ---- dense 3x3 conv, tensor-core path (cuda/conv3x3_dense_mma.cu) ----------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // Testing / benchmark entry, not public API: relu?(conv3x3(x, w) + bias)
  // computed by the CUDA implicit-GEMM tensor-core kernel alone (groups 1).
  // Raises when that kernel declines the case instead of falling back, so a
  // test or timing is known to exercise it. CUDA only.
  m.def("_conv3x3_dense_mma(Tensor x, Tensor w, Tensor? bias, int stride, int padding, bool relu) -> Tensor");
}

// ---- softmax family (ops/softmax.py) ----------------------------------------
TORCH_LIBRARY_FRAGMENT(opforge, m) {
  // torch.softmax / torch.log_softmax over any dim; dtype= converts x first.
  m.def("softmax(Tensor x, int dim=-1, ScalarType? dtype=None) -> Tensor");
  m.def("log_softmax(Tensor x, int dim=-1, ScalarType? dtype=None) -> Tensor");
  // softmax(x * scale + mask) over the last dim; mask: bool (True = masked
  // out) or additive float of x's dtype, broadcastable to x; causal: keys
  // after the query (top-left aligned) are masked. Fully masked rows give 0.
  m.def("scaled_masked_softmax(Tensor x, Tensor? mask=None, float scale=1.0, bool causal=False) -> Tensor");
  // y * (grad - sum(grad * y)) over dim; y = softmax's output.
  m.def("_softmax_backward(Tensor grad, Tensor output, int dim) -> Tensor");
  // grad - exp(y) * sum(grad) over dim; y = log_softmax's output.
  m.def("_log_softmax_backward(Tensor grad, Tensor output, int dim) -> Tensor");
  // scale * y * (grad - sum(grad * y)) over the last dim.
  m.def("_scaled_masked_softmax_backward(Tensor grad, Tensor output, float scale) -> Tensor");
  // CUDA only, for measuring launch plans (bench/softmax_plans.py):
  // softmax and its backward over the last dim with a given plan: threads
  // per row (or per chunk of a longer row), rows per block, 16-byte vectors
  // per thread, whether a row longer than one block may use a cluster, and
  // (forward) whether clusters stay resident and walk the rows.
  m.def("_softmax_plan(Tensor x, int threads_per_row, int rows_per_block, int vectors_per_thread, bool cluster, "
        "bool persistent=False) -> Tensor");
  m.def("_softmax_backward_plan(Tensor grad, Tensor output, int threads_per_row, int rows_per_block, "
        "int vectors_per_thread, bool cluster) -> Tensor");
}

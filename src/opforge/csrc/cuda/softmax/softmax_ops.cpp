// CUDA entry points of the softmax family and their registration for the
// CUDA key: the argument checks and kernel arguments (softmax_host.h), the device guard,
// the dtype dispatch to the per-dtype launchers (launchers.h).
//
// Inner-most dim (rows contiguous). Every launch follows a plan (threads per
// row, rows per block, values per thread, how a long row is split; the
// defaults in default_request come from timing every plan on an H200 with
// bench/softmax_plans.py, which runs any plan through `opforge_bench.softmax_plan` /
// `softmax_backward_plan`):
//  * short rows: a warp, or a power-of-two slice of one, per row,
//    reductions by shuffles only, several rows per block;
//  * medium rows: a block per row, the row held in registers, so the input is
//    read once and the output written once; float16 and bfloat16 rows are
//    held as loaded, two values per register (kPacked), so a forward thread
//    holds 64 values in 32 registers and two 512-thread blocks fit on an
//    SM; 4- and 8-byte forward rows up to 512 threads x 64 registers of
//    values stay in one block per row;
//  * rows longer than a block, on Hopper and later: the row is split over a
//    cluster of up to 16 blocks, each holding its chunk in registers; the
//    blocks exchange their chunk's (max, sum of exp) through distributed
//    shared memory, so the input is still read once, in one launch; for
//    the float32 forward the clusters stay resident and walk the rows, each
//    block staging its chunk of the next row in shared memory while it
//    finishes the current one (fwd_resident_kernel); the float16 and
//    bfloat16 forward holds each chunk in shared memory instead of
//    registers (fwd_staged_kernel), the backward of clusters of more than 8
//    blocks holds y only and reads dy twice (bwd_cluster_kernel);
//  * longer rows still, or GPUs without clusters, with no cap: each row is
//    split into chunks of a block's capacity; pass 1 writes each chunk's
//    (max, sum of exp) to a small workspace, pass 2 combines a row's
//    partials and writes its chunk. Rows are processed in batches that fit
//    in half the L2 cache, so pass 2's re-read of the input is served by L2.
// Loads and stores are 16-byte vectors when K is a multiple of the vector
// width and the pointers are aligned, scalar otherwise; a thread issues all
// its loads before it uses any value. Row kernels are built to keep two
// 512-thread blocks per SM (64 registers) unless a thread holds 64 registers
// of values; none spills (ptxas -v).
//
// Outer dims (inner > 1): a thread per (outer, inner) column; consecutive
// threads read consecutive inner elements, so every pass is coalesced and no
// transpose copy is made. With too few columns to fill the GPU (fewer than
// 32768, and K >= 16) the dim is moved last instead (one copy each way).
//
// Current stream, device guard, launch check after every launch, no host
// synchronisation. Arithmetic in opmath (float for the half types).
//
// Files (this folder): config.h (constants, register budgets),
// device_math.cuh, cluster.cuh (cluster barrier and exchange), row_io.cuh,
// forward_rows.cuh, forward_cluster.cuh, backward_rows.cuh, columns.cuh
// (kernels); plan.h / softmax_plan.cpp (the planner, host only);
// occupancy.h / softmax_occupancy.cpp (cluster occupancy); launch*.cuh (launch
// templates); softmax_{fwd,bwd}_<dtype>.cu and softmax_columns.cu (one
// translation unit per dtype and direction, built in parallel).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <opforge/checks.h>
#include <opforge/dispatch.h>

#include <optional>
#include <utility>

#include "launchers.h"
#include "softmax_host.h"

namespace {

namespace sm = opforge::softmax;
namespace gpu = opforge::softmax::gpu;

template <sm::Mode MODE>
at::Tensor run_forward(sm::Prepared p, const gpu::PlanRequest* req = nullptr) {
  if (p.out.numel() == 0) return p.out;
  const c10::cuda::CUDAGuard guard(p.x.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(p.args.dtype, "opforge_softmax_cuda", [&] {
    if (p.args.inner > 1) {
      gpu::forward_columns<scalar_t>(MODE, p.args);
    } else {
      gpu::forward_rows<scalar_t>(MODE, p.args, p.x, req);
    }
  });
  return p.out;
}

template <sm::Mode MODE>
at::Tensor run_backward(sm::PreparedBwd p, const gpu::PlanRequest* req = nullptr) {
  if (p.grad_in.numel() == 0) return p.grad_in;
  const c10::cuda::CUDAGuard guard(p.out.device());
  OPFORGE_DISPATCH_FLOATING_TYPES(p.args.dtype, "opforge_softmax_backward_cuda", [&] {
    if (p.args.inner > 1) {
      gpu::backward_columns<scalar_t>(MODE, p.args);
    } else {
      gpu::backward_rows<scalar_t>(MODE, p.args, p.out, req);
    }
  });
  return p.grad_in;
}

// The `_plan` ops: softmax over the last dim with a given launch plan.
gpu::PlanRequest request_from(int64_t threads_per_row, int64_t rows_per_block, int64_t vectors_per_thread, bool cluster,
                              bool persistent = false) {
  auto small = [](int64_t v, const char* name) {
    TORCH_CHECK_VALUE(v >= 1 && v <= 512, "opforge softmax plan: ", name, " must be in [1, 512], got ",
                      opforge::num(v));
    return static_cast<int>(v);
  };
  return {small(threads_per_row, "threads_per_row"), small(rows_per_block, "rows_per_block"),
          small(vectors_per_thread, "vectors_per_thread"), cluster, persistent};
}

at::Tensor softmax_plan_cuda(const at::Tensor& x, int64_t threads_per_row, int64_t rows_per_block,
                             int64_t vectors_per_thread, bool cluster, bool persistent) {
  const gpu::PlanRequest r = request_from(threads_per_row, rows_per_block, vectors_per_thread, cluster, persistent);
  const int64_t d = sm::check_softmax_args("opforge_bench.softmax_plan", x, -1, std::nullopt);
  return run_forward<sm::Mode::Softmax>(sm::prepare_softmax(sm::Mode::Softmax, x, d, std::nullopt), &r);
}

at::Tensor softmax_backward_plan_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t threads_per_row,
                                      int64_t rows_per_block, int64_t vectors_per_thread, bool cluster) {
  const gpu::PlanRequest r = request_from(threads_per_row, rows_per_block, vectors_per_thread, cluster);
  const int64_t d = sm::check_backward_args("opforge_bench.softmax_backward_plan", grad, output, -1);
  return run_backward<sm::Mode::Softmax>(sm::prepare_backward(sm::Mode::Softmax, grad, output, d, 1.0), &r);
}

// Few columns over a reduced outer dim: a thread per column would leave
// most of the GPU idle, so the dim is moved last instead (one copy in, one
// copy out) and the row kernels run.
bool few_columns(const sm::FwdArgs& a) { return a.inner > 1 && a.K >= 16 && a.outer * a.inner < 32768; }
bool few_columns(const sm::BwdArgs& a) { return a.inner > 1 && a.K >= 16 && a.outer * a.inner < 32768; }

template <sm::Mode MODE>
at::Tensor softmax_family_cuda(const char* op, const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  const int64_t d = sm::check_softmax_args(op, x, dim, dtype);
  sm::Prepared p = sm::prepare_softmax(MODE, x, d, dtype);
  if (p.out.numel() > 0 && few_columns(p.args)) {
    const c10::cuda::CUDAGuard guard(p.x.device());
    const at::Tensor moved = p.x.movedim(d, -1);
    at::Tensor rows = run_forward<MODE>(sm::prepare_softmax(MODE, moved, moved.dim() - 1, std::nullopt));
    p.out.copy_(rows.movedim(-1, d));
    return p.out;
  }
  return run_forward<MODE>(std::move(p));
}

template <sm::Mode MODE>
at::Tensor softmax_family_backward_cuda(const char* op, const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  const int64_t d = sm::check_backward_args(op, grad, output, dim);
  sm::PreparedBwd p = sm::prepare_backward(MODE, grad, output, d, 1.0);
  if (p.grad_in.numel() > 0 && few_columns(p.args)) {
    const c10::cuda::CUDAGuard guard(p.out.device());
    const at::Tensor moved_out = p.out.movedim(d, -1);
    at::Tensor rows =
        run_backward<MODE>(sm::prepare_backward(MODE, p.grad.movedim(d, -1), moved_out, moved_out.dim() - 1, 1.0));
    p.grad_in.copy_(rows.movedim(-1, d));
    return p.grad_in;
  }
  return run_backward<MODE>(std::move(p));
}

at::Tensor softmax_cuda(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  return softmax_family_cuda<sm::Mode::Softmax>("opforge.softmax", x, dim, dtype);
}

at::Tensor log_softmax_cuda(const at::Tensor& x, int64_t dim, std::optional<c10::ScalarType> dtype) {
  return softmax_family_cuda<sm::Mode::LogSoftmax>("opforge.log_softmax", x, dim, dtype);
}

at::Tensor scaled_masked_softmax_cuda(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                                      bool causal) {
  sm::check_scaled_masked_args("opforge.scaled_masked_softmax", x, mask);
  return run_forward<sm::Mode::ScaledMasked>(sm::prepare_scaled_masked(x, mask, scale, causal));
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  return softmax_family_backward_cuda<sm::Mode::Softmax>("opforge._softmax_backward", grad, output, dim);
}

at::Tensor log_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, int64_t dim) {
  return softmax_family_backward_cuda<sm::Mode::LogSoftmax>("opforge._log_softmax_backward", grad, output, dim);
}

at::Tensor scaled_masked_softmax_backward_cuda(const at::Tensor& grad, const at::Tensor& output, double scale) {
  const int64_t d = sm::check_backward_args("opforge._scaled_masked_softmax_backward", grad, output, -1);
  return run_backward<sm::Mode::ScaledMasked>(sm::prepare_backward(sm::Mode::ScaledMasked, grad, output, d, scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("softmax", &softmax_cuda);
  m.impl("log_softmax", &log_softmax_cuda);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_cuda);
  m.impl("_softmax_backward", &softmax_backward_cuda);
  m.impl("_log_softmax_backward", &log_softmax_backward_cuda);
  m.impl("_scaled_masked_softmax_backward", &scaled_masked_softmax_backward_cuda);
}

TORCH_LIBRARY_IMPL(opforge_bench, CUDA, m) {
  m.impl("softmax_plan", &softmax_plan_cuda);
  m.impl("softmax_backward_plan", &softmax_backward_plan_cuda);
}

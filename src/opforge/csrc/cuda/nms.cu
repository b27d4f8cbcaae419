// CUDA kernels of the NMS family (nms, batched_nms, nms_padded).
//
// Everything stays on the GPU; `nms` and `batched_nms` read one number (the
// kept count, for the output's size) back to the host, `nms_padded` none.
//
// 1. One stable sort by score, descending (ties: lower index first). With
//    score_threshold, boxes with score <= threshold stay in the arrays but
//    start out suppressed, so no size depends on the data.
// 2. batched_nms: a stable sort of the classes in that order groups each
//    class into one contiguous segment, still in score order.
// 3. IoU bitmask in 64 x 64 tiles: bit k of word (i, c) says box i (sorted
//    position) suppresses box 64c + k. Only tiles on or above the diagonal
//    are computed, and for batched_nms only tiles whose class ranges overlap,
//    so the work follows the per-class sizes.
// 4. Sweep on the GPU: one block walks the column blocks in order. For block
//    b, one thread resolves the 64 boxes against each other (the diagonal
//    words, in shared memory) given `removed[b]`; then all threads OR the
//    kept rows into `removed[c]` for the later blocks of the same class.
// 5. The mask is never materialised whole: rows are processed in chunks of
//    at most kMaskBudgetWords words (512 MiB), so 1M boxes need no N^2/64
//    words. A chunk's rows see columns from the chunk's start to the end.
//    Once max_output boxes are kept (plain nms), later chunks do nothing.
// 6. Compaction: kept flags in output order, an inclusive scan, a scatter
//    into an output pre-filled with -1, and the count as a 0-d tensor.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include <opforge/cuda_launch.cuh>

#include "nms.h"

namespace {

using u64 = unsigned long long;
constexpr int kTile = 64;
constexpr int kSweepThreads = 1024;
constexpr int64_t kMaskBudgetWords = int64_t(1) << 26;  // 512 MiB of mask per chunk

// IEEE operations that the compiler may not fuse into FMAs, so the IoU is
// bit for bit the CPU kernel's (and torchvision's CPU formula).
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// std::max / std::min (exact; NaN cases never suppress either way).
template <typename T>
__device__ __forceinline__ T max_(T a, T b) {
  return a < b ? b : a;
}
template <typename T>
__device__ __forceinline__ T min_(T a, T b) {
  return b < a ? b : a;
}

template <typename T>
__device__ __forceinline__ T box_area(T x1, T y1, T x2, T y2) {
  return mul_rn(sub_rn(x2, x1), sub_rn(y2, y1));
}

// IoU(i, j) > thr with torchvision's formula and order of operations.
template <typename T>
__device__ __forceinline__ bool iou_above(T ix1, T iy1, T ix2, T iy2, T iarea, T jx1, T jy1, T jx2, T jy2, T jarea,
                                          T thr) {
  const T w = max_(sub_rn(min_(ix2, jx2), max_(ix1, jx1)), T(0));
  const T h = max_(sub_rn(min_(iy2, jy2), max_(iy1, jy1)), T(0));
  const T inter = mul_rn(w, h);
  if (!(inter > T(0)) && thr >= T(0)) return false;  // 0 / u (0, -0 or NaN) never exceeds a threshold >= 0
  return div_rn(inter, sub_rn(add_rn(iarea, jarea), inter)) > thr;
}

// removed[b]: bit r set when position 64b + r is past the end or was
// dropped by score_threshold (valid may be null); keep_bits and the kept
// count start at zero.
__global__ void init_kernel(const bool* __restrict__ valid, int64_t n, int64_t nb, u64* __restrict__ removed,
                            u64* __restrict__ keep_bits, int64_t* __restrict__ count) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *count = 0;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nb; b += int64_t(gridDim.x) * blockDim.x) {
    keep_bits[b] = 0;
    u64 w = 0;
    for (int r = 0; r < kTile; ++r) {
      const int64_t p = b * kTile + r;
      if (p >= n || (valid != nullptr && !valid[p])) w |= u64(1) << r;
    }
    removed[b] = w;
  }
}

// end_block[b]: the column block holding the last box of the class of block
// b's last box (classes sorted ascending).
__global__ void end_block_kernel(const int64_t* __restrict__ cls, int64_t n, int64_t nb,
                                 int64_t* __restrict__ end_block) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nb; b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t last = min(b * kTile + kTile - 1, n - 1);
    const int64_t c = cls[last];
    int64_t lo = last, hi = n - 1;  // cls[lo] == c; find the last position with cls == c
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (cls[mid] == c)
        lo = mid;
      else
        hi = mid - 1;
    }
    end_block[b] = lo / kTile;
  }
}

// One 64 x 64 tile: row block cb0 + blockIdx.y against column block
// cb0 + blockIdx.x. mask rows are local to the chunk (row - 64 * cb0),
// columns too (c - cb0), with `stride` = nb - cb0 words per row.
template <typename T>
__global__ void __launch_bounds__(kTile)
    mask_kernel(const T* __restrict__ boxes, const int64_t* __restrict__ cls, int64_t n, int64_t nb, int64_t cb0, T thr,
                const int64_t* __restrict__ count, int64_t max_keep, u64* __restrict__ mask) {
  const int64_t rb = cb0 + blockIdx.y;
  const int64_t cb = cb0 + blockIdx.x;
  if (cb < rb) return;
  // max_output already reached by the earlier chunks: nothing will be read.
  if (*count >= max_keep) return;
  const int64_t row0 = rb * kTile;
  const int64_t col0 = cb * kTile;
  const int rows = static_cast<int>(min(int64_t(kTile), n - row0));
  const int cols = static_cast<int>(min(int64_t(kTile), n - col0));
  // Sorted by class and cb >= rb: the tile matters only if the column
  // block starts at or below the row block's last class.
  if (cls != nullptr && cls[col0] > cls[row0 + rows - 1]) return;

  __shared__ T s_box[kTile][5];
  __shared__ int64_t s_cls[kTile];
  const int t = threadIdx.x;
  if (t < cols) {
    const T* bx = boxes + (col0 + t) * 4;
    const T x1 = bx[0], y1 = bx[1], x2 = bx[2], y2 = bx[3];
    s_box[t][0] = x1;
    s_box[t][1] = y1;
    s_box[t][2] = x2;
    s_box[t][3] = y2;
    s_box[t][4] = box_area(x1, y1, x2, y2);
    s_cls[t] = cls != nullptr ? cls[col0 + t] : 0;
  }
  __syncthreads();
  if (t >= rows) return;
  const int64_t i = row0 + t;
  const T* bi = boxes + i * 4;
  const T ix1 = bi[0], iy1 = bi[1], ix2 = bi[2], iy2 = bi[3];
  const T iarea = box_area(ix1, iy1, ix2, iy2);
  const int64_t ic = cls != nullptr ? cls[i] : 0;
  u64 bits = 0;
  for (int k = (cb == rb) ? t + 1 : 0; k < cols; ++k) {
    if (s_cls[k] == ic &&
        iou_above<T>(ix1, iy1, ix2, iy2, iarea, s_box[k][0], s_box[k][1], s_box[k][2], s_box[k][3], s_box[k][4], thr)) {
      bits |= u64(1) << k;
    }
  }
  mask[(i - cb0 * kTile) * (nb - cb0) + (cb - cb0)] = bits;
}

// The sweep over column blocks [cb0, cb1) of one chunk (one thread block).
// `count` carries the number kept so far between chunks; once it reaches
// max_keep nothing more is kept.
__global__ void __launch_bounds__(kSweepThreads)
    sweep_kernel(const u64* __restrict__ mask, const int64_t* __restrict__ end_block, int64_t nb, int64_t cb0,
                 int64_t cb1, int64_t max_keep, u64* __restrict__ removed, u64* __restrict__ keep_bits,
                 int64_t* __restrict__ count) {
  __shared__ u64 s_diag[kTile];
  __shared__ int s_rows[kTile];
  __shared__ int s_nrows;
  __shared__ int s_stop;
  __shared__ int64_t s_count;
  const int64_t stride = nb - cb0;
  if (threadIdx.x == 0) {
    s_count = *count;
    s_stop = s_count >= max_keep;
  }
  __syncthreads();
  for (int64_t b = cb0; b < cb1 && !s_stop; ++b) {
    const int64_t r0 = (b - cb0) * kTile;  // first local mask row of block b
    if (threadIdx.x < kTile) s_diag[threadIdx.x] = mask[(r0 + threadIdx.x) * stride + (b - cb0)];
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 rem = removed[b];
      u64 kept = 0;
      int nr = 0;
      int64_t c = s_count;
      // Visit only the boxes still live, lowest position first.
      u64 live = ~rem;
      while (live != 0 && c < max_keep) {
        const int r = __ffsll(static_cast<long long>(live)) - 1;
        kept |= u64(1) << r;
        s_rows[nr++] = r;
        rem |= s_diag[r];
        ++c;
        live = r == kTile - 1 ? 0 : ~rem & (~u64(0) << (r + 1));
      }
      keep_bits[b] = kept;
      s_nrows = nr;
      s_count = c;
      s_stop = c >= max_keep;
    }
    __syncthreads();
    const int nr = s_nrows;
    if (nr > 0 && !s_stop) {
      const int64_t cend = end_block != nullptr ? end_block[b] : nb - 1;
      for (int64_t c = b + 1 + threadIdx.x; c <= cend; c += kSweepThreads) {
        const u64 rem = removed[c];
        if (rem == ~u64(0)) continue;
        u64 acc = 0;
        for (int k = 0; k < nr; ++k) acc |= mask[(r0 + s_rows[k]) * stride + (c - cb0)];
        removed[c] = rem | acc;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = s_count;
}

// flags[perm ? perm[p] : p] = kept bit of sorted position p.
__global__ void flags_kernel(const u64* __restrict__ keep_bits, const int64_t* __restrict__ perm, int64_t n,
                             int64_t* __restrict__ flags) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bit = static_cast<int64_t>((keep_bits[p / kTile] >> (p % kTile)) & 1);
    flags[perm != nullptr ? perm[p] : p] = bit;
  }
}

// out[scan[k] - 1] = ord[k] for kept k whose rank is below `limit`.
__global__ void scatter_kernel(const int64_t* __restrict__ flags, const int64_t* __restrict__ scan,
                               const int64_t* __restrict__ ord, int64_t n, int64_t limit, int64_t* __restrict__ out,
                               int64_t* __restrict__ count) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    if (flags[k]) {
      const int64_t pos = scan[k] - 1;
      if (pos < limit) out[pos] = ord[k];
    }
    if (k == n - 1) *count = min(scan[k], limit);
  }
}

// Runs steps 1-6; returns (out of length `out_len` padded with -1, count).
std::tuple<at::Tensor, at::Tensor> nms_cuda_impl(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                                                 const std::optional<at::Tensor>& idxs, double iou_threshold,
                                                 std::optional<double> score_threshold,
                                                 std::optional<int64_t> max_output, int64_t out_len) {
  const c10::cuda::CUDAGuard guard(boxes.device());
  const auto long_opts = boxes.options().dtype(at::kLong);
  const int64_t n = boxes.size(0);
  const int64_t limit = max_output.value_or(std::numeric_limits<int64_t>::max());
  at::Tensor out = at::full({out_len}, -1, long_opts);
  if (n == 0 || out_len == 0) return {out, at::zeros({}, long_opts)};
  at::Tensor count = at::empty({}, long_opts);  // written by scatter_kernel
  auto stream = at::cuda::getCurrentCUDAStream();

  // 1. score order, and the boxes that pass score_threshold.
  auto sorted = scores.sort(/*stable=*/true, 0, /*descending=*/true);
  const at::Tensor ord = std::get<1>(sorted);
  at::Tensor valid;
  if (score_threshold.has_value()) valid = std::get<0>(sorted).to(at::kDouble).gt(*score_threshold);

  // 2. per-class segments.
  at::Tensor perm, cls_sorted, box_order = ord;
  if (idxs.has_value()) {
    auto by_class = idxs->index_select(0, ord).to(at::kLong).sort(/*stable=*/true, 0, /*descending=*/false);
    cls_sorted = std::get<0>(by_class).contiguous();
    perm = std::get<1>(by_class);
    box_order = ord.index_select(0, perm);
    if (valid.defined()) valid = valid.index_select(0, perm);
  }
  if (valid.defined()) valid = valid.contiguous();

  const int64_t nb = (n + kTile - 1) / kTile;
  // One buffer: removed words, kept words, kept count (set by init_kernel).
  at::Tensor state = at::empty({2 * nb + 1}, long_opts);
  auto* removed_p = reinterpret_cast<u64*>(state.data_ptr<int64_t>());
  auto* keep_p = removed_p + nb;
  int64_t* kept_count_p = state.data_ptr<int64_t>() + 2 * nb;
  init_kernel<<<opforge::cuda::grid_for(nb, 256), 256, 0, stream>>>(valid.defined() ? valid.data_ptr<bool>() : nullptr,
                                                                    n, nb, removed_p, keep_p, kept_count_p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor end_block;
  if (cls_sorted.defined()) {
    end_block = at::empty({nb}, long_opts);
    end_block_kernel<<<opforge::cuda::grid_for(nb, 256), 256, 0, stream>>>(cls_sorted.data_ptr<int64_t>(), n, nb,
                                                                           end_block.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // 3-5. mask chunk by chunk, each followed by its sweep.
  const bool as_double = boxes.scalar_type() == at::kDouble;
  const at::Tensor sorted_boxes =
      boxes.index_select(0, box_order).to(as_double ? at::kDouble : at::kFloat).contiguous();
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>({nb, kMaskBudgetWords / (kTile * nb), 65535}));
  at::Tensor mask = at::empty({chunk * kTile * nb}, long_opts);
  auto* mask_p = reinterpret_cast<u64*>(mask.data_ptr<int64_t>());
  // Only batched_nms's output order differs from the sweep's: stop early
  // at max_output only for plain nms.
  const int64_t max_keep = idxs.has_value() ? std::numeric_limits<int64_t>::max() : limit;
  const int64_t* cls_p = cls_sorted.defined() ? cls_sorted.data_ptr<int64_t>() : nullptr;
  const int64_t* end_p = end_block.defined() ? end_block.data_ptr<int64_t>() : nullptr;
  const double thr_f64 = opforge::nms::threshold_for<double>(iou_threshold);
  const float thr_f32 = opforge::nms::threshold_for<float>(iou_threshold);
  for (int64_t cb0 = 0; cb0 < nb; cb0 += chunk) {
    const int64_t cb1 = std::min(cb0 + chunk, nb);
    const dim3 grid(static_cast<unsigned>(nb - cb0), static_cast<unsigned>(cb1 - cb0));
    if (as_double) {
      mask_kernel<double><<<grid, kTile, 0, stream>>>(sorted_boxes.data_ptr<double>(), cls_p, n, nb, cb0, thr_f64,
                                                      kept_count_p, max_keep, mask_p);
    } else {
      mask_kernel<float><<<grid, kTile, 0, stream>>>(sorted_boxes.data_ptr<float>(), cls_p, n, nb, cb0, thr_f32,
                                                     kept_count_p, max_keep, mask_p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sweep_kernel<<<1, kSweepThreads, 0, stream>>>(mask_p, end_p, nb, cb0, cb1, max_keep, removed_p, keep_p,
                                                  kept_count_p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // 6. kept flags in score order, scan, scatter.
  at::Tensor flags = at::empty({n}, long_opts);
  const int64_t* perm_p = perm.defined() ? perm.data_ptr<int64_t>() : nullptr;
  flags_kernel<<<opforge::cuda::grid_for(n, 256), 256, 0, stream>>>(keep_p, perm_p, n, flags.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor scan = at::cumsum(flags, 0);
  scatter_kernel<<<opforge::cuda::grid_for(n, 256), 256, 0, stream>>>(
      flags.data_ptr<int64_t>(), scan.data_ptr<int64_t>(), ord.data_ptr<int64_t>(), n, std::min(limit, out_len),
      out.data_ptr<int64_t>(), count.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, count};
}

at::Tensor nms_sized(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                     const std::optional<at::Tensor>& idxs, double iou_threshold, std::optional<double> score_threshold,
                     std::optional<int64_t> max_output) {
  opforge::nms::check_args(op, boxes, scores, idxs, score_threshold, max_output);
  const int64_t out_len = std::min(boxes.size(0), max_output.value_or(std::numeric_limits<int64_t>::max()));
  auto [out, count] = nms_cuda_impl(op, boxes, scores, idxs, iou_threshold, score_threshold, max_output, out_len);
  // The one host synchronisation: the output's size depends on the data.
  const int64_t k = count.item<int64_t>();
  return out.narrow(0, 0, k);
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                    std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  return nms_sized("opforge.nms", boxes, scores, std::nullopt, iou_threshold, score_threshold, max_output);
}

at::Tensor batched_nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                            double iou_threshold, std::optional<double> score_threshold,
                            std::optional<int64_t> max_output) {
  return nms_sized("opforge.batched_nms", boxes, scores, idxs, iou_threshold, score_threshold, max_output);
}

std::tuple<at::Tensor, at::Tensor> nms_padded_cuda(const at::Tensor& boxes, const at::Tensor& scores,
                                                   double iou_threshold, int64_t max_output,
                                                   const std::optional<at::Tensor>& idxs,
                                                   std::optional<double> score_threshold) {
  opforge::nms::check_padded_args(boxes, scores, idxs, score_threshold, max_output);
  return nms_cuda_impl("opforge.nms_padded", boxes, scores, idxs, iou_threshold, score_threshold, max_output,
                       max_output);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("nms", &nms_cuda);
  m.impl("batched_nms", &batched_nms_cuda);
  m.impl("nms_padded", &nms_padded_cuda);
}

// CPU entry points of the NMS family (nms, batched_nms, nms_padded).
//
// 1. Candidates: every box, or those with score > score_threshold.
// 2. One stable sort by score, descending (ties: lower index first; NaN
//    scores first, as torch.sort orders them).
// 3. batched_nms: a stable sort of the classes in that order splits the
//    boxes into per-class segments, each still in score order.
// 4. Boxes gathered once into structure-of-arrays x1, y1, x2, y2, area in
//    float32 (float64 for float64 boxes).
// 5. Per segment, a blocked sweep: within a block of 256 boxes the kept ones
//    are found in order, then all of them suppress the rest of the segment in
//    one vectorised pass (cpu/nms_kernels.h), split over threads. Suppressed
//    boxes are skipped, so the work is O(kept * N), not O(N^2).
//    Segments (classes) run in parallel.
// 6. Kept boxes are returned in score order (the global one for batched_nms).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include <opforge/cpu_isa.h>

#include "nms_common.h"

OPFORGE_CPU_DECLARE(void, nms_suppress_f32, const float*, const float*, const float*, const float*, const float*,
                    const int64_t*, int64_t, int64_t, int64_t, float, uint8_t*)
OPFORGE_CPU_DECLARE(void, nms_suppress_f64, const double*, const double*, const double*, const double*,
                    const double*, const int64_t*, int64_t, int64_t, int64_t, double, uint8_t*)

namespace {

constexpr int64_t kBlock = 256;

template <typename T>
using SuppressFn = void (*)(const T*, const T*, const T*, const T*, const T*, const int64_t*, int64_t, int64_t,
                            int64_t, T, uint8_t*);

template <typename T>
SuppressFn<T> pick_suppress() {
  if constexpr (std::is_same_v<T, float>) {
    return OPFORGE_CPU_SELECT(nms_suppress_f32);
  } else {
    return OPFORGE_CPU_SELECT(nms_suppress_f64);
  }
}

template <typename T>
struct Soa {
  const T* x1;
  const T* y1;
  const T* x2;
  const T* y2;
  const T* area;
};

// Sweeps positions [s, e) of one segment; marks keep[p] = 1 for kept boxes.
// Stops after `max_keep` kept boxes. `parallel`: split the long passes.
template <typename T>
void sweep(const Soa<T>& b, int64_t s, int64_t e, T thr, int64_t max_keep, bool parallel, uint8_t* removed,
           uint8_t* keep) {
  const auto fn = pick_suppress<T>();
  std::vector<int64_t> rows;
  rows.reserve(kBlock);
  int64_t count = 0;
  for (int64_t b0 = s; b0 < e; b0 += kBlock) {
    const int64_t b1 = std::min(b0 + kBlock, e);
    rows.clear();
    for (int64_t i = b0; i < b1; ++i) {
      if (removed[i]) continue;
      keep[i] = 1;
      if (++count >= max_keep) return;
      rows.push_back(i);
      fn(b.x1, b.y1, b.x2, b.y2, b.area, &i, 1, i + 1, b1, thr, removed);
    }
    if (rows.empty() || b1 == e) continue;
    const auto nr = static_cast<int64_t>(rows.size());
    // Each thread takes at least ~64k IoUs: below that a fork costs more.
    const int64_t grain = std::max<int64_t>(256, (int64_t(1) << 16) / nr);
    if (parallel && (e - b1) > grain) {
      at::parallel_for(b1, e, grain, [&](int64_t lo, int64_t hi) {
        fn(b.x1, b.y1, b.x2, b.y2, b.area, rows.data(), nr, lo, hi, thr, removed);
      });
    } else {
      fn(b.x1, b.y1, b.x2, b.y2, b.area, rows.data(), nr, b1, e, thr, removed);
    }
  }
}

// Kept original indices in score order, at most `max_output` of them.
at::Tensor nms_kept_cpu(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                        const std::optional<at::Tensor>& idxs, double iou_threshold,
                        std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  opforge::nms::check_args(op, boxes, scores, idxs, iou_threshold, score_threshold, max_output);
  const auto long_opts = boxes.options().dtype(at::kLong);
  const int64_t limit = max_output.value_or(std::numeric_limits<int64_t>::max());
  if (boxes.size(0) == 0 || limit == 0) return at::empty({0}, long_opts);

  // 1-2. candidates in score order (original indices).
  at::Tensor cand;
  at::Tensor cand_scores;
  if (score_threshold.has_value()) {
    // Compared exactly: every float converts to float64 without rounding.
    cand = at::nonzero(scores.to(at::kDouble).gt(*score_threshold)).view({-1});
    cand_scores = scores.index_select(0, cand);
  } else {
    cand = at::arange(boxes.size(0), long_opts);
    cand_scores = scores;
  }
  const int64_t n = cand.size(0);
  if (n == 0) return at::empty({0}, long_opts);
  const at::Tensor ord = cand.index_select(0, std::get<1>(cand_scores.sort(/*stable=*/true, 0, /*descending=*/true)));

  // 3. per-class segments, each in score order.
  std::vector<int64_t> seg{0, n};
  at::Tensor perm;  // positions into `ord`, grouped by class (batched only)
  at::Tensor box_order = ord;
  if (idxs.has_value()) {
    const at::Tensor cls = idxs->index_select(0, ord).to(at::kLong);
    auto sorted = cls.sort(/*stable=*/true, 0, /*descending=*/false);
    perm = std::get<1>(sorted);
    box_order = ord.index_select(0, perm);
    const at::Tensor cls_sorted = std::get<0>(sorted).contiguous();
    const int64_t* c = cls_sorted.data_ptr<int64_t>();
    seg.assign(1, 0);
    for (int64_t p = 1; p < n; ++p) {
      if (c[p] != c[p - 1]) seg.push_back(p);
    }
    seg.push_back(n);
  }
  const auto nseg = static_cast<int64_t>(seg.size()) - 1;

  // 4-5.
  const bool as_double = boxes.scalar_type() == at::kDouble;
  const at::Tensor soa = boxes.index_select(0, box_order).to(as_double ? at::kDouble : at::kFloat).t().contiguous();
  at::Tensor keep = at::zeros({n}, long_opts.dtype(at::kByte));
  {
    std::vector<uint8_t> removed(static_cast<size_t>(n), 0);
    uint8_t* keep_p = keep.data_ptr<uint8_t>();
    AT_DISPATCH_FLOATING_TYPES(soa.scalar_type(), "opforge_nms_cpu", [&] {
      const scalar_t* d = soa.data_ptr<scalar_t>();
      std::vector<scalar_t> area(static_cast<size_t>(n));
      at::parallel_for(0, n, 1 << 14, [&](int64_t lo, int64_t hi) {
        for (int64_t p = lo; p < hi; ++p) area[p] = (d[2 * n + p] - d[p]) * (d[3 * n + p] - d[n + p]);
      });
      const Soa<scalar_t> b{d, d + n, d + 2 * n, d + 3 * n, area.data()};
      const scalar_t thr = opforge::nms::threshold_for<scalar_t>(iou_threshold);
      if (nseg == 1) {
        sweep<scalar_t>(b, 0, n, thr, limit, /*parallel=*/true, removed.data(), keep_p);
      } else {
        // Classes in parallel; the output is cut to max_output afterwards, in
        // global score order.
        at::parallel_for(0, nseg, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t g = lo; g < hi; ++g) {
            sweep<scalar_t>(b, seg[g], seg[g + 1], thr, std::numeric_limits<int64_t>::max(), false,
                            removed.data(), keep_p);
          }
        });
      }
    });
  }

  // 6. back to score order.
  if (perm.defined()) {
    at::Tensor keep_scored = at::zeros({n}, keep.options());
    keep_scored.index_put_({perm}, keep);
    keep = keep_scored;
  }
  at::Tensor kept = ord.index_select(0, at::nonzero(keep).view({-1}));
  if (kept.size(0) > limit) kept = kept.narrow(0, 0, limit);
  return kept;
}

at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                   std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  return nms_kept_cpu("opforge.nms", boxes, scores, std::nullopt, iou_threshold, score_threshold, max_output);
}

at::Tensor batched_nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                           double iou_threshold, std::optional<double> score_threshold,
                           std::optional<int64_t> max_output) {
  return nms_kept_cpu("opforge.batched_nms", boxes, scores, idxs, iou_threshold, score_threshold, max_output);
}

std::tuple<at::Tensor, at::Tensor> nms_padded_cpu(const at::Tensor& boxes, const at::Tensor& scores,
                                                  double iou_threshold, int64_t max_output,
                                                  const std::optional<at::Tensor>& idxs,
                                                  std::optional<double> score_threshold) {
  const at::Tensor kept =
      nms_kept_cpu("opforge.nms_padded", boxes, scores, idxs, iou_threshold, score_threshold, max_output);
  const auto long_opts = boxes.options().dtype(at::kLong);
  at::Tensor out = at::full({max_output}, -1, long_opts);
  out.narrow(0, 0, kept.size(0)).copy_(kept);
  return {out, at::scalar_tensor(kept.size(0), long_opts)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("nms", &nms_cpu);
  m.impl("batched_nms", &batched_nms_cpu);
  m.impl("nms_padded", &nms_padded_cpu);
}

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
//    Small segments (classes) run in parallel, large ones each in parallel.
// 6. Kept boxes are returned in score order (the global one for batched_nms).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <opforge/cpu_isa.h>

#include "nms.h"

OPFORGE_CPU_DECLARE(void, nms_suppress_f32, const float*, const float*, const float*, const float*, const float*,
                    const int64_t*, int64_t, int64_t, int64_t, float, uint8_t*)
OPFORGE_CPU_DECLARE(void, nms_suppress_f64, const double*, const double*, const double*, const double*, const double*,
                    const int64_t*, int64_t, int64_t, int64_t, double, uint8_t*)

namespace {

constexpr int64_t kBlock = 256;

template <typename T>
using SuppressFn = void (*)(const T*, const T*, const T*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t,
                            T, uint8_t*);

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

// Scores as float64 (exact for every float dtype), read through strides.
std::vector<double> scores_as_double(const at::Tensor& scores) {
  std::vector<double> out(static_cast<size_t>(scores.size(0)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "opforge_nms_scores", [&] {
    const auto acc = scores.accessor<scalar_t, 1>();
    for (int64_t i = 0; i < scores.size(0); ++i) out[i] = static_cast<double>(acc[i]);
  });
  return out;
}

// Kept original indices in score order, at most `max_output` of them.
// Plain loops rather than ATen calls: at these sizes each ATen op costs more
// in dispatch and threading than the work it does.
at::Tensor nms_kept_cpu(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                        const std::optional<at::Tensor>& idxs, double iou_threshold,
                        std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  opforge::nms::check_args(op, boxes, scores, idxs, iou_threshold, score_threshold, max_output);
  const auto long_opts = boxes.options().dtype(at::kLong);
  const int64_t limit = max_output.value_or(std::numeric_limits<int64_t>::max());
  if (boxes.size(0) == 0 || limit == 0) return at::empty({0}, long_opts);

  // 1-2. candidates in score order (original indices): a stable sort,
  // descending, NaN first (as torch.sort).
  const std::vector<double> sc = scores_as_double(scores);
  std::vector<int64_t> ord;
  ord.reserve(sc.size());
  for (int64_t i = 0; i < static_cast<int64_t>(sc.size()); ++i) {
    if (!score_threshold.has_value() || sc[i] > *score_threshold) ord.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(ord.size());
  if (n == 0) return at::empty({0}, long_opts);
  std::stable_sort(ord.begin(), ord.end(), [&](int64_t a, int64_t b) {
    const bool na = std::isnan(sc[a]), nb = std::isnan(sc[b]);
    return na != nb ? na : (!na && sc[a] > sc[b]);
  });

  // 3. per-class segments, each in score order: `perm` (positions into ord)
  // grouped by class.
  std::vector<int64_t> seg{0, n};
  std::vector<int64_t> perm;
  if (idxs.has_value()) {
    const at::Tensor cls_t = idxs->to(at::kLong);
    const auto cls = cls_t.accessor<int64_t, 1>();
    perm.resize(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) perm[p] = p;
    std::stable_sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return cls[ord[a]] < cls[ord[b]]; });
    seg.assign(1, 0);
    for (int64_t p = 1; p < n; ++p) {
      if (cls[ord[perm[p]]] != cls[ord[perm[p - 1]]]) seg.push_back(p);
    }
    seg.push_back(n);
  }
  const auto nseg = static_cast<int64_t>(seg.size()) - 1;
  auto box_at = [&](int64_t p) { return perm.empty() ? ord[p] : ord[perm[p]]; };

  // 4-5.
  std::vector<uint8_t> removed(static_cast<size_t>(n), 0);
  std::vector<uint8_t> keep(static_cast<size_t>(n), 0);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    std::vector<T> soa(static_cast<size_t>(5 * n));
    T* d = soa.data();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "opforge_nms_gather", [&] {
      const auto acc = boxes.accessor<scalar_t, 2>();
      for (int64_t p = 0; p < n; ++p) {
        const int64_t i = box_at(p);
        const T x1 = static_cast<T>(acc[i][0]), y1 = static_cast<T>(acc[i][1]);
        const T x2 = static_cast<T>(acc[i][2]), y2 = static_cast<T>(acc[i][3]);
        d[p] = x1;
        d[n + p] = y1;
        d[2 * n + p] = x2;
        d[3 * n + p] = y2;
        d[4 * n + p] = (x2 - x1) * (y2 - y1);
      }
    });
    const Soa<T> b{d, d + n, d + 2 * n, d + 3 * n, d + 4 * n};
    const T thr = opforge::nms::threshold_for<T>(iou_threshold);
    if (nseg == 1) {
      sweep<T>(b, 0, n, thr, limit, /*parallel=*/true, removed.data(), keep.data());
    } else {
      // Small classes in parallel, large ones one after another with the
      // parallel sweep. The output is cut to max_output afterwards, in global
      // score order.
      constexpr int64_t kLarge = 8 * kBlock;
      const int64_t all = std::numeric_limits<int64_t>::max();
      at::parallel_for(0, nseg, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t g = lo; g < hi; ++g) {
          if (seg[g + 1] - seg[g] <= kLarge) {
            sweep<T>(b, seg[g], seg[g + 1], thr, all, false, removed.data(), keep.data());
          }
        }
      });
      for (int64_t g = 0; g < nseg; ++g) {
        if (seg[g + 1] - seg[g] > kLarge) {
          sweep<T>(b, seg[g], seg[g + 1], thr, all, true, removed.data(), keep.data());
        }
      }
    }
  };
  if (boxes.scalar_type() == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }

  // 6. back to score order.
  if (!perm.empty()) {
    std::vector<uint8_t> by_score(static_cast<size_t>(n), 0);
    for (int64_t p = 0; p < n; ++p) by_score[perm[p]] = keep[p];
    keep.swap(by_score);
  }
  int64_t k = 0;
  for (int64_t p = 0; p < n; ++p) k += keep[p];
  k = std::min(k, limit);
  at::Tensor kept = at::empty({k}, long_opts);
  int64_t* out = kept.data_ptr<int64_t>();
  for (int64_t p = 0, j = 0; p < n && j < k; ++p) {
    if (keep[p]) out[j++] = ord[p];
  }
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
  opforge::nms::check_padded_args("opforge.nms_padded", boxes, scores, idxs, iou_threshold, score_threshold,
                                  max_output);
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

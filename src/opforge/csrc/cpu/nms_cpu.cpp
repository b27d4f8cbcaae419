// CPU entry points of the NMS family (nms, batched_nms, nms_padded).
//
// 1. Candidates: every box, or those with score > score_threshold.
// 2. One sort by score, descending (ties: lower index first, so the order
//    is a stable sort's; NaN scores first, as torch.sort orders them).
// 3. batched_nms: a sort by class (ties: score order) splits the boxes into
//    per-class segments, each still in score order.
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
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <opforge/cpu_isa.h>

#include "nms.h"

OPFORGE_CPU_DECLARE(void, nms_suppress_f32, const float*, const float*, const float*, const float*, const float*,
                    const int64_t*, int64_t, int64_t, int64_t, float, uint8_t*)
OPFORGE_CPU_DECLARE(void, nms_suppress_f64, const double*, const double*, const double*, const double*, const double*,
                    const int64_t*, int64_t, int64_t, int64_t, double, uint8_t*)

namespace {

constexpr int64_t kBlock = 256;

// Work arrays live on the stack up to this many boxes: a small call then
// allocates nothing but its output (heap allocations cost more there than
// the sweep).
constexpr unsigned kSmall = 64;
template <typename T, unsigned N = kSmall>
using Buf = c10::SmallVector<T, N>;

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
  Buf<int64_t, kBlock> rows;
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
Buf<double> scores_as_double(const at::Tensor& scores) {
  Buf<double> out(static_cast<size_t>(scores.size(0)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "opforge_nms_scores", [&] {
    const auto acc = scores.accessor<scalar_t, 1>();
    for (int64_t i = 0; i < scores.size(0); ++i) out[i] = static_cast<double>(acc[i]);
  });
  return out;
}

// The sweep's result: candidate boxes (original indices) in score order,
// which of them are kept, and how many (at most the limit).
struct Kept {
  Buf<int64_t> ord;
  Buf<uint8_t> keep;
  int64_t count = 0;

  // The kept original indices in score order; `out` holds `count` entries.
  void write(int64_t* out) const {
    for (size_t p = 0, j = 0; p < ord.size() && static_cast<int64_t>(j) < count; ++p) {
      if (keep[p]) out[j++] = ord[p];
    }
  }
};

// Class ids as int64, read through strides (int64 or int32, checked).
Buf<int64_t> classes_of(const at::Tensor& idxs) {
  Buf<int64_t> out(static_cast<size_t>(idxs.size(0)));
  AT_DISPATCH_INDEX_TYPES(idxs.scalar_type(), "opforge_nms_idxs", [&] {
    const auto acc = idxs.accessor<index_t, 1>();
    for (int64_t i = 0; i < idxs.size(0); ++i) out[i] = static_cast<int64_t>(acc[i]);
  });
  return out;
}

// Steps 1-5 on checked arguments, stopping at `limit` kept boxes. Plain
// loops rather than ATen calls: at small sizes each ATen op costs more in
// dispatch and threading than the work it does.
Kept nms_kept_cpu(const at::Tensor& boxes, const at::Tensor& scores, const std::optional<at::Tensor>& idxs,
                  double iou_threshold, std::optional<double> score_threshold, int64_t limit) {
  Kept result;
  if (boxes.size(0) == 0 || limit == 0) return result;

  // 1-2. candidates in score order (original indices), descending, NaN
  // first (as torch.sort), ties by index: a total order, so std::sort
  // (which needs no buffer) gives the stable sort's result.
  const Buf<double> sc = scores_as_double(scores);
  Buf<int64_t>& ord = result.ord;
  ord.reserve(sc.size());
  for (int64_t i = 0; i < static_cast<int64_t>(sc.size()); ++i) {
    if (!score_threshold.has_value() || sc[i] > *score_threshold) ord.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(ord.size());
  if (n == 0) return result;
  std::sort(ord.begin(), ord.end(), [&](int64_t a, int64_t b) {
    const bool na = std::isnan(sc[a]), nb = std::isnan(sc[b]);
    if (na != nb) return na;
    if (!na && sc[a] != sc[b]) return sc[a] > sc[b];
    return a < b;
  });

  // 3. per-class segments, each in score order: `perm` (positions into ord)
  // grouped by class, ties by position.
  Buf<int64_t> seg{0, n};
  Buf<int64_t> perm;
  if (idxs.has_value()) {
    const Buf<int64_t> cls = classes_of(*idxs);
    perm.resize(static_cast<size_t>(n));
    for (int64_t p = 0; p < n; ++p) perm[p] = p;
    std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) {
      const int64_t ca = cls[ord[a]], cb = cls[ord[b]];
      return ca != cb ? ca < cb : a < b;
    });
    seg.assign(1, 0);
    for (int64_t p = 1; p < n; ++p) {
      if (cls[ord[perm[p]]] != cls[ord[perm[p - 1]]]) seg.push_back(p);
    }
    seg.push_back(n);
  }
  const auto nseg = static_cast<int64_t>(seg.size()) - 1;
  auto box_at = [&](int64_t p) { return perm.empty() ? ord[p] : ord[perm[p]]; };

  // 4-5.
  Buf<uint8_t> removed(static_cast<size_t>(n), 0);
  Buf<uint8_t>& keep = result.keep;
  keep.assign(static_cast<size_t>(n), 0);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    Buf<T, 5 * kSmall> soa(static_cast<size_t>(5 * n));
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
      // parallel sweep. The output is cut to the limit afterwards, in global
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
    Buf<uint8_t> by_score(static_cast<size_t>(n), 0);
    for (int64_t p = 0; p < n; ++p) by_score[perm[p]] = keep[p];
    keep.swap(by_score);
  }
  int64_t k = 0;
  for (int64_t p = 0; p < n; ++p) k += keep[p];
  result.count = std::min(k, limit);
  return result;
}

// Through at::empty, so torch's deterministic mode fills it first (the
// tests' poisoned() then catches an element left unwritten).
at::Tensor long_tensor(at::IntArrayRef sizes) { return at::empty(sizes, at::TensorOptions().dtype(at::kLong)); }

at::Tensor kept_tensor(const char* op, const at::Tensor& boxes, const at::Tensor& scores,
                       const std::optional<at::Tensor>& idxs, double iou_threshold,
                       std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  opforge::nms::check_args(op, boxes, scores, idxs, score_threshold, max_output);
  const Kept kept = nms_kept_cpu(boxes, scores, idxs, iou_threshold, score_threshold,
                                 max_output.value_or(std::numeric_limits<int64_t>::max()));
  at::Tensor out = long_tensor({kept.count});
  kept.write(out.data_ptr<int64_t>());
  return out;
}

at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
                   std::optional<double> score_threshold, std::optional<int64_t> max_output) {
  return kept_tensor("opforge.nms", boxes, scores, std::nullopt, iou_threshold, score_threshold, max_output);
}

at::Tensor batched_nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                           double iou_threshold, std::optional<double> score_threshold,
                           std::optional<int64_t> max_output) {
  return kept_tensor("opforge.batched_nms", boxes, scores, idxs, iou_threshold, score_threshold, max_output);
}

// Written in place: two allocations and no further ATen calls.
std::tuple<at::Tensor, at::Tensor> nms_padded_cpu(const at::Tensor& boxes, const at::Tensor& scores,
                                                  double iou_threshold, int64_t max_output,
                                                  const std::optional<at::Tensor>& idxs,
                                                  std::optional<double> score_threshold) {
  opforge::nms::check_padded_args(boxes, scores, idxs, score_threshold, max_output);
  const Kept kept = nms_kept_cpu(boxes, scores, idxs, iou_threshold, score_threshold, max_output);
  at::Tensor out = long_tensor({max_output});
  int64_t* o = out.data_ptr<int64_t>();
  kept.write(o);
  std::fill(o + kept.count, o + max_output, int64_t{-1});
  at::Tensor count = long_tensor({});
  *count.data_ptr<int64_t>() = kept.count;
  return {out, count};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("nms", &nms_cpu);
  m.impl("batched_nms", &batched_nms_cpu);
  m.impl("nms_padded", &nms_padded_cpu);
}

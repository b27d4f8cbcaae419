// The inner loop of the CPU NMS sweep, compiled once per ISA by
// nms_{default,avx2,avx512}.cpp (which include cpu_isa_begin.h first).
//
// suppress_*: the kept boxes `rows` (positions in the sorted structure-of-
// arrays data) remove every box j in [lo, hi) with IoU(row, j) > thr. IoU is
// torchvision's formula, in the same order of operations:
//   inter = max(min(x2) - max(x1), 0) * max(min(y2) - max(y1), 0)
//   iou   = inter / (area_i + area_j - inter)
// Pairs with no positive intersection can never pass a threshold >= 0
// (0 / u is 0, -0 or NaN), so then a vector with none skips the division;
// below 0 (any float is taken, as in torchvision) every pair is divided.
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace opforge::cpu::CPU_CAPABILITY {

namespace {

template <typename T>
inline bool iou_above(T ix1, T iy1, T ix2, T iy2, T iarea, T jx1, T jy1, T jx2, T jy2, T jarea, T thr) {
  const T w = std::max(std::min(ix2, jx2) - std::max(ix1, jx1), T(0));
  const T h = std::max(std::min(iy2, jy2) - std::max(iy1, jy1), T(0));
  const T inter = w * h;
  if (!(inter > T(0)) && thr >= T(0)) return false;
  return inter / (iarea + jarea - inter) > thr;
}

template <typename T>
void suppress(const T* x1, const T* y1, const T* x2, const T* y2, const T* area, const int64_t* rows, int64_t nrows,
              int64_t lo, int64_t hi, T thr, uint8_t* removed) {
  using V = at::vec::Vectorized<T>;
  constexpr int64_t W = V::size();
  constexpr int all_lanes = static_cast<int>((uint64_t(1) << W) - 1);
  const V zero(T(0));
  const V vthr(thr);
  const bool skip_empty = thr >= T(0);
  int64_t j = lo;
  for (; j + W <= hi; j += W) {
    bool live = false;
    for (int64_t k = 0; k < W; ++k) live |= removed[j + k] == 0;
    if (!live) continue;
    const V jx1 = V::loadu(x1 + j), jy1 = V::loadu(y1 + j), jx2 = V::loadu(x2 + j), jy2 = V::loadu(y2 + j);
    const V jarea = V::loadu(area + j);
    V acc(T(0));
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t i = rows[r];
      const V w = at::vec::maximum(at::vec::minimum(V(x2[i]), jx2) - at::vec::maximum(V(x1[i]), jx1), zero);
      const V h = at::vec::maximum(at::vec::minimum(V(y2[i]), jy2) - at::vec::maximum(V(y1[i]), jy1), zero);
      const V inter = w * h;
      if (skip_empty && (inter > zero).zero_mask() == all_lanes) continue;
      const V ovr = inter / ((V(area[i]) + jarea) - inter);
      acc = acc | (ovr > vthr);
    }
    const int hit = ~acc.zero_mask() & all_lanes;
    if (hit) {
      for (int64_t k = 0; k < W; ++k) removed[j + k] |= static_cast<uint8_t>((hit >> k) & 1);
    }
  }
  for (; j < hi; ++j) {
    if (removed[j]) continue;
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t i = rows[r];
      if (iou_above<T>(x1[i], y1[i], x2[i], y2[i], area[i], x1[j], y1[j], x2[j], y2[j], area[j], thr)) {
        removed[j] = 1;
        break;
      }
    }
  }
}

}  // namespace

void nms_suppress_f32(const float* x1, const float* y1, const float* x2, const float* y2, const float* area,
                      const int64_t* rows, int64_t nrows, int64_t lo, int64_t hi, float thr, uint8_t* removed) {
  suppress<float>(x1, y1, x2, y2, area, rows, nrows, lo, hi, thr, removed);
}

void nms_suppress_f64(const double* x1, const double* y1, const double* x2, const double* y2, const double* area,
                      const int64_t* rows, int64_t nrows, int64_t lo, int64_t hi, double thr, uint8_t* removed) {
  suppress<double>(x1, y1, x2, y2, area, rows, nrows, lo, hi, thr, removed);
}

}  // namespace opforge::cpu::CPU_CAPABILITY

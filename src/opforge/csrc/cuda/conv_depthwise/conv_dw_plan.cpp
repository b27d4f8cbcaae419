// Planning of the depthwise CUDA kernels (declared in conv_dw.h): tilings,
// vector widths and launch shapes from the geometry, the dtype's size and
// the pointers' alignment. Host code only.
#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>

#include <opforge/cuda_launch.cuh>

#include "cuda/conv_depthwise.h"
#include "cuda/conv_depthwise/conv_dw.h"

namespace opforge::conv {
namespace {

constexpr size_t kStageBudget = 48 * 1024;  // shared bytes per block of the stride-1 kernels

int round_up(int v, int m) { return (v + m - 1) / m * m; }

// The unstaged kernels' geometry, ngw vectors per row (NCHW) or pixel (NHWC)
// and their item count; false where the 32-bit decode would not hold.
bool fill_direct_args(const Geometry& g, int64_t ngw, int64_t items, DwDirectArgs& a) {
  if (items >= (int64_t{1} << 31) || g.H > INT32_MAX / 4 || g.W > INT32_MAX / 4) return false;
  a = DwDirectArgs{};
  a.H = static_cast<int>(g.H);
  a.W = static_cast<int>(g.W);
  a.Wo = static_cast<int>(g.Wo);
  a.pad = static_cast<int>(g.pad);
  a.C = static_cast<unsigned>(g.C);
  a.K = static_cast<unsigned>(g.K);
  a.Ho = static_cast<unsigned>(g.Ho);
  a.mult = static_cast<unsigned>(g.mult);
  a.ngw = static_cast<unsigned>(ngw);
  a.items = static_cast<unsigned>(items);
  return true;
}

}  // namespace

DwArgs base_args(const Geometry& g) {
  DwArgs a{};
  a.N = g.N;
  a.C = g.C;
  a.H = g.H;
  a.W = g.W;
  a.K = g.K;
  a.Ho = g.Ho;
  a.Wo = g.Wo;
  a.pad = static_cast<int>(g.pad);
  a.mult = static_cast<int>(g.mult);
  return a;
}

void plan_forward_nchw(const Geometry& g, int V, int S, int s, int opmath_size, const void* out, DwArgs& a,
                       int64_t& blocks, size_t& smem) {
  // V along W: loads need W % V == 0, stores Wo % V == 0 (else scalar stores).
  a.tow = static_cast<int>(g.Wo <= 128 ? g.Wo : 64);
  const int max_out = opmath_size == 8 ? 1024 : 2048;
  int toh = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(g.Ho, max_out / a.tow)));
  const int64_t th = (g.Ho + toh - 1) / toh;
  toh = static_cast<int>((g.Ho + th - 1) / th);  // balanced tiles
  a.toh = toh;
  a.tiles_h = static_cast<int>((g.Ho + toh - 1) / toh);
  a.tiles_w = static_cast<int>((g.Wo + a.tow - 1) / a.tow);
  a.tih = (toh - 1) * S + 3;
  const int ngw = (a.tow + V - 1) / V;
  const int nw = (V * S + 2 + V - 1) / V;
  // Row pitch: staged width, and every window read stays inside the row.
  const int need = std::max((a.tow - 1) * S + 3, (ngw - 1) * V * S + nw * V);
  a.pitch = (need + V - 1) / V * V;
  a.store_vec = V > 1 && g.Wo % V == 0 && opforge::cuda::is_aligned(out, static_cast<size_t>(V) * s);
  blocks = g.N * g.C * a.tiles_h * a.tiles_w;
  smem = opmath_size * (static_cast<size_t>(a.tih) * a.pitch + 10 * static_cast<size_t>(g.mult));
}

void plan_forward_nhwc(const Geometry& g, int V, int S, int opmath_size, DwArgs& a, int64_t& blocks, size_t& smem) {
  // V along the channels: C % V == 0 (then K = C * m too).
  const int oh_t = S == 1 ? 8 : 4, ow_t = 8;
  const int ih_t = (oh_t - 1) * S + 3, iw_t = (ow_t - 1) * S + 3;
  const int base = opmath_size == 8 ? 32 : 64;
  int cb = static_cast<int>(std::min<int64_t>(g.C, std::max<int64_t>(V, base / std::max<int64_t>(1, g.mult))));
  cb = std::max(V, cb / V * V);
  a.cb = cb;
  a.chunks = static_cast<int>((g.C + cb - 1) / cb);
  a.tiles_h = static_cast<int>((g.Ho + oh_t - 1) / oh_t);
  a.tiles_w = static_cast<int>((g.Wo + ow_t - 1) / ow_t);
  blocks = g.N * a.tiles_h * a.tiles_w * a.chunks;
  smem = opmath_size * (static_cast<size_t>(ih_t) * iw_t * cb + 10 * static_cast<size_t>(cb) * g.mult);
}

bool plan_nchw_direct(const Geometry& g, int s, const void* op, NchwDirectPlan& plan) {
  // Measured on the H200 over the depthwise layers of real models (docs/ops/conv.md): the
  // staged kernels leave most of a block idle on planes of up to 14x14 outputs, and the
  // general one stages a plane per block at stride 2; larger stride-1 planes stage faster.
  if (g.stride != 2 && g.Ho * g.Wo > 196) return false;
  const int V = s == 2 && g.Wo % 8 == 0 ? 8 : g.Wo >= 4 ? 4 : g.Wo >= 2 ? 2 : 1;
  const int64_t ngw = (g.Wo + V - 1) / V;
  if (!fill_direct_args(g, ngw, g.N * g.K * g.Ho * ngw, plan.a)) return false;
  plan.a.store_vec = V > 1 && g.Wo % V == 0 && opforge::cuda::is_aligned(op, static_cast<size_t>(V) * s);
  plan.V = V;
  return true;
}

bool plan_nhwc_direct(const Geometry& g, int s, int opmath_size, const void* xp, const void* op, NchwDirectPlan& plan,
                      size_t& smem) {
  // At stride 1 the staged kernel is 1.2-4x faster (the same sweep); at stride 2 the tiled
  // general kernel's opmath stage costs more than the loads L1 serves here.
  if (g.stride != 2 || g.mult != 1) return false;
  smem = static_cast<size_t>(10) * g.C * opmath_size;
  if (smem > kStageBudget) return false;
  int V = 16 / s;
  while (V > 1 && (g.C % V != 0 || !opforge::cuda::is_aligned(xp, static_cast<size_t>(V) * s) ||
                   !opforge::cuda::is_aligned(op, static_cast<size_t>(V) * s)))
    V /= 2;
  const int64_t ngw = g.C / V;
  if (!fill_direct_args(g, ngw, g.N * g.Ho * g.Wo * ngw, plan.a)) return false;
  plan.a.store_vec = true;
  plan.V = V;
  return true;
}

bool plan_nchw_s1(const Geometry& g, int s, const void* xp, const void* op, bool per_channel, NchwS1Plan& plan) {
  if (s == 8 || g.stride != 1 || g.H > INT32_MAX / 4 || g.W > INT32_MAX / 4 || g.C > INT32_MAX || g.mult > INT32_MAX)
    return false;
  const int E = 16 / s;
  const int W = static_cast<int>(g.W), Wo = static_cast<int>(g.Wo), Ho = static_cast<int>(g.Ho);
  // Output columns per thread: 16 bytes, or 8 when that divides Wo and 16 does not.
  int V = E;
  if (Wo % V != 0 && Wo % (V / 2) == 0) V /= 2;
  DwS1Args a{};
  a.planes = g.N * g.C;
  a.plane_step = per_channel ? g.C : 1;
  a.C = static_cast<int>(g.C);
  a.H = static_cast<int>(g.H);
  a.W = W;
  a.Ho = Ho;
  a.Wo = Wo;
  a.mult = static_cast<int>(g.mult);
  a.ngw = (Wo + V - 1) / V;
  a.P = E + round_up(std::max(W, a.ngw * V + 2), E);
  const size_t row_bytes = static_cast<size_t>(a.P) * s;
  const int max_rows = static_cast<int>(kStageBudget / row_bytes) - 2;  // output rows per block
  if (max_rows < 1) return false;
  a.LB = s;
  for (int lb : {16, 8, 4}) {
    if (lb >= s && (static_cast<int64_t>(W) * s) % lb == 0 && opforge::cuda::is_aligned(xp, lb)) {
      a.LB = lb;
      break;
    }
  }
  a.store_vec = Wo % V == 0 && opforge::cuda::is_aligned(op, static_cast<size_t>(V) * s);
  // Bands of output rows (balanced), runs of up to 12 rows per thread (the
  // best run length measured: docs/ops/conv.md, Design notes).
  a.bands = (Ho + max_rows - 1) / max_rows;
  a.BH = (Ho + a.bands - 1) / a.bands;
  a.bands = (Ho + a.BH - 1) / a.BH;
  a.runs = (a.BH + 11) / 12;
  a.R = (a.BH + a.runs - 1) / a.runs;
  a.runs = (a.BH + a.R - 1) / a.R;
  a.SR = a.BH + 2;
  const int per_plane = a.runs * a.ngw;  // thread items per plane (band)
  a.PB = 1;
  if (a.bands == 1) {
    // Several small planes per block: up to kThreads items and the budget,
    // while keeping at least 4 tiles per SM (and, of one channel's planes,
    // at most N).
    const int64_t by_threads = std::max(1, kThreads / per_plane);
    const int64_t by_smem = static_cast<int64_t>(kStageBudget / (row_bytes * a.SR));
    const int64_t by_blocks = std::max<int64_t>(1, a.planes / (4LL * opforge::cuda::sm_count()));
    a.PB = static_cast<int>(
        std::max<int64_t>(1, std::min({by_threads, by_smem, by_blocks, per_channel ? g.N : a.planes})));
  }
  const int vec_per_row = W / (a.LB / s);
  // Lanes per staged row: enough for its copies (with 16-byte copies, for
  // all of its chunks, zeros included), at most a warp.
  const int per_row = a.LB == 16 ? a.P / E : vec_per_row;
  a.lpr_shift = 0;
  while ((1 << a.lpr_shift) < std::min(per_row, 32)) ++a.lpr_shift;
  plan.a = a;
  plan.V = V;
  plan.threads = std::min(kThreads, round_up(a.PB * per_plane, 32));
  return true;
}

bool plan_nhwc_s1(const Geometry& g, int s, const void* xp, const void* op, int max_rows, DwS1NhwcArgs& a,
                  int& threads) {
  if (s == 8 || g.stride != 1 || g.mult != 1 || g.C % 4 != 0 || g.C > INT32_MAX / 2 || g.H > INT32_MAX / 4 ||
      g.W > INT32_MAX / 4 || !opforge::cuda::is_aligned(op, 4 * s))
    return false;
  a = DwS1NhwcArgs{};
  a.N = g.N;
  a.C = static_cast<int>(g.C);
  a.H = static_cast<int>(g.H);
  a.W = static_cast<int>(g.W);
  a.Ho = static_cast<int>(g.Ho);
  a.Wo = static_cast<int>(g.Wo);
  a.CB = std::min(32, a.C);
  a.LB = 0;
  for (int lb : {16, 8, 4}) {
    if ((a.C * s) % lb == 0 && (a.CB * s) % lb == 0 && opforge::cuda::is_aligned(xp, lb)) {
      a.LB = lb;
      break;
    }
  }
  if (a.LB == 0) return false;
  a.chunks = (a.C + a.CB - 1) / a.CB;
  // Tiles of up to 16 x 16 output pixels, balanced over the image.
  a.tiles_w = (a.Wo + 15) / 16;
  a.TW = (a.Wo + a.tiles_w - 1) / a.tiles_w;
  a.tiles_w = (a.Wo + a.TW - 1) / a.TW;
  // Tile rows: max_rows, halved down to 4 while that leaves fewer than 3
  // blocks per SM (small problems: more, shorter blocks in flight beat fewer
  // halo rows).
  int rows = max_rows;
  const int64_t want = 3LL * opforge::cuda::sm_count();
  while (rows > 4 && g.N * ((a.Ho + rows - 1) / rows) * a.tiles_w * a.chunks < want) rows /= 2;
  a.tiles_h = (a.Ho + rows - 1) / rows;
  a.BH = (a.Ho + a.tiles_h - 1) / a.tiles_h;
  a.tiles_h = (a.Ho + a.BH - 1) / a.BH;
  threads = round_up(a.CB / 4 * a.TW, 32);
  return true;
}

int64_t rows_per_split_for(int64_t rows, int64_t col_blocks) {
  const int64_t want = std::min<int64_t>(65535, (8LL * opforge::cuda::sm_count() + col_blocks - 1) / col_blocks);
  return std::max<int64_t>(8, (rows + want - 1) / want);
}

bool depthwise_backward_prefers_cudnn(const Geometry& g, bool nhwc) {
  // The H200 sweep (docs/ops/conv.md): at stride 2 these kernels ran at 0.44-0.85x cuDNN's
  // backward on every NCHW layer of 2^21 elements and up, and at 0.20-1.0x on NHWC ones of 2^22 and up;
  // below, the calls are host-bound and even.
  const int64_t elements = g.N * g.C * g.H * g.W;
  return g.stride == 2 && elements >= (int64_t{1} << (nhwc ? 22 : 21));
}

bool staged_s1_applies(const Geometry& g, bool nhwc, at::ScalarType dtype) {
  return g.stride == 1 && g.mult == 1 && dtype != at::kDouble && (!nhwc || g.C % 4 == 0);
}

}  // namespace opforge::conv

// The softmax row kernels' launch planner: the plan a request runs, the
// default request per row length and dtype, and the checks of a requested
// plan. Host only, no CUDA: every number here is a choice between kernels
// the .cu files of this folder build (see plan.h).
#include "plan.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include <opforge/checks.h>

namespace opforge::softmax::gpu {

Plan plan_from(const PlanRequest& r, int64_t K, int V) {
  Plan p{};
  p.it = r.it;
  p.G = r.threads_per_row;
  p.block = r.threads_per_row * r.rows_per_block;
  const int64_t capacity = int64_t{p.G} * V * p.it;
  if (K <= capacity && !r.resident) return p;
  TORCH_CHECK_VALUE(r.rows_per_block == 1,
                    "opforge softmax plan: a plan that splits rows or keeps clusters "
                    "resident needs one row per block");
  p.chunk = capacity;
  const int64_t n = ceil_div(K, capacity);  // grid.x: up to 2^31 - 1 chunks, no practical cap
  TORCH_CHECK(n < (int64_t{1} << 31), "opforge softmax: rows of ", opforge::num(K), " elements are too long");
  p.nchunks = static_cast<int>(n);
  p.kind = r.cluster && n <= kMaxCluster ? (r.resident ? Kind::Resident : Kind::Cluster) : Kind::Split;
  return p;
}

namespace {

// The default plan, the fastest of every plan that bench/softmax_plans.py
// times on an H200: threads holding E = 16 values each for rows up
// to 2048 elements and E = 32 beyond (fewer, longer-lived threads keep
// several 16-byte loads in flight each and need fewer reduction steps);
//  * rows up to 32 x 16 values: a slice of a warp (or a warp) per row,
//    several rows per 128-thread block;
//  * rows up to 512 threads x E: a block per row;
//  * 4- and 8-byte forward rows up to 512 threads x 64 registers of values:
//    still one block per row;
//  * longer rows on GPUs with clusters: a cluster of up to 16 blocks, of 256
//    or 512 threads with E or 2E values each (forward; 4- and 8-byte types
//    first try 256 threads x 2E), or of 512 threads with 64 registers of
//    values (backward); where `resident` (fwd_resident_kernel is built for
//    the rows) the forward's clusters stay resident and walk the rows;
//  * otherwise one block of up to itmax vectors per thread, else the
//    two-pass split.
// Rows of the half types held packed (kPacked) past the short rows have
// their own rule: see default_request.
// itmax / itlight: vectors per thread in 64 / 32 registers of values;
// itcluster: the most the backward takes split over a cluster
// (bwd_cluster_kernel holds y only).
PlanRequest default_shape(int64_t K, int V, int itmax, int itlight, int itcluster, bool clusters, int arrays,
                          bool resident) {
  const int e_short = 16, e_long = 32;
  const int it_short = std::max(1, std::min(itlight, e_short / V));
  const int it_long = std::max(1, std::min(itlight, e_long / V));
  if (K <= int64_t{32} * V * it_short) {
    const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it_short)));
    return {G, std::max(1, 128 / G), it_short, false};
  }
  const int it_rows = K <= 2048 ? it_short : it_long;
  if (K <= int64_t{kMaxGroup} * V * it_rows) {
    const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it_rows)));
    return {G, G < 128 ? 128 / G : 1, it_rows, false};
  }
  auto one_block = [&] {
    int it = it_long;
    while (ceil_div(K, int64_t{V} * it) > kMaxGroup) it *= 2;
    return PlanRequest{static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it))), 1, it, false};
  };
  const bool narrow = V >= 8;
  // 4- and 8-byte forward: one block with up to 64 registers of values per
  // thread holds the row faster than a cluster does.
  if (arrays == 1 && !narrow && K <= int64_t{kMaxGroup} * V * itmax) return one_block();
  if (clusters) {
    // (threads, vectors per thread) in order of preference; the first whose
    // cluster has at most 16 blocks wins. Forward: 4-byte types favour more
    // values per thread, 2-byte types more threads; only the forward has
    // resident clusters. Backward: 512 threads x 32 values of each array
    // first, then 64 values of y only (bwd_cluster_kernel), for rows up to
    // twice as long. The timings behind each order: docs/ops/softmax.md.
    const int fwd_narrow[4][2] = {{256, it_long}, {kMaxGroup, it_long}, {256, 2 * it_long}, {kMaxGroup, 2 * it_long}};
    const int fwd_wide[4][2] = {{256, 2 * it_long}, {kMaxGroup, it_long}, {kMaxGroup, 2 * it_long}, {256, it_long}};
    const int fwd_resident[4][2] = {{kMaxGroup, 2 * it_long}, {256, 2 * it_long}, {kMaxGroup, it_long}, {256, it_long}};
    const int (&fwd)[4][2] = resident ? fwd_resident : narrow ? fwd_narrow : fwd_wide;
    const int bwd[2][2] = {{kMaxGroup, itmax}, {kMaxGroup, 2 * itmax}};
    const int n = arrays == 1 ? 4 : 2;
    for (int i = 0; i < n; ++i) {
      const int G = arrays == 1 ? fwd[i][0] : bwd[i][0];
      const int it = arrays == 1 ? fwd[i][1] : bwd[i][1];
      if (it <= (arrays == 1 ? itmax : itcluster) && ceil_div(K, int64_t{G} * V * it) <= kMaxCluster) {
        return {G, 1, it, true, resident};
      }
    }
  }
  if (K <= int64_t{kMaxGroup} * V * itmax) return one_block();
  return {kMaxGroup, 1, itlight, false};
}

}  // namespace

PlanRequest default_request(int64_t K, int V, int itmax, int itlight, int itcluster, bool clusters, int arrays,
                            bool packed, bool resident) {
  // Rows of the half types held packed, past the short rows (512
  // elements): threads of E = 32 values (of each array) up to 2048
  // elements, E = 64 beyond; one block per row while 512 threads hold it,
  // else a cluster of up to 16 blocks (of 256 threads first forward, of
  // 512 backward), else (backward) a cluster of 512-thread blocks holding
  // 128 values of y, else the split: the best plan timed for bfloat16 at
  // each shape, or within 2% of it (docs/ops/softmax.md, Design notes).
  if (packed && K > 512) {
    const int it = (K <= 2048 ? 32 : 64) / V;
    if (K <= int64_t{kMaxGroup} * V * it) {
      const int G = static_cast<int>(next_pow2(ceil_div(K, int64_t{V} * it)));
      return {G, G < 128 ? 128 / G : 1, it, false};
    }
    const int order[2] = {arrays == 1 ? 256 : kMaxGroup, arrays == 1 ? kMaxGroup : 256};
    for (const int G : order) {
      if (clusters && ceil_div(K, int64_t{G} * V * it) <= kMaxCluster) return {G, 1, it, true};
    }
    // The backward's clusters hold y only: twice the values per thread
    // still fit, for rows up to twice as long.
    if (arrays == 2 && clusters && 2 * it <= itcluster && ceil_div(K, int64_t{kMaxGroup} * V * 2 * it) <= kMaxCluster) {
      return {kMaxGroup, 1, 2 * it, true};
    }
    return {kMaxGroup, 1, it, false};
  }
  return default_shape(K, V, itmax, itlight, itcluster, clusters, arrays, resident);
}

void check_request(const PlanRequest& r, int itmax) {
  auto pow2 = [](int64_t v) { return v > 0 && (v & (v - 1)) == 0; };
  TORCH_CHECK_VALUE(pow2(r.threads_per_row) && r.threads_per_row <= kMaxGroup,
                    "opforge softmax plan: threads_per_row must be a power of two in [1, 512], got ",
                    opforge::num(r.threads_per_row));
  TORCH_CHECK_VALUE(pow2(r.rows_per_block) && int64_t{r.rows_per_block} * r.threads_per_row <= kMaxGroup,
                    "opforge softmax plan: rows_per_block must be a power of two with rows_per_block x "
                    "threads_per_row <= 512, got ",
                    opforge::num(r.rows_per_block));
  TORCH_CHECK_VALUE(pow2(r.it) && r.it <= itmax,
                    "opforge softmax plan: vectors_per_thread must be a power of two <= ", opforge::num(itmax),
                    " for this dtype and alignment, got ", opforge::num(r.it));
  TORCH_CHECK_VALUE(!r.resident || r.cluster, "opforge softmax plan: persistent clusters need cluster=True");
}

Plan within_budget(const Plan& p, int64_t K, int V, int itmax) {
  if (p.it <= itmax) return p;
  const int rows_per_block = int64_t{p.G} * V * itmax >= K ? p.block / p.G : 1;
  return plan_from(PlanRequest{p.G, rows_per_block, itmax, p.kind != Kind::Rows}, K, V);
}

}  // namespace opforge::softmax::gpu

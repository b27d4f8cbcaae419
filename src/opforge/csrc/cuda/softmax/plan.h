// The launch plans of the softmax row kernels (inner-most dim): what a
// launch asks for (PlanRequest), what it runs (Plan), and how a plan is
// chosen. Host only: the choice is integer arithmetic (softmax_plan.cpp);
// the kernels and their launches live in the .cu files of this folder.
#pragma once

#include <cstdint>

#include "config.h"

namespace opforge::softmax::gpu {

inline int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

enum class Kind { Rows, Cluster, Resident, Split };

// The knobs of a launch: threads per row (or per chunk of a row), rows per
// block, vectors per thread, whether a row longer than one block may be
// split over a cluster, and whether those clusters stay resident and walk
// the rows (fwd_resident_kernel; also for rows one block holds: a cluster of
// one).
struct PlanRequest {
  int threads_per_row;
  int rows_per_block;
  int it;
  bool cluster;
  bool resident = false;
};

struct Plan {
  int it;     // elements per thread = V * it
  int G;      // threads per row (Rows) or per chunk (Cluster, Split)
  int block;  // threads per block
  Kind kind = Kind::Rows;
  int64_t chunk = 0;  // elements per block (Cluster, Split)
  int nchunks = 1;
};

// The plan that runs request r for rows of K elements in vectors of V.
Plan plan_from(const PlanRequest& r, int64_t K, int V);

// The default request for rows of K elements in vectors of V (measured
// best per shape on an H200; docs/ops/softmax.md, Design notes).
// itmax / itlight: vectors per thread in 64 / 32 registers of values;
// itcluster: the most the backward takes split over a cluster
// (bwd_cluster_kernel holds y only); clusters: the GPU runs them;
// arrays: register arrays per element (1 forward, 2 backward);
// packed: the row is held as loaded (kPacked: the half types);
// resident: fwd_resident_kernel is built for these rows (kResident).
PlanRequest default_request(int64_t K, int V, int itmax, int itlight, int itcluster, bool clusters, int arrays,
                            bool packed, bool resident);

// Checks a requested plan (the `_plan` ops) against what the kernels allow.
void check_request(const PlanRequest& r, int itmax);

// Whether this build's kernels can use clusters at all on the current GPU
// (defined with the float32 forward, whose kernel it asks about).
bool clusters_available();

// The plan for rows of K elements in vectors of V: the requested one
// (checked against the kernels' register budget B) or the default.
// arrays: register arrays per element (1 forward, 2 backward); resident:
// fwd_resident_kernel is built for these rows; itcluster (backward): the
// most vectors per thread of a plan that asks for clusters
// (bwd_cluster_kernel), 0 for B's.
template <typename B, int V>
Plan resolve_plan(const PlanRequest* req, int64_t K, int arrays, bool resident = false, int itcluster = 0) {
  constexpr int ITMAX = B::template itmax<V>();
  const int itcl = itcluster > 0 ? itcluster : ITMAX;
  if (req != nullptr) {
    check_request(*req, req->cluster ? itcl : ITMAX);
    return plan_from(*req, K, V);
  }
  return plan_from(default_request(K, V, B::template itplan<V>(), B::template itlight<V>(), itcl, clusters_available(),
                                   arrays, B::template packed<V>(), resident),
                   K, V);
}

// A backward plan that bwd_rows_kernel, holding dy and y, can run: vectors
// per thread within its budget itmax (a plan meant for bwd_cluster_kernel,
// which holds y only, may take up to twice as many).
Plan within_budget(const Plan& p, int64_t K, int V, int itmax);

}  // namespace opforge::softmax::gpu

// The depthwise 3x3 CUDA convolution's parts as host code sees them: the
// kernels' arguments, the planners (conv_dw_plan.cpp) and the launchers,
// each defined in the .cu named beside it and instantiated there for the
// four float types (OPFORGE_DW_INSTANTIATE), so that the drivers
// (conv_dw.cpp) and the kernels compile apart. No device code.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "conv.h"

namespace opforge::conv {

// Threads per block of most depthwise kernels (their __launch_bounds__).
inline constexpr int kThreads = 256;

// The general kernels (conv_dw_forward_*.cuh, the gather and per-row
// backward kernels): geometry, and the forward's tiling.
struct DwArgs {
  int64_t N, C, H, W, K, Ho, Wo;
  int pad, mult;
  Activation act;
  // NCHW tiling
  int toh, tow, tiles_h, tiles_w, pitch, tih;
  bool store_vec;
  // NHWC tiling
  int cb, chunks;
};

// The staged stride-1 NCHW kernels (conv_dw_forward_nchw.cuh, the weight
// gradient's dw_bwd_weight_nchw_s1): see plan_nchw_s1.
struct DwS1Args {
  int64_t planes;      // N * C
  int64_t plane_step;  // between a tile's planes: 1, or C (planes of one channel)
  int C, H, W, Ho, Wo, mult;
  int P, ngw, R, runs, BH, bands, PB, SR, LB, lpr_shift;
  Activation act;
  bool store_vec;
};

// The unstaged NCHW forward (dw_fwd_nchw_direct): see plan_nchw_direct.
struct DwDirectArgs {
  int H, W, Wo, pad;
  unsigned C, K, Ho, mult, ngw, items;
  Activation act;
  bool store_vec;
};

// The staged stride-1 NHWC kernels (forward, weight gradient, fused
// backward): see plan_nhwc_s1.
struct DwS1NhwcArgs {
  int64_t N;
  int C, H, W, Ho, Wo;
  int CB, chunks, TW, BH, tiles_w, tiles_h, LB;
  Activation act;
};

// ---- planning (conv_dw_plan.cpp); s: bytes per element of the dtype

DwArgs base_args(const Geometry& g);

// Tiling of the general forward kernels for V elements per vector (along W
// for NCHW, along C for NHWC) and stride S, into `a`; blocks and shared
// bytes of the launch. opmath_size: bytes of the dtype's opmath type; out:
// the output's data (its alignment decides vector stores).
void plan_forward_nchw(const Geometry& g, int V, int S, int s, int opmath_size, const void* out, DwArgs& a,
                       int64_t& blocks, size_t& smem);
void plan_forward_nhwc(const Geometry& g, int V, int S, int opmath_size, DwArgs& a, int64_t& blocks, size_t& smem);

// Tiling of the stride-1 NCHW kernels (forward, and the backward's weight
// gradient on the same stage), when the shape suits them: float32/float16/
// bfloat16 and three staged rows of one plane within the budget. V: output
// columns per thread item. `per_channel`: the planes of a tile are those of
// one channel (plane_step C, the weight gradient's), else consecutive ones.
struct NchwS1Plan {
  DwS1Args a;
  int V, threads;
};

bool plan_nchw_s1(const Geometry& g, int s, const void* xp, const void* op, bool per_channel, NchwS1Plan& plan);

inline size_t nchw_s1_stage_bytes(const DwS1Args& a, int s) { return static_cast<size_t>(a.P) * s * a.SR * a.PB; }

// The unstaged NCHW forward, where its rule takes the shape (stride 2, and
// output planes of up to 196 pixels: conv_dw_plan.cpp says why): V output
// columns per thread. False where it does not apply (or its items pass 2^31).
struct NchwDirectPlan {
  DwDirectArgs a;
  int V;
};

bool plan_nchw_direct(const Geometry& g, int s, const void* op, NchwDirectPlan& plan);

// The unstaged NHWC forward (multiplier 1), where its rule takes the shape
// (stride 2): V channels per thread, x and out aligned for them; smem: the
// staged weights' bytes.
bool plan_nhwc_direct(const Geometry& g, int s, int opmath_size, const void* xp, const void* op, NchwDirectPlan& plan,
                      size_t& smem);

// Tiling of the stride-1 NHWC kernels: multiplier 1, C % 4 == 0, x aligned
// for at least 4-byte copies and out for 4-channel accesses.
bool plan_nhwc_s1(const Geometry& g, int s, const void* xp, const void* op, int max_rows, DwS1NhwcArgs& a,
                  int& threads);

inline size_t nhwc_s1_stage_bytes(const DwS1NhwcArgs& a, int s) {
  return static_cast<size_t>(a.BH + 2) * (a.TW + 2) * a.CB * s;
}

// Rows per split of the backward kernels that split `rows` rows (over
// col_blocks blocks of columns or channels): about 8 blocks per SM in all,
// at least 8 rows per split (a warp or thread row each), at most 65535
// splits (grid.y).
int64_t rows_per_split_for(int64_t rows, int64_t col_blocks);

// Where the stride-1 tiled kernels may serve the backward (their planners
// still decline some shapes: very wide rows, misaligned pointers).
bool staged_s1_applies(const Geometry& g, bool nhwc, at::ScalarType dtype);

// ---- launchers

// conv_dw_forward_nchw.cu / conv_dw_forward_nhwc.cu: the general forward
// kernel for V and S, as planned by plan_forward_*.
template <typename scalar_t>
void launch_forward_nchw(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* out, const DwArgs& a, int V,
                         int S, int64_t blocks, size_t smem, cudaStream_t stream);
template <typename scalar_t>
void launch_forward_nhwc(const scalar_t* x, const scalar_t* w, const scalar_t* b, scalar_t* out, const DwArgs& a, int V,
                         int S, int64_t blocks, size_t smem, cudaStream_t stream);

// The staged stride-1 forward, when plan_nchw_s1 / plan_nhwc_s1 accept the
// shape (never float64); false otherwise, with nothing launched.
template <typename scalar_t>
bool try_forward_nchw_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         Activation act, cudaStream_t stream);
template <typename scalar_t>
bool try_forward_nhwc_s1(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op, const Geometry& g,
                         Activation act, cudaStream_t stream);

// The unstaged NCHW forward, when plan_nchw_direct takes the shape; false
// otherwise, with nothing launched.
template <typename scalar_t>
bool try_forward_nchw_direct(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op,
                             const Geometry& g, Activation act, cudaStream_t stream);

template <typename scalar_t>
bool try_forward_nhwc_direct(const scalar_t* xp, const scalar_t* wp, const scalar_t* bp, scalar_t* op,
                             const Geometry& g, Activation act, cudaStream_t stream);

// conv_dw_grad_input.cu: grad x by the gather or row kernels; grad_out and
// result (undefined: no ReLU mask) in x's format.
void depthwise_backward_input_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& w,
                                   at::Tensor& grad_x, const Geometry& g, bool nhwc);

// conv_dw_grad_weight.cu: grad weight and / or grad bias (either undefined:
// not computed).
void depthwise_backward_weight_cuda(const at::Tensor& grad_out, const at::Tensor& result, const at::Tensor& x,
                                    at::Tensor& grad_w, at::Tensor& grad_b, const Geometry& g, bool nhwc);

// conv_dw_grad_weight.cu: gw[k] / gb[k] (either may be null) from the
// splits' partial sums part[(k * splits + split) * 10 + t], added in a fixed
// order.
template <typename scalar_t>
void finish_weight_sums(const at::opmath_type<scalar_t>* part, scalar_t* gwp, scalar_t* gbp, int64_t K, int splits,
                        cudaStream_t stream);

// conv_dw_fused.cu: the fused NHWC backward (stride 1, padding 1,
// multiplier 1, not float64) into grad x and the weight / bias sums; rp: the
// fused ReLU's result, or null. False where it does not apply.
template <typename scalar_t>
bool try_backward_fused_nhwc(const scalar_t* gp, const scalar_t* rp, const scalar_t* xp, const scalar_t* wp,
                             scalar_t* gxp, scalar_t* gwp, scalar_t* gbp, const Geometry& g,
                             const at::TensorOptions& opts, cudaStream_t stream);

}  // namespace opforge::conv

// Explicit instantiations of a launcher template for the four float types:
// OPFORGE_DW_INSTANTIATE(F) with F(T) one instantiation for type T.
#define OPFORGE_DW_INSTANTIATE(F) F(float) F(double) F(c10::Half) F(c10::BFloat16)

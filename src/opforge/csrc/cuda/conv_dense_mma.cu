// Host side of the dense 3x3 and 1x1 tensor-core convolution: the NCHW ->
// NHWC transpose of a contiguous input, the tile choice, the checks of what
// the kernel takes, and the entry points. The kernel and its design:
// conv_dense_mma_kernel.cuh.
#include "cuda/conv_dense_mma.h"
#include "cuda/conv_dense_mma_kernel.cuh"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>
#include <torch/library.h>

#include <opforge/checks.h>
#include <opforge/cuda_launch.cuh>

// std::numeric_limits, std::optional, int64_t come with the ATen/c10 headers.

namespace {

using namespace opforge::conv::dense_mma;  // the kernel, Params and tile constants

// ---- NCHW -> NHWC for a contiguous input --------------------------------------
// out[n][p][c] = in[n][c][p] (p = h*W + w) through a 64x64 shared-memory tile:
// reads run along p, writes along c, both coalesced; rows padded by 4 bytes so
// the column reads are bank-conflict free. U is a same-size bit type.
constexpr int kTrTile = 64;
constexpr int kTrThreads = 256;

template <typename U>
__global__ void __launch_bounds__(kTrThreads)
    nchw_to_nhwc_kernel(const U* __restrict__ in, U* __restrict__ out, int C, int HW) {
  constexpr int kPad = 4 / static_cast<int>(sizeof(U));
  __shared__ U tile[kTrTile][kTrTile + kPad];
  const int p0 = blockIdx.x * kTrTile;
  const int c0 = blockIdx.y * kTrTile;
  const int64_t image = static_cast<int64_t>(blockIdx.z) * C * HW;
  const U* src = in + image;
  U* dst = out + image;
  for (int i = threadIdx.x; i < kTrTile * kTrTile; i += kTrThreads) {
    const int cl = i / kTrTile, pl = i % kTrTile;
    const int c = c0 + cl, p = p0 + pl;
    if (c < C && p < HW) tile[cl][pl] = src[static_cast<int64_t>(c) * HW + p];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTrTile * kTrTile; i += kTrThreads) {
    const int pl = i / kTrTile, cl = i % kTrTile;
    const int c = c0 + cl, p = p0 + pl;
    if (c < C && p < HW) dst[static_cast<int64_t>(p) * C + c] = tile[cl][pl];
  }
}

// x as a contiguous NHWC tensor: a view for a channels_last x, the tiled
// transpose for a contiguous (NCHW) x, ATen's copy for anything else.
at::Tensor to_nhwc(const at::Tensor& x) {
  const at::Tensor xp = x.permute({0, 2, 3, 1});
  if (xp.is_contiguous()) return xp;
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  if (!x.is_contiguous() || N > 65535 || (C + kTrTile - 1) / kTrTile > 65535 ||
      (HW + kTrTile - 1) / kTrTile > std::numeric_limits<int>::max() || C * HW > std::numeric_limits<int>::max()) {
    return xp.contiguous();
  }
  at::Tensor out = at::empty(xp.sizes(), x.options());
  const dim3 grid(static_cast<unsigned>((HW + kTrTile - 1) / kTrTile),
                  static_cast<unsigned>((C + kTrTile - 1) / kTrTile), static_cast<unsigned>(N));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (x.element_size() == 2) {
    nchw_to_nhwc_kernel<uint16_t><<<grid, kTrThreads, 0, stream>>>(static_cast<const uint16_t*>(x.data_ptr()),
                                                                   static_cast<uint16_t*>(out.data_ptr()),
                                                                   static_cast<int>(C), static_cast<int>(HW));
  } else {
    nchw_to_nhwc_kernel<uint32_t><<<grid, kTrThreads, 0, stream>>>(static_cast<const uint32_t*>(x.data_ptr()),
                                                                   static_cast<uint32_t*>(out.data_ptr()),
                                                                   static_cast<int>(C), static_cast<int>(HW));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

template <typename T, int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages>
void launch_cfg(Params p) {
  constexpr int smem = smem_bytes<kBM, kBN, kStages>();
  constexpr int threads = 32 * kWarpsM * kWarpsN;
  auto* kernel = &conv_dense_mma_kernel<T, kBM, kBN, kWarpsM, kWarpsN, kStages>;
  if constexpr (smem > 48 * 1024) {
    // Above the default 48 KB of dynamic shared memory. A host-side attribute
    // (no stream work, allowed during graph capture), set on every launch so
    // that every device gets it; it costs well under a microsecond.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  p.tiles_n = (p.K + kBN - 1) / kBN;
  const int64_t tiles_m = (static_cast<int64_t>(p.M) + kBM - 1) / kBM;
  const int64_t blocks = tiles_m * p.tiles_n;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tile choice (all warps 64x32 or 32x32, fp32 accumulators):
// - 128x128, 8 warps, 3 stages (60 KB, 2 CTAs per SM) when K > 64 and the
//   grid still gives every SM two CTAs: the most reuse per byte loaded
//   (bfloat16/float16 only);
// - 128x64, 4 warps, 3 stages (45 KB, 4 CTAs per SM) when that grid gives
//   every SM four CTAs;
// - else 64x64, 4 warps, 4 stages (40 KB): twice the CTAs for small problems
//   (fewer idle SMs, less tail);
// - 128x32, 4 warps along M, 3 stages (37.5 KB) when K <= 32 and the grid
//   still gives every SM a CTA: a layer with few output channels (1x1
//   projections) would leave most of a wider tile's columns idle.
//
// OPFORGE_CONV_MMA_TILE=128x128|128x64|64x64|128x32 forces one tile (benchmarking
// the choice; 128x128 is ignored for float32); unset or anything else: the
// rule above.
int forced_tile() {
  const auto v = c10::utils::get_env("OPFORGE_CONV_MMA_TILE");
  if (!v.has_value()) return 0;
  if (*v == "128x128") return 1;
  if (*v == "128x64") return 2;
  if (*v == "64x64") return 3;
  if (*v == "128x32") return 4;
  return 0;
}

template <typename T>
void launch(const Params& p) {
  const int forced = forced_tile();
  if constexpr (sizeof(T) == 2) {
    if (forced == 1) return launch_cfg<T, 128, 128, 2, 4, 3>(p);
  }
  if (forced == 2) return launch_cfg<T, 128, 64, 2, 2, 3>(p);
  if (forced == 3) return launch_cfg<T, 64, 64, 2, 2, 4>(p);
  if (forced == 4) return launch_cfg<T, 128, 32, 4, 1, 3>(p);
  const int64_t sms = opforge::cuda::sm_count();
  const auto blocks = [&](int64_t bm, int64_t bn) { return ((p.M + bm - 1) / bm) * ((p.K + bn - 1) / bn); };
  if (p.K <= 32 && blocks(128, 32) >= sms) {
    launch_cfg<T, 128, 32, 4, 1, 3>(p);
    return;
  }
  if constexpr (sizeof(T) == 2) {  // a staged float32 128x128 tile would not fit
    if (p.K > 64 && blocks(128, 128) >= 2 * sms) {
      launch_cfg<T, 128, 128, 2, 4, 3>(p);
      return;
    }
  }
  if (blocks(128, 64) >= 4 * sms) {
    launch_cfg<T, 128, 64, 2, 2, 3>(p);
  } else {
    launch_cfg<T, 64, 64, 2, 2, 4>(p);
  }
}

// act(conv(x, w) + bias) for an RxR kernel (R = w.size(2)), or false where
// this kernel does not take the case.
bool dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                       int64_t padding, opforge::Activation act, at::Tensor& out) {
  // ---- what this kernel handles; anything else goes back to the caller ----
  if (!x.is_cuda() || !w.is_cuda() || !out.is_cuda()) return false;
  const auto dtype = x.scalar_type();
  if (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat) return false;
  if (w.scalar_type() != dtype || out.scalar_type() != dtype) return false;
  if (bias.defined() && (!bias.is_cuda() || bias.scalar_type() != dtype)) return false;
  if (dtype == at::kFloat && !at::globalContext().allowTF32CuDNN(at::Float32Op::CONV)) return false;
  if (x.dim() != 4 || w.dim() != 4 || out.dim() != 4) return false;
  const int64_t R = w.size(2);
  if (w.size(1) != x.size(1) || w.size(3) != R || (R != 3 && R != 1)) return false;
  if (stride < 1 || stride > 2 || padding < 0 || padding > R / 2) return false;
  if (at::cuda::getCurrentDeviceProperties()->major < 8) return false;  // cp.async, bf16 mma

  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = w.size(0);
  const int64_t chunk = 16 / static_cast<int64_t>(x.element_size());
  if (C % chunk != 0) return false;  // a 16-byte chunk must not straddle a filter tap
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != K)) return false;
  if (H + 2 * padding < R || W + 2 * padding < R) return false;
  const int64_t Ho = (H + 2 * padding - R) / stride + 1;
  const int64_t Wo = (W + 2 * padding - R) / stride + 1;
  if (out.size(0) != N || out.size(1) != K || out.size(2) != Ho || out.size(3) != Wo) return false;
  if (out.numel() == 0) return true;

  // 32-bit index limits (offsets into x, w and out are 64-bit).
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const int64_t M = N * Ho * Wo;
  if (M > kIntMax - 128 || K > kIntMax - 128 || R * R * C > kIntMax || N > kIntMax || H > kIntMax / 4 ||
      W > kIntMax / 4)
    return false;

  bool out_nhwc;
  if (out.is_contiguous()) {
    out_nhwc = false;
  } else if (out.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    out_nhwc = true;
  } else {
    return false;
  }

  // NHWC activations (free for a channels_last x, one transpose pass for
  // NCHW) and (K, R, R, C) weights (tiny; a view for R = 1).
  const at::Tensor xl = to_nhwc(x);
  const at::Tensor wl = w.permute({0, 2, 3, 1}).contiguous();
  const at::Tensor bl = bias.defined() ? bias.contiguous() : bias;
  if (!opforge::cuda::is_aligned(xl.data_ptr(), 16) || !opforge::cuda::is_aligned(wl.data_ptr(), 16)) return false;
  if (!opforge::cuda::is_aligned(out.data_ptr(), 16)) return false;

  Params p;
  p.x = xl.data_ptr();
  p.w = wl.data_ptr();
  p.bias = bl.defined() ? bl.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.N = static_cast<int>(N);
  p.C = static_cast<int>(C);
  p.H = static_cast<int>(H);
  p.W = static_cast<int>(W);
  p.K = static_cast<int>(K);
  p.Ho = static_cast<int>(Ho);
  p.Wo = static_cast<int>(Wo);
  p.stride = static_cast<int>(stride);
  p.pad = static_cast<int>(padding);
  p.R = static_cast<int>(R);
  p.M = static_cast<int>(M);
  p.Kg = static_cast<int>(R * R * C);
  p.tiles_n = 0;  // set per tile configuration
  p.act = act;
  p.out_nhwc = out_nhwc;
  p.vec_store = out_nhwc && (K % chunk == 0);
  if (((M + 63) / 64) * ((K + 63) / 64) > kIntMax) return false;  // grid.x of the smallest tiles

  switch (dtype) {
    case at::kBFloat16:
      launch<__nv_bfloat16>(p);
      break;
    case at::kHalf:
      launch<__half>(p);
      break;
    default:
      launch<float>(p);
      break;
  }
  return true;
}

}  // namespace

namespace opforge::conv {

bool conv3x3_dense_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                               int64_t padding, Activation act, at::Tensor& out) {
  if (w.dim() != 4 || w.size(2) != 3 || w.size(3) != 3) return false;
  return dense_forward_mma(x, w, bias, stride, padding, act, out);
}

bool conv1x1_forward_mma(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                         Activation act, at::Tensor& out) {
  if (w.dim() != 4 || w.size(2) != 1 || w.size(3) != 1) return false;
  return dense_forward_mma(x, w, bias, stride, 0, act, out);
}

}  // namespace opforge::conv

// ---- test / benchmark entry: opforge_bench.conv_dense_mma -----------------------
// Runs the tensor-core path alone and raises when it declines the case, so
// tests and benchmarks know they measured this kernel and not a fallback.
namespace {

at::Tensor conv3x3_dense_mma_entry(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                   int64_t stride, int64_t padding, bool relu) {
  constexpr const char* op = "opforge_bench.conv_dense_mma";
  // The checks and the output's shape, shared with the shape function (conv.cpp).
  const std::vector<c10::SymInt> sizes = opforge::conv::check_dense_mma_args(x, w, bias, stride, padding);
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();

  const c10::cuda::CUDAGuard guard(x.device());
  const auto fmt = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? at::MemoryFormat::ChannelsLast
                                                                               : at::MemoryFormat::Contiguous;
  at::Tensor out = at::empty_symint(sizes, x.options().memory_format(fmt));
  if (out.numel() == 0) return out;
  const bool done = opforge::conv::conv3x3_dense_forward_mma(
      x, w, b, stride, padding, relu ? opforge::Activation::Relu : opforge::Activation::None, out);
  TORCH_CHECK(done, op, ": the tensor-core path declines this case (dtype ", opforge::dtype_name(x.scalar_type()),
              ", C=", opforge::num(x.size(1)),
              "; it needs bfloat16/float16 with C % 8 == 0, or float32 with C % 4 == 0 and TF32 allowed for "
              "cuDNN convolutions, on sm_80 or newer)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge_bench, CUDA, m) { m.impl("conv_dense_mma", &conv3x3_dense_mma_entry); }

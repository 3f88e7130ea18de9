// Input gradient dX[T, K] = dY[T, R] @ W^T for a V:2:M weight on Hopper (wgmma, sm_90a), reducing over each V
// block's kept columns only: the "condensed" dX (docs/kernel-notes.md, session 24).
//
// Math view.  Inside one V block b (rows r of A = W^T in [bV, (b+1)V)) every group keeps the same 4 columns, so
//   P_b[t, c] = sum_{r in b} dY[t, r] * Wc[r, c]              (c = 4g + p: the block's condensed columns)
// is a dense product over V (Wc: the condensed weight, 2 of each 4 non-zero), and
//   dX[t, g*M + cols[b, g, p]] += P_b[t, 4g + p].
// The scatter is itself a product: per 4 groups (16 condensed columns, one k16 step) dX[:, 4M columns] +=
// P_b[:, 16] @ S_b (a 16 x 4M one-hot matrix built from `columns`), so P_b never leaves the registers: the
// accumulator of the first wgmma (m64n64k16 over the V rows, A = dY and B = Wc from shared memory) is rounded to
// the input dtype and becomes the register A operand of the second (m64n64k16, B = S_b from shared memory), whose
// accumulators hold the CTA's whole dX tile for the whole reduction.  Work: 4/M of the dense product for the first
// and 16/V of it for the second (M = 16, V = 128: 3/8 of the dense product's MMAs); no shared-memory
// read-modify-write, no atomics, no dense W, no transpose.
//
// Tiles: CTA = 128 tokens (two consumer warpgroups of 64) x 16 groups (256 output columns at M = 16), looping
// over the R/V blocks.  Per block, one pipeline stage (thread 0 issues TMA, 3 stages, two blocks ahead): dY
// [128 t][V r] (K-major 128-byte-swizzled boxes of 64 r), Wc [V r][64 c] (MN-major) and S [64 c][4M k] (MN-major,
// four 16-row chunks).  P_b is rounded to the input dtype before the scatter (relative error about 2^-9 per
// block's partial sum, accumulated in float32).  Only M = 16 is built (GEMM1 and GEMM2 both n64); V in {64, 128}.
#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"
#include "wgmma.cuh"

namespace jaxsparse {
namespace {

struct DxCondensedParams {
  void* dx;  // [T, K]
  int tokens, k, rows, groups;
};

constexpr int kDcM = 16;                 // the one group width built
constexpr int kDcBT = 128;               // tokens per CTA (two warpgroups of 64)
constexpr int kDcGC = 16;                // groups per CTA
constexpr int kDcNC = 4 * kDcGC;         // condensed columns per CTA (GEMM1's N)
constexpr int kDcChunks = kDcNC / 16;    // k16 scatter steps per block
constexpr int kDcN2 = 4 * kDcM;          // output columns per scatter step (GEMM2's N)
constexpr int kDcThreads = 256;
constexpr int kDcStages = 3;
constexpr int kDcMaxV = 128;
constexpr int kDcDyBox = kDcBT * 128;                // [128 t][64 r] of 16-bit values
constexpr int kDcWcOff = (kDcMaxV / 64) * kDcDyBox;  // Wc [V r][64 c]
constexpr int kDcSOff = kDcWcOff + kDcMaxV * 128;    // S [64 c][4M k]
constexpr int kDcStageBytes = kDcSOff + kDcNC * kDcN2 * 2;
constexpr int kDcBarOff = kDcStages * kDcStageBytes;
constexpr int kDcSmemBytes = kDcBarOff + 8 * kDcStages + 1024;
static_assert(kDcN2 == 64 && kDcNC == 64, "GEMM1 and GEMM2 are m64n64k16");
static_assert(kDcWcOff % 1024 == 0 && kDcSOff % 1024 == 0 && kDcStageBytes % 1024 == 0, "swizzle atoms");

template <typename T, int V>
__global__ void __launch_bounds__(kDcThreads, 1)
    DxCondensedKernel(const DxCondensedParams p, const __grid_constant__ CUtensorMap tma_dy,
                      const __grid_constant__ CUtensorMap tma_wc, const __grid_constant__ CUtensorMap tma_s) {
#ifdef JAXSPARSE_WGMMA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + kDcBarOff;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2;
  const int tok0 = blockIdx.x * kDcBT;
  const int g0 = blockIdx.y * kDcGC;
  constexpr int dy_boxes = V / 64;
  const int blocks = p.rows / V;
  const int chunks_per_block = p.groups / 4;  // 16-row chunks of S per V block

  if (tid == 0)
    for (int s = 0; s < kDcStages; ++s) MbarInit(full0 + 8 * s, 1);
  __syncthreads();

  // Block b into stage buffer `buf`: dY columns [bV, bV + V) of the CTA's tokens, Wc rows [bV, bV + V) x the CTA's
  // condensed columns, S rows of the CTA's chunks.  Out-of-range tokens, condensed columns and chunk rows arrive as
  // zeros (the zero condensed columns make P_b zero where a chunk row belongs to another block).
  auto load_block = [&](int buf, int b) {
    const uint32_t base = smem_base + buf * kDcStageBytes, full = full0 + 8 * buf;
    MbarArriveExpectTx(full, dy_boxes * kDcDyBox + V * 128 + kDcNC * kDcN2 * 2);
#pragma unroll
    for (int h = 0; h < dy_boxes; ++h) TmaLoad2d(base + h * kDcDyBox, &tma_dy, b * V + 64 * h, tok0, full);
    TmaLoad2d(base + kDcWcOff, &tma_wc, 4 * g0, b * V, full);
    TmaLoad2d(base + kDcSOff, &tma_s, 0, (b * chunks_per_block + g0 / 4) * 16, full);
  };

  float acc[kDcChunks][kDcN2 / 2];  // this warpgroup's [64 t][256 k] tile of dX
#pragma unroll
  for (int q = 0; q < kDcChunks; ++q)
#pragma unroll
    for (int i = 0; i < kDcN2 / 2; ++i) acc[q][i] = 0.f;
  float pacc[kDcNC / 2];
  uint32_t afrag[kDcChunks][4];

  if (tid == 0)
    for (int s = 0; s < kDcStages - 1 && s < blocks; ++s) load_block(s, s);

  for (int b = 0; b < blocks; ++b) {
    const int buf = b % kDcStages;
    const uint32_t base = smem_base + buf * kDcStageBytes;
    MbarWait(full0 + 8 * buf, (b / kDcStages) & 1);

    // GEMM1: P_b [64 t][64 c] = dY [64 t][V r] @ Wc [V r][64 c].
#pragma unroll
    for (int i = 0; i < kDcNC / 2; ++i) pacc[i] = 0.f;
    WgmmaFenceOperands(pacc);
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < V / 16; ++ks) {
      const uint32_t a_addr = base + (ks / 4) * kDcDyBox + wg * (kDcDyBox / 2) + (ks % 4) * 32;
      const uint64_t da = WgmmaDescSw128(a_addr, 16, 1024);
      const uint64_t db = WgmmaDescSw128(base + kDcWcOff + ks * 2048, V * 128, 1024);
      Wgmma<kDcNC, T, 1, 0>::Run(pacc, da, db);
    }
    WgmmaCommit();
    WgmmaWait<0>();  // this block's GEMM1 and the previous block's scatter of this warpgroup completed
    WgmmaFenceOperands(pacc);
#pragma unroll
    for (int q = 0; q < kDcChunks; ++q) {
      WgmmaFenceOperands(acc[q]);
      WgmmaFenceOperands(afrag[q]);  // the previous scatter read them until now
    }

    // Both warpgroups are past the previous block's wgmmas: its buffer takes block b + stages - 1.
    __syncthreads();
    if (tid == 0 && b + kDcStages - 1 < blocks) load_block((b + kDcStages - 1) % kDcStages, b + kDcStages - 1);

    // P_b's accumulators are the A fragments of the scatter (register i of m64nN: row gid (+8 for i % 4 >= 2),
    // column 8 (i / 4) + 2 tig + i % 2; the k16 A fragment of columns 16q .. 16q + 15 is registers 8q .. 8q + 7).
#pragma unroll
    for (int q = 0; q < kDcChunks; ++q)
#pragma unroll
      for (int j = 0; j < 4; ++j) afrag[q][j] = PackPair<T>(pacc[8 * q + 2 * j], pacc[8 * q + 2 * j + 1]);

    // GEMM2: dX [64 t][4M k of chunk q] += P_b [64 t][16 c of chunk q] @ S_b [16 c][4M k].
    WgmmaFence();
#pragma unroll
    for (int q = 0; q < kDcChunks; ++q) {
      const uint64_t ds = WgmmaDescSw128(base + kDcSOff + q * 2048, kDcNC * 128, 1024);
      WgmmaRs<kDcN2, T, 1>::Run(acc[q], afrag[q], ds);
    }
    WgmmaCommit();
  }
  WgmmaWait<0>();
#pragma unroll
  for (int q = 0; q < kDcChunks; ++q) {
    WgmmaFenceOperands(acc[q]);
    WgmmaFenceOperands(afrag[q]);
  }

  // Epilogue: register i of chunk q is dX[row, k0 + 4M q + 8 (i / 4) + 2 tig + i % 2], row = 16 w + gid (+ 8).
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const int gid = lane >> 2, tig = lane & 3;
  const int row_a = tok0 + 64 * wg + 16 * (warp & 3) + gid;
  const int k0 = g0 * kDcM;
#pragma unroll
  for (int q = 0; q < kDcChunks; ++q)
#pragma unroll
    for (int i = 0; i < kDcN2 / 2; i += 2) {
      const int row = row_a + 8 * ((i / 2) % 2);
      const int col = k0 + kDcN2 * q + 8 * (i / 4) + 2 * tig;
      if (row < p.tokens && col < p.k)
        *reinterpret_cast<uint32_t*>(dx + static_cast<int64_t>(row) * p.k + col) = PackPair<T>(acc[q][i], acc[q][i + 1]);
    }
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// ---------------------------------------------------------------- host side

template <typename T, int V>
ffi::Error Launch(cudaStream_t stream, const DxCondensedParams& p, const ffi::AnyBuffer& dy, const ffi::AnyBuffer& wc,
                  const ffi::AnyBuffer& scatter) {
  constexpr auto kernel = DxCondensedKernel<T, V>;
  if (!Sm90aImageLoaded<kernel>())
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t_condensed needs an sm_90a build on a Hopper GPU");
  if (ffi::Error e = RaiseSmemLimit<kernel>(kDcSmemBytes, "cudaFuncSetAttribute(DxCondensedKernel)"); e.failure())
    return e;
  CUtensorMap tma_dy{}, tma_wc{}, tma_s{};
  if (!MakeTensorMap2d(&tma_dy, dy.untyped_data(), p.tokens, p.rows, kDcBT) ||
      !MakeTensorMap2d(&tma_wc, wc.untyped_data(), p.rows, 4 * static_cast<uint64_t>(p.groups), V) ||
      !MakeTensorMap2d(&tma_s, scatter.untyped_data(), Dim(scatter, 0), kDcN2, kDcNC))
    return ffi::Error::Internal("jaxsparse_spmm_t_condensed: cuTensorMapEncodeTiled failed");
  dim3 grid((p.tokens + kDcBT - 1) / kDcBT, (p.groups + kDcGC - 1) / kDcGC);
  kernel<<<grid, kDcThreads, kDcSmemBytes, stream>>>(p, tma_dy, tma_wc, tma_s);
  return LastLaunchError("DxCondensedKernel");
}

ffi::Error DxCondensedImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer wc, ffi::AnyBuffer scatter,
                           ffi::Result<ffi::AnyBuffer> out, int32_t v, int32_t m) {
  const char* name = "jaxsparse_spmm_t_condensed";
  if (dy.dimensions().size() != 2 || wc.dimensions().size() != 2 || scatter.dimensions().size() != 2 ||
      out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": dy, wc, scatter and output must be 2-D");
  if (m != kDcM || (v != 64 && v != 128))
    return ffi::Error::InvalidArgument(std::string(name) + ": built for M = 16 and V in {64, 128}, got V = " +
                                       std::to_string(v) + ", M = " + std::to_string(m));
  const int64_t tokens = Dim(dy, 0), rows = Dim(dy, 1), groups = Dim(wc, 1) / 4, k = out->dimensions()[1];
  if (Dim(wc, 0) != rows || Dim(wc, 1) % 4 || k != groups * m || out->dimensions()[0] != tokens || rows % v ||
      groups % 8 || Dim(scatter, 0) != rows / v * (groups / 4) * 16 || Dim(scatter, 1) != 4 * m)
    return ffi::Error::InvalidArgument(std::string(name) + ": inconsistent shapes: dy " + ShapeString(dy) + ", wc " +
                                       ShapeString(wc) + ", scatter " + ShapeString(scatter) + ", out " +
                                       ShapeString(*out) + " for V = " + std::to_string(v));
  const auto dt = dy.element_type();
  if (wc.element_type() != dt || scatter.element_type() != dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument(std::string(name) + ": dy, wc, scatter and output must share one dtype");
  if (tokens == 0 || k == 0) return ffi::Error::Success();
  if (tokens >= (int64_t(1) << 30) || k >= (int64_t(1) << 30) || rows >= (int64_t(1) << 30))
    return ffi::Error::InvalidArgument(std::string(name) + ": shape too large");
  if (rows == 0) return CudaError(cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream), name);

  DxCondensedParams p;
  p.dx = out->untyped_data();
  p.tokens = static_cast<int>(tokens);
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);
  p.groups = static_cast<int>(groups);
  if (dt == ffi::BF16)
    return v == 64 ? Launch<__nv_bfloat16, 64>(stream, p, dy, wc, scatter) : Launch<__nv_bfloat16, 128>(stream, p, dy, wc, scatter);
  if (dt == ffi::F16) return v == 64 ? Launch<__half, 64>(stream, p, dy, wc, scatter) : Launch<__half, 128>(stream, p, dy, wc, scatter);
  return ffi::Error::InvalidArgument(std::string(name) + ": dy must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSpmmTCondensed, jaxsparse::DxCondensedImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // dy [T, R]
                                  .Arg<xla::ffi::AnyBuffer>()  // wc [R, 4G] (format.condensed_dx_operands)
                                  .Arg<xla::ffi::AnyBuffer>()  // scatter [(R/V)(G/4)16, 4M]
                                  .Ret<xla::ffi::AnyBuffer>()  // dx [T, K]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);

// Forward SpMM  Y[T, R] = act(X[T, K] @ W[K, R] + bias[R])  with W a compressed V:2:M SparseWeight
// (layout: docs/format.md).  Design notes and measurements: docs/kernel-notes.md.
//
// Math view: A = W^T [R, K] is the sparse row-major left operand of Y^T = A X^T; X [T, K] row-major is
// already the K-contiguous ("col") B operand, so nothing is transposed.  For M > 4 every V-row block
// keeps the same 4 columns of each M-group, so for a tile of rows inside one V block the B operand is a
// gather of 4 columns per M-group of X; after the gather it is a plain 2:4 product over the condensed
// reduction K' = 4G with the stored metadata, run on mma.sp.m16n8k32 (sm_80 and sm_90a).
//
// Tile: BM rows of A (output features) x BN tokens, 8 groups (32 condensed k, one metadata word per
// row) per pipeline stage, STAGES-deep cp.async pipeline.  Per stage the block copies
//   A values [BM, 16] (32 B per row), metadata [BM] words, the stage's 8 column words (M > 4), and the
//   dense X slab [BN, 8M] (the gather happens from shared memory into registers).
// Warps tile BM x BN as (BM/WM) x (BN/WN); a warp owns WM/16 x WN/8 m16n8 accumulator tiles.
// Epilogue: + bias, optional activation (GELU tanh or erf, ReLU: Activate in mma_common.cuh), convert,
// stage through shared memory as [BN, BM] and write Y with 16-byte row-contiguous stores (tails masked).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdlib>

#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"

namespace jaxsparse {
namespace {

struct SpmmParams {
  const void* x;          // [T, K]
  const void* values;     // [R, 2G]
  const uint8_t* cols;    // [R/V, G, 4] or null (M = 4)
  const uint32_t* meta;   // [R, G/8]
  const void* bias;       // [R] or null
  void* y;                // [T, R]
  int tokens, k, rows, groups, v;
  int bias_f32;           // bias is float32 (else the input dtype)
  int activation;         // 0 none, 1 gelu (tanh), 2 gelu_erf, 3 relu (Activate)
  int meta_mode;          // metadata fragment layout: 0 = half-rows (default), 1 = whole rows (see MetaWord)
};

// Shared-memory geometry of one pipeline stage.
template <int M, int BM, int BN, int GS>
struct StageLayout {
  static constexpr int kARowBytes = 4 * GS + 16;        // 2 values per group + 16 B pad: conflict-free ldmatrix
  static constexpr int kXRowBytes = 2 * GS * M + 16;    // GS groups of M values + 16 B pad
  static constexpr int kABytes = BM * kARowBytes;
  static constexpr int kEBytes = BM * 4 * (GS / 8);     // [BM][GS/8] metadata words
  static constexpr int kCBytes = 4 * GS * (BM / 64);    // column words of each 64-row block of the tile
  static constexpr int kXBytes = BN * kXRowBytes;
  static constexpr int kAOff = 0;
  static constexpr int kEOff = kAOff + kABytes;
  static constexpr int kCOff = kEOff + kEBytes;
  static constexpr int kXOff = kCOff + kCBytes;
  static constexpr int kBytes = kXOff + kXBytes;  // multiple of 16
  static_assert(kBytes % 16 == 0, "stage must keep 16-byte alignment");
};

template <int M, int BM, int BN, int GS, int STAGES>
constexpr int SmemBytes() {
  using L = StageLayout<M, BM, BN, GS>;
  constexpr int pipe = STAGES * L::kBytes;
  constexpr int epi = BN * (BM * 2 + 16);
  return pipe > epi ? pipe : epi;
}

template <typename T, int M, int BM, int BN, int WM, int WN, int GS, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MIN_BLOCKS)
    SpmmKernel(const SpmmParams p) {
  using L = StageLayout<M, BM, BN, GS>;
  constexpr int kWarpsM = BM / WM, kWarpsN = BN / WN;
  constexpr int kThreads = kWarpsM * kWarpsN * 32;
  constexpr int MI = WM / 16, NI = WN / 8;
  constexpr int KS = GS / 8;  // mma k-steps (32 condensed k, one metadata word) per stage
  static_assert(WM % 16 == 0 && WN % 8 == 0 && GS % 8 == 0, "tile");
  static_assert(64 % WM == 0 && BM % 64 == 0, "a warp's rows must lie in one 64-row block");

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t smem_base = SmemAddr(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % kWarpsM, warp_n = warp / kWarpsM;
  const int gid = lane >> 2, tig = lane & 3;

  const int row0 = blockIdx.x * BM;    // first output feature of the tile
  const int tok0 = blockIdx.y * BN;    // first token of the tile
  const int groups = p.groups;
  const int num_kt = (groups + GS - 1) / GS;  // the last stage may hold fewer than GS groups (8-group steps)

  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ values = static_cast<const T*>(p.values);
  const int meta_stride = groups / 8;

  // ---- per-thread copy assignments, fixed across stages (only the k offset moves).
  // X slab: BN rows x kXCpr 16-byte chunks; kThreads is a multiple of kXCpr, so a thread keeps its chunk
  // column and walks rows with a fixed stride.
  constexpr int kXCpr = 2 * GS * M / 16;
  static_assert(kThreads % kXCpr == 0 && (BN * kXCpr) % kThreads == 0, "X copy split");
  constexpr int kXIters = BN * kXCpr / kThreads, kXRowStep = kThreads / kXCpr;
  const int x_c = tid % kXCpr, x_t = tid / kXCpr;
  const T* x_src0 = x + static_cast<int64_t>(min(tok0 + x_t, p.tokens - 1)) * p.k + x_c * 8;
  const int64_t x_step = static_cast<int64_t>(kXRowStep) * p.k;
  uint32_t x_valid = 0;
#pragma unroll
  for (int it = 0; it < kXIters; ++it) x_valid |= (tok0 + x_t + it * kXRowStep < p.tokens ? 1u : 0u) << it;
  const uint32_t x_dst0 = L::kXOff + x_t * L::kXRowBytes + x_c * 16;
  // A values: BM rows x kACpr chunks (8 values = 4 groups each).
  constexpr int kACpr = GS / 4;
  constexpr int kAChunks = BM * kACpr;
  constexpr int kAIters = (kAChunks + kThreads - 1) / kThreads;
  static_assert(kThreads % kACpr == 0, "A copy split");
  const int a_c = tid % kACpr, a_r = tid / kACpr;
  const T* a_src0 = values + static_cast<int64_t>(row0 + a_r) * (2 * groups) + a_c * 8;
  const int64_t a_step = static_cast<int64_t>(kThreads / kACpr) * (2 * groups);
  const uint32_t a_dst0 = L::kAOff + a_r * L::kARowBytes + a_c * 16;
  // Metadata: BM rows x KS words.
  constexpr int kEWords = BM * KS;
  constexpr int kEIters = (kEWords + kThreads - 1) / kThreads;
  const int e_c = tid % KS, e_r = tid / KS;
  const uint32_t* e_src0 = p.meta + static_cast<int64_t>(row0 + e_r) * meta_stride + e_c;
  const int64_t e_step = static_cast<int64_t>(kThreads / KS) * meta_stride;
  const uint32_t e_dst0 = L::kEOff + (e_r * KS + e_c) * 4;
  // Column words: GS/4 chunks of 16 B per 64-row block of the tile (a V = 64 block each; with V = 128 both
  // blocks of a 128-row tile read the same words).  Thread c_blk*GS/4 + c_chunk copies one chunk.
  constexpr int kCChunks = (GS / 4) * (BM / 64);
  const int c_blk = tid / (GS / 4), c_chunk = tid % (GS / 4);
  const uint8_t* c_src0 =
      (M > 4 && tid < kCChunks) ? p.cols + static_cast<int64_t>((row0 + 64 * c_blk) / p.v) * groups * 4 + c_chunk * 16
                                : nullptr;

  auto load_stage = [&](int buf, int kt) {
    const uint32_t base = smem_base + buf * L::kBytes;
    const int g0 = kt * GS;
    const int steps_valid = min(KS, (groups - g0) / 8);
#pragma unroll
    for (int it = 0; it < kAIters; ++it) {
      if (kAChunks % kThreads == 0 || it * kThreads + tid < kAChunks) {
        if (a_c / 2 < steps_valid)
          CpAsync16(base + a_dst0 + it * (kThreads / kACpr) * L::kARowBytes, a_src0 + it * a_step + 2 * g0, 16);
      }
    }
#pragma unroll
    for (int it = 0; it < kEIters; ++it) {
      if (kEWords % kThreads == 0 || it * kThreads + tid < kEWords) {
        if (e_c < steps_valid)
          CpAsync4(base + e_dst0 + it * (kThreads / KS) * KS * 4, e_src0 + it * e_step + g0 / 8);
      }
    }
    if (M > 4 && tid < kCChunks && c_chunk / 2 < steps_valid) CpAsync16(base + L::kCOff + tid * 16, c_src0 + g0 * 4, 16);
#pragma unroll
    for (int it = 0; it < kXIters; ++it) {
      // chunk x_c covers groups (x_c*8)/M ..: valid while inside the stage's valid k-steps
      if ((x_c * 8) / (8 * M) < steps_valid)
      {
        const bool ok = (x_valid >> it) & 1;  // token tail: zero-fill from a safe address
        CpAsync16(base + x_dst0 + it * kXRowStep * L::kXRowBytes, ok ? x_src0 + it * x_step + g0 * M : x, ok ? 16 : 0);
      }
    }
  };

  float acc[MI][NI][4];
  ZeroAccumulators(acc);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_kt) load_stage(s, s);
    CpAsyncCommit();
  }

  // Per-lane ldmatrix row/column for A (16 x 16 compressed: matrices rows 0-7/8-15 x cols 0-7/8-15).
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_col_bytes = (lane >> 4) * 16;
  // Per-lane ldmatrix row/k-chunk for B when M == 4 (matrix j = k chunk 8j..8j+7 of 8 tokens).
  const int b_row = lane & 7;
  const int b_chunk = lane >> 3;
  const int p0 = 2 * (tig & 1);  // gather: positions p0, p0 + 1 of group 2j + tig/2 in register j

  for (int kt = 0; kt < num_kt; ++kt) {
    CpAsyncWait<STAGES - 2>();
    __syncthreads();
    {
      const int next = kt + STAGES - 1;
      if (next < num_kt) load_stage(next % STAGES, next);
      CpAsyncCommit();
    }
    const uint32_t base = smem_base + (kt % STAGES) * L::kBytes;
    const unsigned char* sbase = smem + (kt % STAGES) * L::kBytes;
    const int steps_valid = min(KS, (groups - kt * GS) / 8);

#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      if (KS > 1 && ks >= steps_valid) break;
      // A fragments and metadata.
      uint32_t a[MI][4];
      uint32_t e[MI];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int r = warp_m * WM + mi * 16;
        LdMatrixX4(a[mi], base + L::kAOff + (r + a_row) * L::kARowBytes + ks * 32 + a_col_bytes);
        const uint32_t* ew = reinterpret_cast<const uint32_t*>(sbase + L::kEOff);
        e[mi] = MetaWord(ew[(r + gid) * KS + ks], ew[(r + gid + 8) * KS + ks], tig, p.meta_mode);
      }

      // B fragments: condensed k = 8j + 2*tig + {0, 1} of token gid.
      uint32_t b[NI][4];
      if constexpr (M == 4) {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int t = warp_n * WN + ni * 8 + b_row;
          LdMatrixX4(b[ni], base + L::kXOff + t * L::kXRowBytes + ks * 64 + b_chunk * 16);
        }
      } else {
        // Element offsets (within a token row of the slab) of the two dense columns behind each register.
        // This warp's rows lie in one 64-row block (WM <= 64): its V block's column words.
        const uint32_t* cw = reinterpret_cast<const uint32_t*>(sbase + L::kCOff) + ((warp_m * WM) / 64) * GS;
        uint32_t off0[4], off1[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int g = ks * 8 + 2 * j + (tig >> 1);
          const uint32_t w = cw[g] >> (8 * p0);  // 4 ascending column bytes of group g
          off0[j] = g * M + (w & 0xFF);
          off1[j] = g * M + ((w >> 8) & 0xFF);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const uint16_t* rowp =
              reinterpret_cast<const uint16_t*>(sbase + L::kXOff + (warp_n * WN + ni * 8 + gid) * L::kXRowBytes);
#pragma unroll
          for (int j = 0; j < 4; ++j) b[ni][j] = static_cast<uint32_t>(rowp[off0[j]]) | (static_cast<uint32_t>(rowp[off1[j]]) << 16);
        }
      }

#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) MmaSp<T>::Run(acc[mi][ni], a[mi], b[ni], e[mi]);
    }
  }

  // ---------------------------------------------------------------- epilogue
  CpAsyncWait<0>();
  __syncthreads();  // every warp is done with the pipeline buffers: reuse them as the output tile
  constexpr int kYRowBytes = BM * 2 + 16;  // [BN tokens][BM features] + pad
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    const int r_lo = warp_m * WM + mi * 16 + gid;  // tile-local feature rows r_lo, r_lo + 8
    const float bias_lo = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo);
    const float bias_hi = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo + 8);
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int t = warp_n * WN + ni * 8 + 2 * tig;  // tile-local tokens t, t + 1
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int rr = r_lo + (q >> 1) * 8;
        const int tt = t + (q & 1);
        float vq = acc[mi][ni][q] + ((q >> 1) ? bias_hi : bias_lo);
        vq = Activate(p.activation, vq);
        reinterpret_cast<T*>(smem + tt * kYRowBytes)[rr] = FromFloat<T>(vq);
      }
    }
  }
  __syncthreads();
  StoreStagedTile<T, BN, BM, kThreads>(smem, kYRowBytes, static_cast<T*>(p.y), p.tokens, p.rows, tok0, row0, threadIdx.x);
}

// ---------------------------------------------------------------- host side

template <typename T, int M, int BM, int BN, int WM, int WN, int GS, int STAGES, int MIN_BLOCKS>
ffi::Error LaunchConfig(cudaStream_t stream, const SpmmParams& p) {
  constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  constexpr int kSmem = SmemBytes<M, BM, BN, GS, STAGES>();
  constexpr auto kernel = SpmmKernel<T, M, BM, BN, WM, WN, GS, STAGES, MIN_BLOCKS>;
  if (ffi::Error e = RaiseSmemLimit<kernel>(kSmem, "cudaFuncSetAttribute(SpmmKernel)"); e.failure()) return e;
  dim3 grid(p.rows / BM, (p.tokens + BN - 1) / BN);
  kernel<<<grid, kThreads, kSmem, stream>>>(p);
  return LastLaunchError("SpmmKernel");
}

// Tile table.  For M > 4 every warp's rows lie in one V block (WM = 64 divides V); BN shrinks for M = 32, whose dense
// X slab (8 groups x 32 columns per token) would otherwise not fit several stages.
template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const SpmmParams& p, int m, int sm_count) {
  const int64_t tiles_n = (p.tokens + 127) / 128;
  // BM = 128 when the rows and V allow it and it still fills the GPU; else BM = 64.
  // V = 64 takes 128-row tiles too: each warp gathers with its own block's columns from the shared X slab.
  const bool can128 = p.rows % 128 == 0;
  const bool use128 = can128 && (static_cast<int64_t>(p.rows / 128) * tiles_n >= sm_count);
  // <T, M, BM, BN, WM, WN, groups per stage, stages, min blocks per SM>: two blocks per SM everywhere.
  switch (m) {
    case 4:
      return use128 ? LaunchConfig<T, 4, 128, 128, 64, 32, 16, 3, 2>(stream, p)
                    : LaunchConfig<T, 4, 64, 128, 64, 32, 16, 3, 2>(stream, p);
    case 8:
      return use128 ? LaunchConfig<T, 8, 128, 128, 64, 32, 8, 4, 2>(stream, p)
                    : LaunchConfig<T, 8, 64, 128, 64, 32, 8, 4, 2>(stream, p);
    case 16:
      return use128 ? LaunchConfig<T, 16, 128, 64, 64, 16, 8, 3, 2>(stream, p)
                    : LaunchConfig<T, 16, 64, 64, 64, 16, 8, 3, 2>(stream, p);
    case 32:
      return use128 ? LaunchConfig<T, 32, 128, 64, 64, 16, 8, 2, 2>(stream, p)
                    : LaunchConfig<T, 32, 64, 64, 64, 16, 8, 2, 2>(stream, p);
    default:
      return ffi::Error::InvalidArgument("jaxsparse_spmm: M must be 4, 8, 16 or 32, got " + std::to_string(m));
  }
}

int MetaMode() {
  static int mode = [] {
    const char* s = std::getenv("JAXSPARSE_SPMM_META_MODE");
    return (s != nullptr && s[0] == '1') ? 1 : 0;
  }();
  return mode;
}

ffi::Error SpmmImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                    ffi::Buffer<ffi::U32> metadata, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int32_t v,
                    int32_t m, int32_t activation) {
  if (x.dimensions().size() != 2 || values.dimensions().size() != 2 || metadata.dimensions().size() != 2 ||
      out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_spmm: x, values, metadata and output must be 2-D");
  const int64_t tokens = Dim(x, 0), k = Dim(x, 1), rows = Dim(values, 0), groups = Dim(values, 1) / 2;
  if (ffi::Error e = CheckSparseWeight("jaxsparse_spmm", rows, groups, columns, metadata, v, m); e.failure()) return e;
  if (k != groups * m || out->dimensions()[0] != tokens || out->dimensions()[1] != rows || rows % 64)
    return ffi::Error::InvalidArgument("jaxsparse_spmm: inconsistent shapes: x " + ShapeString(x) + ", values " +
                                       ShapeString(values) + ", metadata " + ShapeString(metadata) + ", out " +
                                       ShapeString(*out));
  const auto dt = x.element_type();
  if (values.element_type() != dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument("jaxsparse_spmm: x, values and output must share one dtype");
  if (ffi::Error e = CheckEpilogue("jaxsparse_spmm", bias, rows, dt, activation); e.failure()) return e;
  const bool has_bias = bias.element_count() > 0;
  if (tokens == 0 || rows == 0) return ffi::Error::Success();
  if (tokens > static_cast<int64_t>(65535) * 64 || k >= (int64_t(1) << 30) || rows >= (int64_t(1) << 30))
    return ffi::Error::InvalidArgument("jaxsparse_spmm: shape too large");

  SpmmParams p;
  p.x = x.untyped_data();
  p.values = values.untyped_data();
  p.cols = m > 4 ? columns.typed_data() : nullptr;
  p.meta = metadata.typed_data();
  p.bias = has_bias ? bias.untyped_data() : nullptr;
  p.y = out->untyped_data();
  p.tokens = static_cast<int>(tokens);
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);
  p.groups = static_cast<int>(groups);
  p.v = v;
  p.bias_f32 = has_bias && bias.element_type() == ffi::F32;
  p.activation = activation;
  p.meta_mode = MetaMode();
  if (dt == ffi::BF16) return Dispatch<__nv_bfloat16>(stream, p, m, SmCount());
  if (dt == ffi::F16) return Dispatch<__half>(stream, p, m, SmCount());
  return ffi::Error::InvalidArgument("jaxsparse_spmm: x must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSpmm, jaxsparse::SpmmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x [T, K]
                                  .Arg<xla::ffi::AnyBuffer>()               // values [R, 2G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .Arg<xla::ffi::AnyBuffer>()               // bias [R] or [0]
                                  .Ret<xla::ffi::AnyBuffer>()               // y [T, R]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m")
                                  .Attr<int32_t>("activation"),
                              JAXSPARSE_GRAPH_SAFE);

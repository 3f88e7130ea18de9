// SDDMM: the weight gradient of y = x @ W sampled at W's kept positions, written straight into the
// compressed values layout (docs/format.md):
//   dvalues[r, 2g+j] = sum_t x[t, g*M + col(r, g, j)] * dy[t, r],   fp32 accumulation over all tokens.
// No dense [K, R] gradient is formed.  Design notes: docs/kernel-notes.md ("Backward kernels", "Session 3").
//
// Two engines (attribute `engine`: 0 auto, 1 mma.sync, 2 wgmma): SddmmKernel below (mma.sync, any GPU
// from sm_80, 64-row tiles) and SddmmWgmmaKernel (Hopper warpgroup MMAs, sm_90a, 128-row tiles, M in
// {4, 8, 16}, R % 128 == 0), which auto picks where its sm_90a image runs.  A third, SddmmWgmmaXtKernel,
// reads x^T [K, T] (attribute x_layout = 1, made by jaxsparse_transpose): its kept columns are contiguous
// rows, copied by cp.async with no gather pass (docs/kernel-notes.md, "Session 4").
//
// Math view: for a tile of BR = 64 rows inside one V block (so one column set per group) and GC groups,
//   C[r, 4*gl + p] = sum_t dy[t, r] * x[t, (g0+gl)*M + cols[blk, g0+gl, p]]      (p = 0..3)
// is a dense product dy^T [BR x T] @ Xc [T x 4GC] (Xc = the block's 4 gathered columns per group), run on
// mma.sync m16n8k16 with the reduction over tokens.  Both operands sit token-major in shared memory
// ([t][r] and [t][q]), so both fragments come from ldmatrix.trans; nothing is transposed in memory.
// Of the 4 products per (row, group), the epilogue keeps the 2 that the row's metadata names: half of
// the computed products are thrown away (the 2:4 choice differs per row, so it cannot steer the MMA).
//
// Pipeline per stage (BT = 32 tokens): cp.async of the dy slab [BT][BR] and of the dense x slab
// [BT][GC*M] (zero-filled past the last token and past the last group), STAGES deep.  For M > 4 a
// gather pass then writes the condensed slab Xc [BT][4GC] (the column offsets are fixed for the whole
// CTA, so each thread keeps its two source offsets in registers); for M = 4 Xc is the x slab itself.
// Epilogue: accumulators -> fp32 shared tile [BR][4GC] -> pick 2 of 4 by metadata -> [R, 2G] output in
// the values dtype or float32 (row-contiguous 4- or 8-byte stores).
//
// Split over tokens (attribute `split`: 1 = none, 0 = auto, n > 1 = n ranges): a layer with few
// (row, group) tiles (R/64 x G/GC CTAs: 64 for a 1024x1024 layer at M = 8, half the H100's SMs) gets
// grid.z token ranges; each writes float32 partial sums into the handler's second result, a float32 buffer of
// S * R * 2G elements (jaxsparse.ffi.calls sizes it for the most ranges the rule can choose, or 0 where it never
// splits), and SddmmReduceKernel adds them into the output.  Auto splits only grids of fewer tiles than half the SMs
// (engines of two CTAs an SM, aiming at two per SM) or than the SMs (the one-CTA x^T and tma engines, by whole waves:
// ChooseSplits), with >= 4 token tiles per range; never more ranges than the buffer holds.  A result
// instead of XLA's scratch allocator keeps the handler safe to record into XLA's command buffers (CUDA graphs).
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"
#include "wgmma.cuh"

namespace jaxsparse {
namespace {

struct SddmmParams {
  const void* x;          // [T, K]
  const void* dy;         // [T, R]
  const uint8_t* cols;    // [R/V, G, 4] or null (M = 4)
  const uint32_t* meta;   // [R, G/8]
  void* out;              // [R, 2G], T or float
  float* partial;         // [S, R, 2G] float32 partial sums when split over tokens, else null
  int tokens, k, rows, groups, v;
  int out_f32;
  int kt_per_split;       // token tiles per grid.z range
  int x_blocks;           // x [T, x_blocks K] (the tma engine): the weight is x_blocks diagonal blocks, row r reading
                          // x's columns (r / (rows / x_blocks)) K + [0, K); 1 = one block (x [T, K])
  const int32_t* x_chunks;  // [x_blocks, K/64] or null (the tma engine): block b's columns j*64 + [0, 64) are x's
                            // columns x_chunks[b, j] * 64 + [0, 64) (its input set in 64-column chunks)
  // The bias gradient (the x^T and tma engines' kernels with DBK > 0): sum over tokens of dy, per row. Every CTA
  // adds DBK k16 steps of each of its stages (m64n8 products of dy^T with a tile of ones), so ways = 4 / DBK column
  // tiles cover a stage; the first `ways` column tiles write their sums to plane (grid.z * ways + column tile) of
  // db_partial [S * ways, R], and the reduction sums the planes in order. Null: no bias gradient.
  float* db_partial;
  // Rows of each dy operand (the x^T and tma engines, which load dy by TMA): the weight's R rows stack `rows / dy_rows`
  // layers of one input, layer i's dy [T, dy_rows] read through the i-th tensor map (PartOfRow); dy_rows = rows for
  // one layer.
  int dy_rows;
};

constexpr int kSdBR = 64;       // rows (output features) per CTA; divides V = 64 and 128
constexpr int kSdBT = 32;       // tokens per pipeline stage (two k16 mma steps)
constexpr int kSdThreads = 256;

// Per-M tile: GC groups per CTA (dense slab width GC*M <= 256 elements), warp grid over [BR x 4GC].
template <int M>
struct SddmmCfg;
template <>
struct SddmmCfg<4> {
  static constexpr int GC = 32, WARPS_M = 2, WARPS_N = 4, STAGES = 4;
};
template <>
struct SddmmCfg<8> {
  static constexpr int GC = 32, WARPS_M = 2, WARPS_N = 4, STAGES = 3;
};
template <>
struct SddmmCfg<16> {
  static constexpr int GC = 16, WARPS_M = 4, WARPS_N = 2, STAGES = 3;
};
template <>
struct SddmmCfg<32> {
  static constexpr int GC = 8, WARPS_M = 4, WARPS_N = 2, STAGES = 3;
};

template <int M>
struct SddmmLayout {
  using C = SddmmCfg<M>;
  static constexpr int NC = 4 * C::GC;             // condensed columns per CTA
  static constexpr int W = C::GC * M;              // dense x columns per CTA
  static constexpr int kDyRowBytes = (kSdBR + 8) * 2;  // +16 B: conflict-free ldmatrix rows
  static constexpr int kXRowBytes = (W + 8) * 2;
  static constexpr int kCRowBytes = (NC + 8) * 2;
  static constexpr int kDyOff = 0;
  static constexpr int kXOff = kDyOff + kSdBT * kDyRowBytes;
  static constexpr int kStageBytes = kXOff + kSdBT * kXRowBytes;
  static constexpr int kCOff = C::STAGES * kStageBytes;  // condensed slab (M > 4), single buffer
  static constexpr int kPipeBytes = kCOff + (M > 4 ? kSdBT * kCRowBytes : 0);
  static constexpr int kEpiRowFloats = NC + 4;
  static constexpr int kEpiBytes = kSdBR * kEpiRowFloats * 4;
  static constexpr int kSmemBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;
  static_assert(kStageBytes % 16 == 0 && kCOff % 16 == 0, "16-byte alignment");
};

// The two kept values (v0, v1) of (row, group g): into this grid.z range's float32 partial plane, or the
// output in float32 or T.
template <typename T>
__device__ __forceinline__ void StorePair(const SddmmParams& p, int row, int g, float v0, float v1) {
  const int64_t o = static_cast<int64_t>(row) * (2 * p.groups) + 2 * g;
  if (p.partial != nullptr) {
    const int64_t plane = static_cast<int64_t>(p.rows) * (2 * p.groups);
    *reinterpret_cast<float2*>(p.partial + blockIdx.z * plane + o) = make_float2(v0, v1);
  } else if (p.out_f32) {
    *reinterpret_cast<float2*>(static_cast<float*>(p.out) + o) = make_float2(v0, v1);
  } else {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + o) = PackPair<T>(v0, v1);
  }
}

// This CTA's token tiles of BT tokens, [begin, begin + count) of the whole range: range blockIdx.z of the token split
// (count 0 past the last tile).
struct TokenTiles {
  int begin, count;
};
template <int BT>
__device__ __forceinline__ TokenTiles CtaTokenTiles(const SddmmParams& p) {
  const int all = (p.tokens + BT - 1) / BT;
  const int begin = blockIdx.z * p.kt_per_split;
  return {begin, max(min(all - begin, p.kt_per_split), 0)};
}

// Up to kSddmmMaxParts stacked layers (SddmmParams::dy_rows): each with its own dy, read by its own TMA tensor map,
// and its own columns and metadata (SddmmParts), so that none is concatenated.
constexpr int kSddmmMaxParts = 3;

// Each stacked layer's columns ([dy_rows/V, G, 4] or null) and metadata ([dy_rows, G/8]); a kernel parameter of its
// own, kept out of SddmmParams (a parameter struct's size is a performance change: docs/kernel-notes.md, session 54).
struct SddmmParts {
  const uint8_t* cols[kSddmmMaxParts];
  const uint32_t* meta[kSddmmMaxParts];
};

// Where a CTA whose rows start at stacked row `row0` reads (a CTA's rows sit in one layer: dy_rows % 128 == 0): its
// layer's dy tensor map, the row in it, and its layer's columns and metadata.
struct PartOf {
  const CUtensorMap* dy;
  int row;
  const uint8_t* cols;
  const uint32_t* meta;
};
__device__ __forceinline__ PartOf PartOfRow(const SddmmParams& p, const SddmmParts& parts, int row0,
                                            const CUtensorMap& dy0, const CUtensorMap& dy1, const CUtensorMap& dy2) {
  const int part = row0 / p.dy_rows;
  return {part == 0 ? &dy0 : part == 1 ? &dy1 : &dy2, row0 - part * p.dy_rows,
          part == 0 ? parts.cols[0] : part == 1 ? parts.cols[1] : parts.cols[2],
          part == 0 ? parts.meta[0] : part == 1 ? parts.meta[1] : parts.meta[2]};
}

// Epilogue of every engine: `tile` [ROWS][row_floats] holds C[r, 4*gl + p] for the CTA's rows and GC groups;
// per (row, group) the metadata nibble picks the 2 kept of the 4 products, stored by StorePair. THREADS threads store,
// the caller being thread `t` of them.
template <typename T, int ROWS, int GC, int THREADS>
__device__ __forceinline__ void StoreKeptPairs(const SddmmParams& p, const float* tile, int row_floats, int row0,
                                               int g0, int t, const uint32_t* meta = nullptr, int meta_row0 = -1) {
  // meta: the metadata holding row0 as its row meta_row0 (a stacked layer's own: SddmmParts); default p.meta, row0.
  if (meta == nullptr) meta = p.meta, meta_row0 = row0;
  const int meta_stride = p.groups / 8;
  for (int i = t; i < ROWS * GC; i += THREADS) {
    const int r = i / GC, gl = i % GC, g = g0 + gl;
    if (g >= p.groups) continue;
    const int row = row0 + r;
    const uint32_t nib = (meta[static_cast<int64_t>(meta_row0 + r) * meta_stride + g / 8] >> (4 * (g % 8))) & 0xFu;
    const float v0 = tile[r * row_floats + 4 * gl + (nib & 3u)];
    const float v1 = tile[r * row_floats + 4 * gl + (nib >> 2)];
    StorePair<T>(p, row, g, v0, v1);
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(kSdThreads) SddmmKernel(const SddmmParams p) {
  using C = SddmmCfg<M>;
  using L = SddmmLayout<M>;
  constexpr int GC = C::GC, NC = L::NC, W = L::W, STAGES = C::STAGES;
  constexpr int WM = kSdBR / C::WARPS_M, WN = NC / C::WARPS_N;
  constexpr int MI = WM / 16, NI = WN / 8;
  static_assert(C::WARPS_M * C::WARPS_N * 32 == kSdThreads, "8 warps");
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile");

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t smem_base = SmemAddr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % C::WARPS_M, warp_n = warp / C::WARPS_M;
  const int gid = lane >> 2, tig = lane & 3;

  const int row0 = blockIdx.x * kSdBR;
  const int g0 = blockIdx.y * GC;
  const int groups = p.groups;
  const auto [kt_begin, num_kt] = CtaTokenTiles<kSdBT>(p);  // this CTA's token tiles
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);

  // ---- copy assignments (fixed across stages; only the token offset moves)
  // dy slab: BT rows x 8 chunks of 16 B = 256 chunks, one per thread.
  static_assert(kSdBT * (kSdBR / 8) == kSdThreads, "dy copy split");
  const int dy_t = tid / (kSdBR / 8), dy_c = tid % (kSdBR / 8);
  const T* dy_src0 = dy + static_cast<int64_t>(dy_t) * p.rows + row0 + dy_c * 8;
  const uint32_t dy_dst = L::kDyOff + dy_t * L::kDyRowBytes + dy_c * 16;
  // x slab: BT rows x W/8 chunks.
  constexpr int kXCpr = W / 8;
  static_assert(kSdThreads % kXCpr == 0 && (kSdBT * kXCpr) % kSdThreads == 0, "x copy split");
  constexpr int kXIters = kSdBT * kXCpr / kSdThreads, kXRowStep = kSdThreads / kXCpr;
  const int x_c = tid % kXCpr, x_t = tid / kXCpr;
  // A 16-byte chunk covers whole groups (M >= 8) or two groups (M = 4); G % 8 == 0, so the chunk is
  // valid when its first group is.
  const bool x_col_ok = g0 + (x_c * 8) / M < groups;
  const T* x_src0 = x + static_cast<int64_t>(x_t) * p.k + static_cast<int64_t>(g0) * M + x_c * 8;
  const uint32_t x_dst0 = L::kXOff + x_t * L::kXRowBytes + x_c * 16;

  auto load_stage = [&](int buf, int kt) {
    const uint32_t base = smem_base + buf * L::kStageBytes;
    const int t0 = kt * kSdBT;
    {
      const bool ok = t0 + dy_t < p.tokens;
      CpAsync16(base + dy_dst, ok ? dy_src0 + static_cast<int64_t>(t0) * p.rows : dy, ok ? 16 : 0);
    }
#pragma unroll
    for (int it = 0; it < kXIters; ++it) {
      const int t = t0 + x_t + it * kXRowStep;
      const bool ok = x_col_ok && t < p.tokens;
      CpAsync16(base + x_dst0 + it * kXRowStep * L::kXRowBytes,
                ok ? x_src0 + static_cast<int64_t>(t0 + it * kXRowStep) * p.k : x, ok ? 16 : 0);
    }
  };

  // ---- gather assignment (M > 4): thread writes condensed column pair (2*cq, 2*cq+1) of rows
  // cg_t, cg_t + kCgRowStep, ...; both columns lie in group cq/2 at positions 2*(cq%2) and +1.
  constexpr int kCgPairs = NC / 2;
  static_assert(kSdThreads % kCgPairs == 0, "gather split");
  constexpr int kCgRowStep = kSdThreads / kCgPairs, kCgIters = kSdBT / kCgRowStep;
  const int cq = tid % kCgPairs, cg_t = tid / kCgPairs;
  int cg_off0 = 0, cg_off1 = 0;  // element offsets in a dense x slab row
  if constexpr (M > 4) {
    const int gl = cq >> 1, pos = 2 * (cq & 1);
    uint32_t w = 0;
    if (g0 + gl < groups)
      w = *reinterpret_cast<const uint32_t*>(p.cols + (static_cast<int64_t>(row0 / p.v) * groups + g0 + gl) * 4);
    cg_off0 = gl * M + ((w >> (8 * pos)) & 0xFF);
    cg_off1 = gl * M + ((w >> (8 * pos + 8)) & 0xFF);
  }

  float acc[MI][NI][4];
  ZeroAccumulators(acc);

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_kt) load_stage(s, kt_begin + s);
    CpAsyncCommit();
  }

  // ldmatrix.trans lane addresses.  A = dy^T (16 rows r x 16 tokens) from dy [t][r]: matrices
  // (r 0-7, t 0-7), (r 8-15, t 0-7), (r 0-7, t 8-15), (r 8-15, t 8-15).
  const int a_t = ((lane >> 4) & 1) * 8 + (lane & 7);
  const int a_r = ((lane >> 3) & 1) * 8;
  // B = Xc (16 tokens x 16 condensed columns) from Xc [t][q]: matrices (t 0-7, q 0-7), (t 8-15, q 0-7),
  // (t 0-7, q 8-15), (t 8-15, q 8-15) -> b0/b1 of n-tile 2j, then b0/b1 of n-tile 2j+1.
  const int b_t = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int b_q = (lane >> 4) * 8;

  for (int kt = 0; kt < num_kt; ++kt) {
    CpAsyncWait<STAGES - 2>();
    __syncthreads();  // stage kt landed for all threads; everyone is done with stage kt-1 and Xc
    {
      const int next = kt + STAGES - 1;
      if (next < num_kt) load_stage(next % STAGES, kt_begin + next);
      CpAsyncCommit();
    }
    const uint32_t base = smem_base + (kt % STAGES) * L::kStageBytes;
    uint32_t xc_base;
    int xc_row_bytes;
    if constexpr (M > 4) {
      const unsigned char* xs = smem + (kt % STAGES) * L::kStageBytes + L::kXOff;
#pragma unroll
      for (int it = 0; it < kCgIters; ++it) {
        const int t = cg_t + it * kCgRowStep;
        const uint16_t* row = reinterpret_cast<const uint16_t*>(xs + t * L::kXRowBytes);
        const uint32_t word = static_cast<uint32_t>(row[cg_off0]) | (static_cast<uint32_t>(row[cg_off1]) << 16);
        *reinterpret_cast<uint32_t*>(smem + L::kCOff + t * L::kCRowBytes + cq * 4) = word;
      }
      __syncthreads();
      xc_base = smem_base + L::kCOff;
      xc_row_bytes = L::kCRowBytes;
    } else {
      xc_base = base + L::kXOff;
      xc_row_bytes = L::kXRowBytes;
    }

#pragma unroll
    for (int ks = 0; ks < kSdBT / 16; ++ks) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int r = warp_m * WM + mi * 16 + a_r;
        LdMatrixX4Trans(a[mi], base + L::kDyOff + (ks * 16 + a_t) * L::kDyRowBytes + r * 2);
      }
      uint32_t b[NI][2];
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t f[4];
        const int q = warp_n * WN + nj * 16 + b_q;
        LdMatrixX4Trans(f, xc_base + (ks * 16 + b_t) * xc_row_bytes + q * 2);
        b[2 * nj][0] = f[0];
        b[2 * nj][1] = f[1];
        b[2 * nj + 1][0] = f[2];
        b[2 * nj + 1][1] = f[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) Mma<T>::Run(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }

  // ---------------------------------------------------------------- epilogue
  CpAsyncWait<0>();
  __syncthreads();  // pipeline buffers free: reuse them as the fp32 tile [BR][NC]
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = warp_m * WM + mi * 16 + gid + (q >> 1) * 8;
        const int c = warp_n * WN + ni * 8 + 2 * tig + (q & 1);
        tile[r * L::kEpiRowFloats + c] = acc[mi][ni][q];
      }
  __syncthreads();
  StoreKeptPairs<T, kSdBR, GC, kSdThreads>(p, tile, L::kEpiRowFloats, row0, g0, threadIdx.x);
}

// ---------------------------------------------------------------- Hopper engine (wgmma, sm_90a)
//
// The same product on warpgroup MMAs: CTA = 128 rows (two warpgroups of 64, each inside one V block) x
// NC condensed columns; 8 warps.  Per 32-token stage (cp.async, STAGES deep): dy [32 t][128 r] stored as
// two MN-major 128-byte-swizzled halves (the A operand of each warpgroup, read by wgmma straight from the
// copy), and the dense x slab.  For M = 4 the x slab is copied into the swizzled B layout and read
// directly; for M > 4 it is copied plainly and a gather pass writes each warpgroup's condensed slab Xc
// (its own V block's columns) into a double-buffered swizzled B tile while the previous stage's wgmmas
// run.  The x slab is shared by both warpgroups: it is read R/128 times from L2 instead of R/64.
constexpr int kWgBR = 128;
constexpr int kWgBT = 32;
constexpr int kWgThreads = 256;

template <int M>
struct WgCfg;
template <>
struct WgCfg<4> {
  static constexpr int GC = 32, STAGES = 4;
};
template <>
struct WgCfg<8> {
  static constexpr int GC = 32, STAGES = 3;
};
template <>
struct WgCfg<16> {
  static constexpr int GC = 16, STAGES = 3;
};

template <int M>
struct WgLayout {
  using C = WgCfg<M>;
  static constexpr int NC = 4 * C::GC;                       // condensed columns (wgmma N)
  static constexpr int W = C::GC * M;                        // dense x columns per CTA
  static constexpr int kHalfBytes = kWgBT * 128;             // one 64-row dy half: 32 k-rows of 128 B
  static constexpr int kBColBytes = kWgBT * 128;             // one 64-wide column of B atoms (LBO)
  static constexpr int kBBytes = (NC / 64) * kBColBytes;     // one B tile [32 t][NC]
  static constexpr int kXRowBytes = (W + 8) * 2;             // plain x slab row (M > 4)
  static constexpr int kDyOff = 0;
  static constexpr int kXOff = 2 * kHalfBytes;
  static constexpr int kXBytes = M == 4 ? kBBytes : kWgBT * kXRowBytes;
  static constexpr int kStageBytes = (kXOff + kXBytes + 1023) / 1024 * 1024;
  static constexpr int kXcOff = C::STAGES * kStageBytes;    // [2 buffers][2 halves] B tiles (M > 4)
  static constexpr int kPipeBytes = kXcOff + (M > 4 ? 4 * kBBytes : 0);
  static constexpr int kEpiRowFloats = NC + 4;
  static constexpr int kEpiBytes = kWgBR * kEpiRowFloats * 4;
  // +1024: the kernel rounds the dynamic shared-memory base up to a swizzle-atom boundary.
  static constexpr int kSmemBytes = (kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes) + 1024;
  static_assert(NC % 64 == 0 && kHalfBytes % 1024 == 0 && kBBytes % 1024 == 0, "swizzle atoms");
};

// Both wgmma engines' epilogue: each warpgroup's m64nNk16 float32 accumulators (rows 64 * warpgroup + ...,
// the fragment layout in wgmma.cuh) into the shared tile [128][row_floats] that StoreKeptPairs reads. `t`: the
// thread's index among the CTA's two consumer warpgroups (threadIdx.x, or that less the producer warpgroups' threads).
template <int N>
__device__ __forceinline__ void StageWgmmaAccumulators(float* tile, int row_floats, const float (&acc)[N / 2],
                                                       int t = threadIdx.x) {
  const int warp = t >> 5, lane = t & 31;
  const int wg = warp >> 2, wq = warp & 3;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int r = 64 * wg + 16 * wq + (lane >> 2) + 8 * ((i >> 1) & 1);
    const int c = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
    tile[r * row_floats + c] = acc[i];
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(kWgThreads, 2) SddmmWgmmaKernel(const SddmmParams p) {
#ifdef JAXSPARSE_WGMMA
  using C = WgCfg<M>;
  using L = WgLayout<M>;
  constexpr int GC = C::GC, NC = L::NC, W = L::W, STAGES = C::STAGES;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);  // swizzle atoms start on their boundary
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup: rows 64*wg .. 64*wg+63 of the tile
  const int row0 = blockIdx.x * kWgBR;
  const int g0 = blockIdx.y * GC;
  const int groups = p.groups;
  const auto [kt_begin, num_kt] = CtaTokenTiles<kWgBT>(p);  // this CTA's token tiles
  const T* __restrict__ x = static_cast<const T*>(p.x);
  const T* __restrict__ dy = static_cast<const T*>(p.dy);

  // dy: 32 rows x 16 chunks of 16 B; thread copies chunks (dy_t, dy_c) and (dy_t + 16, dy_c).
  const int dy_t = tid >> 4, dy_c = tid & 15;
  const T* dy_src0 = dy + static_cast<int64_t>(dy_t) * p.rows + row0 + dy_c * 8;
  auto dy_dst = [&](int t) {
    return static_cast<uint32_t>(L::kDyOff + (dy_c >> 3) * L::kHalfBytes + Sw128MnOffset((dy_c & 7) * 8, t, 0));
  };
  // x: 32 rows x W/8 chunks.
  constexpr int kXCpr = W / 8;
  static_assert(kWgThreads % kXCpr == 0 && (kWgBT * kXCpr) % kWgThreads == 0, "x copy split");
  constexpr int kXIters = kWgBT * kXCpr / kWgThreads, kXRowStep = kWgThreads / kXCpr;
  const int x_c = tid % kXCpr, x_t = tid / kXCpr;
  const bool x_col_ok = g0 + (x_c * 8) / M < groups;
  const T* x_src0 = x + static_cast<int64_t>(x_t) * p.k + static_cast<int64_t>(g0) * M + x_c * 8;

  auto load_stage = [&](int buf, int kt) {
    const uint32_t base = smem_base + buf * L::kStageBytes;
    const int t0 = kt * kWgBT;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = dy_t + 16 * h;
      const bool ok = t0 + t < p.tokens;
      CpAsync16(base + dy_dst(t), ok ? dy_src0 + static_cast<int64_t>(t0 + 16 * h) * p.rows : dy, ok ? 16 : 0);
    }
#pragma unroll
    for (int it = 0; it < kXIters; ++it) {
      const int tl = x_t + it * kXRowStep;
      const bool ok = x_col_ok && t0 + tl < p.tokens;
      uint32_t dst;
      if constexpr (M == 4) {
        dst = L::kXOff + Sw128MnOffset(x_c * 8, tl, L::kBColBytes);
      } else {
        dst = L::kXOff + tl * L::kXRowBytes + x_c * 16;
      }
      CpAsync16(base + dst, ok ? x_src0 + static_cast<int64_t>(t0 + it * kXRowStep) * p.k : x, ok ? 16 : 0);
    }
  };

  // Gather (M > 4): thread writes condensed pair cq (columns 2cq, 2cq+1) of rows cg_t + j*kCgRowStep, for
  // both halves; each half takes its own V block's column word (one slab for both when V >= 128).
  const bool one_block = p.v % kWgBR == 0;
  constexpr int kCgPairs = NC / 2;
  constexpr int kCgRowStep = kWgThreads / kCgPairs, kCgIters = kWgBT / kCgRowStep;
  const int cq = tid % kCgPairs, cg_t = tid / kCgPairs;
  int cg_off[2][2] = {{0, 0}, {0, 0}};
  if constexpr (M > 4) {
    const int gl = cq >> 1, pos = 2 * (cq & 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w = 0;
      if (g0 + gl < groups)
        w = *reinterpret_cast<const uint32_t*>(
            p.cols + (static_cast<int64_t>((row0 + 64 * h) / p.v) * groups + g0 + gl) * 4);
      cg_off[h][0] = gl * M + ((w >> (8 * pos)) & 0xFF);
      cg_off[h][1] = gl * M + ((w >> (8 * pos + 8)) & 0xFF);
    }
  }
  auto gather = [&](int stage_buf, int xc_buf) {
    if constexpr (M > 4) {
      const unsigned char* xs = smem + stage_buf * L::kStageBytes + L::kXOff;
#pragma unroll
      for (int it = 0; it < kCgIters; ++it) {
        const int t = cg_t + it * kCgRowStep;
        const uint16_t* row = reinterpret_cast<const uint16_t*>(xs + t * L::kXRowBytes);
        const uint32_t off = Sw128MnOffset(2 * cq, t, L::kBColBytes);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 1 && one_block) break;  // both halves in one V block: one condensed slab serves both
          const uint32_t word = static_cast<uint32_t>(row[cg_off[h][0]]) | (static_cast<uint32_t>(row[cg_off[h][1]]) << 16);
          *reinterpret_cast<uint32_t*>(smem + L::kXcOff + (2 * xc_buf + h) * L::kBBytes + off) = word;
        }
      }
    }
  };

  float acc[NC / 2];
#pragma unroll
  for (int i = 0; i < NC / 2; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < num_kt) load_stage(s, kt_begin + s);
    CpAsyncCommit();
  }
  CpAsyncWait<STAGES - 2>();
  __syncthreads();  // stage 0 landed for every thread
  if (num_kt > 0) gather(0, 0);
  FenceProxyAsyncShared();  // cp.async and gather writes -> visible to the wgmma (async proxy)
  __syncthreads();

  for (int kt = 0; kt < num_kt; ++kt) {
    const int buf = kt % STAGES;
    const uint32_t a_base = smem_base + buf * L::kStageBytes + L::kDyOff + wg * L::kHalfBytes;
    const uint32_t b_base = M == 4 ? smem_base + buf * L::kStageBytes + L::kXOff
                                   : smem_base + L::kXcOff + (2 * (kt & 1) + (one_block ? 0 : wg)) * L::kBBytes;
    WgmmaFenceOperands(acc);
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kWgBT / 16; ++ks) {
      const uint64_t da = WgmmaDescSw128(a_base + ks * 2048, L::kHalfBytes, 1024);
      const uint64_t db = WgmmaDescSw128(b_base + ks * 2048, L::kBColBytes, 1024);
      Wgmma<NC, T>::Run(acc, da, db);
    }
    WgmmaCommit();
    // Meanwhile: refill the buffer stage kt-1 used, and prepare stage kt+1 (its x gathered into the other Xc).
    {
      const int next = kt + STAGES - 1;
      if (next < num_kt) load_stage(next % STAGES, kt_begin + next);
      CpAsyncCommit();
    }
    if (kt + 1 < num_kt) {
      CpAsyncWait<STAGES - 2>();
      __syncthreads();  // stage kt+1 landed for every thread
      gather((kt + 1) % STAGES, (kt + 1) & 1);
      FenceProxyAsyncShared();
    }
    WgmmaWait<0>();
    WgmmaFenceOperands(acc);
    __syncthreads();  // every warpgroup's wgmma(kt) done; stage kt+1's B visible to all
  }

  // ---------------------------------------------------------------- epilogue (as the mma.sync engine)
  CpAsyncWait<0>();
  __syncthreads();
  float* tile = reinterpret_cast<float*>(smem);
  StageWgmmaAccumulators<NC>(tile, L::kEpiRowFloats, acc);
  __syncthreads();
  StoreKeptPairs<T, kWgBR, GC, kWgThreads>(p, tile, L::kEpiRowFloats, row0, g0, threadIdx.x);
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// ------------------------------------------------------------------------------------------------------
// Hopper engine for x^T (x_layout = 1: the operand is x^T [K, T], token-contiguous rows, written by
// jaxsparse_transpose in cuda/transpose.cu).
//
// With tokens contiguous, a kept column of x is a contiguous row of x^T, so the condensed operand is
// copied straight from global memory by cp.async (16 bytes = 8 tokens of one kept column): no gather pass
// in shared memory, the same code for every M, and 4/M of x's bytes moved instead of all of them.
// CTA = 128 rows (two warpgroups of 64, each inside one V block) x NC condensed columns (XtLayout: 128 from x^T,
// 256 from x rows); 64-token stages, 4 deep (6 where one V block holds the CTA's rows: XtLayout's DEEP, session
// 52).  Per stage: dy [64 t][128 r] lands as two MN-major 128B-swizzled 64-row halves (A, trans-a = 1, as in
// SddmmWgmmaKernel); each V block's condensed x^T rows [128 q][64 t] land as a K-major 128B-swizzled B tile
// (trans-b = 0; two tiles when V = 64, one for V >= 128 and for 2:4).
// Loads (session 6): thread 0 brings dy by TMA (two boxes per stage) and, at 2:4, where the condensed rows
// are x^T's own consecutive rows, x^T too (one box of 128 rows); the gathered rows of V:2:M stay on cp.async
// (a one-row TMA box cannot land 128-byte swizzled at a shared address that is not 1024-byte aligned).
// Pipeline: the loads for stage kt+2 (kt+4 when DEEP) are issued right after the barrier of stage kt, whose wgmmas
// then run while one group of the previous stage may still be in flight (wgmma.wait_group 1), so the tensor cores
// see back-to-back work; a buffer is refilled only after every warpgroup's wgmmas on it completed.
// Needs T % 8 == 0 (16-byte rows of x^T) and R % 128 == 0; the Python side takes this path only then.
// XROW, the tma engine (2:4 only, session 7): the same products on x [T, K] as XLA holds it, so the layer needs no
// transpose: the NC = 256 condensed columns are x's columns 4 g0 .. 4 g0 + 255, four TMA boxes of 64 tokens x 64
// columns that land as an MN-major 128B-swizzled B (trans-b = 1, LBO = one box), like dy; each warpgroup runs m64n256
// products, which take in 48 KB per 64-token stage for 2M products against 32 KB for 1M at 128 columns (session
// 10: the loads, not the tensor pipe, set the forward kernel's main-loop rate; benchmarks/ws_probe.cu). Since session
// 57 it runs warp-specialized only (SddmmWgmmaXrWsKernel, below); SddmmWgmmaXtKernel reads x^T.
// Epilogue: StoreKeptPairs, as both other engines.
constexpr int kXtBR = 128;
constexpr int kXtBT = 64;
constexpr int kXtThreads = 256;
constexpr int kXtBox = kXtBT * 128;  // one 64-token x 64-column box of 16-bit values (128-byte swizzled)
// The bias gradient's m64n8k16 products against a tile of ones: a stage's kXtBT / 16 k16 steps are shared out over
// kXtBT / 16 / DBK column tiles ("ways"), DBK steps each (template parameter DBK of SddmmWgmmaXtKernel; 0: none).
constexpr int kXtKSteps = kXtBT / 16;
constexpr int DbWays(int dbk) { return dbk == 0 ? 0 : kXtKSteps / dbk; }

// The x^T engine's bias gradient (DBK > 0), shared by SddmmWgmmaXtKernel and SddmmWgmmaXtWsKernel: every CTA adds k16
// steps (column tile % ways) DBK + [0, DBK) of every stage, so the first `ways` column tiles together cover every
// token; only those write their sums (the others' products keep the CTAs alike). Each such step is an m64n8k16 product
// of the warpgroup's dy^T half against a tile of ones, so every column of acc_db holds the row's sum.
#ifdef JAXSPARSE_WGMMA
template <typename T, int DBK>
struct XtBiasGrad {
  static constexpr int kWays = DbWays(DBK);
  static_assert(DBK == 0 || DBK == 1 || DBK == 2 || DBK == 4, "DBK divides a stage's kXtKSteps = 4 k16 steps");
  uint32_t ones;  // shared-memory address of the tile of ones
  uint32_t ks0;   // this column tile's first k16 step of a stage

  // Fills the tile of ones (bytes at `ones_ptr`, address `ones_addr`) with `threads` threads, the caller's barrier
  // following; the async-proxy fence makes the ones visible to wgmma.
  __device__ __forceinline__ XtBiasGrad(unsigned char* ones_ptr, uint32_t ones_addr, int bytes, int tid, int threads)
      : ones(ones_addr), ks0(blockIdx.y % (DBK > 0 ? kWays : 1) * DBK) {
    if constexpr (DBK > 0) {
      const uint32_t one2 = std::is_same<T, __half>::value ? 0x3C003C00u : 0x3F803F80u;  // two 16-bit ones
      for (int i = tid; i < bytes / 4; i += threads) reinterpret_cast<uint32_t*>(ones_ptr)[i] = one2;
      FenceProxyAsyncShared();
    }
  }

  // A stage's DBK products of the warpgroup's dy^T half (its 64-row box at a_base, 2048 bytes a k16 step) into acc.
  __device__ __forceinline__ void Products(float (&acc)[4], uint32_t a_base) const {
#pragma unroll
    for (int j = 0; j < DBK; ++j)
      Wgmma<8, T, 1>::Run(acc, WgmmaDescSw128(a_base + (ks0 + j) * 2048, kXtBox, 1024),
                          WgmmaDescSw128(ones, kXtBox, 1024));
  }

  // After the last products completed: the row sums of the thread's consumer warpgroup (its index `t` among the
  // consumer warpgroups: warpgroup t / 128, rows 16 wq + lane / 4 and + 8 of its 64) into this CTA's plane of
  // p.db_partial.
  __device__ __forceinline__ void Store(const SddmmParams& p, const float (&acc)[4], int row0, int t) const {
    if (DBK == 0 || blockIdx.y >= kWays || (t & 3) != 0) return;
    const int r = 64 * (t >> 7) + 16 * ((t >> 5) & 3) + ((t & 31) >> 2);
    float* plane = p.db_partial + (static_cast<int64_t>(blockIdx.z) * kWays + blockIdx.y) * p.rows + row0;
    plane[r] = acc[0];
    plane[r + 8] = acc[2];
  }
};
#endif  // JAXSPARSE_WGMMA

// NC condensed columns per CTA: 256 from x rows (XROW: one B tile serves both warpgroups, m64n256 products), 128
// from x^T (two B tiles where the warpgroups sit in different V blocks). DEEP (x^T where one V block holds the CTA's
// rows, or 2:4; session 52): one B tile, and the 16 KB that a second would take go to two more stages, so the loads
// run four stages ahead of the products instead of two.
template <bool XROW, bool DEEP = false>
struct XtLayout {
  static_assert(!(XROW && DEEP), "x rows keep four stages");
  static constexpr int kStages = DEEP ? 6 : 4;
  static constexpr int kNC = XROW ? 256 : 128;
  static constexpr int kGC = kNC / 4;                // groups per CTA
  static constexpr int kDyHalf = kXtBox;             // one 64-row dy half: 64 token rows of 128 B
  static constexpr int kXcTile = kNC * 128;          // one B tile: NC condensed columns of 64 tokens
  static constexpr int kXcOff = 2 * kDyHalf;
  // B tiles a stage: one where a CTA's rows sit in one V block (x rows: 2:4; DEEP: the host launches it only there),
  // else one for each warpgroup's V block (V = 64).
  static constexpr int kBTiles = XROW || DEEP ? 1 : 2;
  static constexpr int kStageBytes = kXcOff + kBTiles * kXcTile;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kEpiRowFloats = kNC + 4;
  static constexpr int kEpiBytes = kXtBR * kEpiRowFloats * 4;
  static constexpr int kBarOff = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;  // the stages' mbarriers
  // A 2 KB tile of ones, the B operand of the bias gradient's m64n8k16 products (16 token rows of 128 bytes: any
  // address the descriptor forms reads a one), on its own swizzle atom.
  static constexpr int kOnesOff = (kBarOff + 8 * kStages + 1023) / 1024 * 1024;
  static constexpr int kOnesBytes = 2048;
  static constexpr int kSmemBytes = kBarOff + 8 * kStages + 1024;   // without the bias gradient (as before)
  static constexpr int kSmemBytesDb = kOnesOff + kOnesBytes + 1024;   // with it
  static_assert(kDyHalf % 1024 == 0 && kXcTile % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms");
};

#ifdef JAXSPARSE_WGMMA
// The kept x^T rows of one 128-row B tile (V:2:M), gathered by cp.async from x^T [K, T] into the K-major 128B-swizzled
// tile: 128 condensed rows x 8 chunks of 16 bytes a 64-token stage over kXtThreads threads; thread t copies chunk
// t % 8 of condensed rows t / 8 + 32 i. Rows of groups past G, and tokens past T (T % 8 == 0: a chunk is all in or
// all out), arrive as zeros. Both x^T kernels gather through it (the warp-specialized one from its producers).
template <typename T>
struct XtRowGather {
  static_assert(kXtThreads == 256, "32 rows x 8 chunks a pass, four passes");
  const T* xt;
  const T* src[4];  // chunk c of each of the thread's rows at token 0
  bool ok[4];
  int q, c;

  // Thread t's rows of V block `blk` (its kept columns cols[blk, g, :]; cols: p.cols, or a stacked layer's) for the
  // groups from g0.
  __device__ __forceinline__ void Init(const SddmmParams& p, int t, int blk, int g0, const uint8_t* cols) {
    xt = static_cast<const T*>(p.x);
    q = t >> 3;
    c = t & 7;
    const int groups = p.groups, m = p.k / p.groups;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qi = q + 32 * i, g = g0 + qi / 4;
      ok[i] = g < groups;
      const int col = ok[i] ? cols[(static_cast<int64_t>(blk) * groups + g) * 4 + qi % 4] : 0;
      const int64_t krow = ok[i] ? static_cast<int64_t>(g) * m + col : 0;
      src[i] = xt + krow * p.tokens + c * 8;
    }
  }

  // The copies of tokens t0 .. t0 + 63 into the tile at shared-memory address `tile`.
  __device__ __forceinline__ void Issue(uint32_t tile, int t0, int tokens) const {
    const bool tok_ok = t0 + c * 8 < tokens;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool in = tok_ok && ok[i];
      CpAsync16(tile + Sw128KOffset(q + 32 * i, c * 8), in ? src[i] + t0 : xt, in ? 16 : 0);
    }
  }
};

// The tma engine's B tile from x [T, K] (XROW): columns 4 g0 .. 4 g0 + NC - 1 of tokens t0 .. t0 + 63 of the diagonal
// block holding row0 (x_blocks; x_chunks: the block's 64-column chunks where they are in x), NC / 64 boxes of 64
// tokens x 64 columns that land as an MN-major 128B-swizzled B at `dst`, completing on barrier `full`. Columns past the
// block belong to no kept value (never stored). Issued by one thread.
template <int NC>
__device__ __forceinline__ void LoadXRowBoxes(const SddmmParams& p, const CUtensorMap* tma_x, uint32_t dst, int row0,
                                              int g0, int t0, uint32_t full) {
  const int blk = row0 / (p.rows / p.x_blocks), xk0 = blk * p.k, nch = p.k / 64;
#pragma unroll
  for (int c = 0; c < NC / 64; ++c) {
    // x_chunks: the chunk's column in x (4 g0 is a multiple of NC); a chunk past the block reads past x's width (zeros;
    // its columns are never stored)
    const int j = 4 * g0 / 64 + c;
    const int col = p.x_chunks == nullptr ? xk0 + 4 * g0 + 64 * c
                    : j < nch ? __ldg(p.x_chunks + blk * nch + j) * 64 : p.k * p.x_blocks;
    TmaLoad2d(dst + c * kXtBox, tma_x, col, t0, full);
  }
}
#endif  // JAXSPARSE_WGMMA

template <typename T, int DBK = 0, bool DEEP = false>
__global__ void __launch_bounds__(kXtThreads, 1)
    SddmmWgmmaXtKernel(const SddmmParams p, const __grid_constant__ CUtensorMap tma_dy,
                       const __grid_constant__ CUtensorMap tma_xt, const __grid_constant__ CUtensorMap tma_dy1,
                       const __grid_constant__ CUtensorMap tma_dy2, const SddmmParts parts) {
#ifdef JAXSPARSE_WGMMA
  using L = XtLayout<false, DEEP>;
  constexpr int kXtStages = L::kStages;
  constexpr int NC = L::kNC, GC = L::kGC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + L::kBarOff;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int wg = warp >> 2;
  const int row0 = blockIdx.x * kXtBR;
  const int g0 = blockIdx.y * GC;
  const auto [kt_begin, num_kt] = CtaTokenTiles<kXtBT>(p);  // this CTA's token tiles
  const PartOf dy = PartOfRow(p, parts, row0, tma_dy, tma_dy1, tma_dy2);  // its layer (SddmmParams::dy_rows)
  constexpr int halves = L::kBTiles;  // one B tile for both warpgroups, or one for each (XtLayout)
  // The deep layout (launched here only for 2:4, where the condensed rows are x^T's rows g0*4 .. g0*4 + 127
  // themselves): a TMA box; else (V = 64) a gather by cp.async. LaunchXtKernel checks the pattern.
  constexpr bool x_by_tma = DEEP;

  constexpr bool DB = DBK > 0;  // the bias gradient (XtBiasGrad)
  static_assert(kXtKSteps == 4, "a stage of four k16 steps");
  const XtBiasGrad<T, DBK> bias(smem + L::kOnesOff, smem_base + L::kOnesOff, L::kOnesBytes, tid, kXtThreads);
  if (tid == 0)
    for (int s = 0; s < kXtStages; ++s) MbarInit(full0 + 8 * s, 1);  // thread 0's expect_tx arrival
  __syncthreads();

  // x^T (gathered, V:2:M): one B tile for each warpgroup's V block.
  XtRowGather<T> gather[halves];
#pragma unroll
  for (int h = 0; h < halves; ++h)
    if constexpr (!x_by_tma) gather[h].Init(p, tid, (dy.row + 64 * h) / p.v, g0, dy.cols);

  // Thread 0 loads dy by TMA (two boxes of 64 tokens x 64 rows: the MN-major 128B-swizzled halves) and, at
  // 2:4, x^T too (one box of 64 tokens x 128 rows, K-major 128B-swizzled); tokens past T and rows past K arrive as
  // zeros.
  auto load_stage = [&](int buf, int kt) {
    const uint32_t base = smem_base + buf * L::kStageBytes, full = full0 + 8 * buf;
    const int t0 = kt * kXtBT;
    if (tid == 0) {
      MbarArriveExpectTx(full, 2 * L::kDyHalf + (x_by_tma ? L::kXcTile : 0));
      TmaLoad2d(base, dy.dy, dy.row, t0, full);
      TmaLoad2d(base + L::kDyHalf, dy.dy, dy.row + 64, t0, full);
      if (x_by_tma) TmaLoad2d(base + L::kXcOff, &tma_xt, t0, 4 * g0, full);
    }
    if constexpr (!x_by_tma) {
#pragma unroll
      for (int h = 0; h < halves; ++h) gather[h].Issue(base + L::kXcOff + h * L::kXcTile, t0, p.tokens);
    }
  };

  float acc[NC / 2];
#pragma unroll
  for (int i = 0; i < NC / 2; ++i) acc[i] = 0.f;
  float acc_db[4] = {0.f, 0.f, 0.f, 0.f};  // m64n8: every column holds the row's sum

#pragma unroll
  for (int s = 0; s < kXtStages - 2; ++s) {
    if (s < num_kt) load_stage(s, kt_begin + s);
    CpAsyncCommit();
  }
  for (int kt = 0; kt < num_kt; ++kt) {
    const int buf = kt % kXtStages;
    CpAsyncWait<kXtStages - 3>();  // this thread's copies of stage kt landed
    FenceProxyAsyncShared();
    MbarWait(full0 + 8 * buf, (kt / kXtStages) & 1);  // and the stage's TMA boxes
    __syncthreads();  // stage kt visible to all; every warpgroup's wgmmas up to stage kt-2 completed
    {
      const int next = kt + kXtStages - 2;  // into the buffer of stage kt-2
      if (next < num_kt) load_stage(next % kXtStages, kt_begin + next);
      CpAsyncCommit();
    }
    const uint32_t a_base = smem_base + buf * L::kStageBytes + wg * L::kDyHalf;
    const uint32_t b_base = smem_base + buf * L::kStageBytes + L::kXcOff + (halves == 1 ? 0 : wg) * L::kXcTile;
    WgmmaFenceOperands(acc);
    if constexpr (DB) WgmmaFenceOperands(acc_db);
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kXtKSteps; ++ks)
      Wgmma<NC, T, 0>::Run(acc, WgmmaDescSw128(a_base + ks * 2048, L::kDyHalf, 1024),
                           WgmmaDescSw128(b_base + ks * 32, 16, 1024));
    if constexpr (DB) bias.Products(acc_db, a_base);
    WgmmaCommit();
    WgmmaWait<1>();  // stage kt-1's wgmmas of this warpgroup completed
    WgmmaFenceOperands(acc);
    if constexpr (DB) WgmmaFenceOperands(acc_db);
  }
  WgmmaWait<0>();
  WgmmaFenceOperands(acc);
  if constexpr (DB) WgmmaFenceOperands(acc_db);
  bias.Store(p, acc_db, row0, tid);

  CpAsyncWait<0>();
  __syncthreads();  // no wgmma or copy reads or writes the pipeline buffers any more
  float* tile = reinterpret_cast<float*>(smem);
  StageWgmmaAccumulators<NC>(tile, L::kEpiRowFloats, acc);
  __syncthreads();
  StoreKeptPairs<T, kXtBR, GC, kXtThreads>(p, tile, L::kEpiRowFloats, row0, g0, tid, dy.meta, dy.row);
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// The consumers of both warp-specialized kernels (XtLayout<XROW, !XROW>): for each of the CTA's num_kt stages, wait on
// its full barrier, run consumer warpgroup cw's products of its 64 rows (x rows: MN-major B boxes kXtBox apart; x^T:
// the K-major gathered tile, whose cp.async writes need the async-proxy fence first) and the bias gradient's, and give
// stage kt-1 back on its empty barrier once wgmma.wait_group 1 shows its products completed; then drain.
#ifdef JAXSPARSE_WGMMA
template <typename T, bool XROW, int DBK>
__device__ __forceinline__ void XtWsConsume(float (&acc)[XtLayout<XROW, !XROW>::kNC / 2], float (&acc_db)[4],
                                            const XtBiasGrad<T, DBK>& bias, uint32_t smem_base, uint32_t full0,
                                            uint32_t empty0, int num_kt, int cw, int lane) {
  using L = XtLayout<XROW, !XROW>;
  constexpr int S = L::kStages, NC = L::kNC;
  constexpr bool DB = DBK > 0;
  for (int kt = 0; kt < num_kt; ++kt) {
    const int s = kt % S;
    MbarWait(full0 + 8 * s, (kt / S) & 1);
    if constexpr (!XROW) FenceProxyAsyncShared();  // cp.async writes, seen through the barrier, before wgmma reads
    const uint32_t a_base = smem_base + s * L::kStageBytes + cw * L::kDyHalf;
    const uint32_t b_base = smem_base + s * L::kStageBytes + L::kXcOff;
    WgmmaFenceOperands(acc);
    if constexpr (DB) WgmmaFenceOperands(acc_db);
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kXtKSteps; ++ks) {
      const uint64_t da = WgmmaDescSw128(a_base + ks * 2048, L::kDyHalf, 1024);
      if constexpr (XROW)
        Wgmma<NC, T, 1>::Run(acc, da, WgmmaDescSw128(b_base + ks * 2048, kXtBox, 1024));
      else
        Wgmma<NC, T, 0>::Run(acc, da, WgmmaDescSw128(b_base + ks * 32, 16, 1024));
    }
    if constexpr (DB) bias.Products(acc_db, a_base);
    WgmmaCommit();
    WgmmaWait<1>();  // stage kt-1's products of this warp completed
    WgmmaFenceOperands(acc);
    if constexpr (DB) WgmmaFenceOperands(acc_db);
    if (lane == 0 && kt > 0) MbarArrive(empty0 + 8 * ((kt - 1) % S));
  }
  WgmmaWait<0>();
  WgmmaFenceOperands(acc);
  if constexpr (DB) WgmmaFenceOperands(acc_db);
}
#endif  // JAXSPARSE_WGMMA

// The x^T engine warp-specialized (session 52; XtLayout<false, true>: one V block a CTA, six 32 KB stages): warpgroups
// 0 and 1 fill the ring (thread 0 brings dy by TMA, all 256 threads gather the kept x^T rows by cp.async, each marking
// its part with cp.async.mbarrier.arrive; session 53: one producer warpgroup was 4.6 % slower than the deep kernel's
// 256 copying threads), warpgroups 2 and 3 run the products of the two 64-row halves and give each
// stage back on an empty barrier once their wgmma.wait_group 1 shows its products completed. So the producer refills
// stage kt-1's buffer while stage kt's products run: five stages in flight, with neither the products drained at a
// stage's end nor a second CTA barrier (both slower on SddmmWgmmaXtKernel: docs/kernel-notes.md, session 52).
constexpr int kXtWsProducers = 256;  // two producer warpgroups: four condensed rows' chunks a thread a stage
constexpr int kXtWsThreads = kXtWsProducers + 256;
// The empty barriers after the full ones, and the tile of ones, of a warp-specialized kernel on XtLayout<XROW, !XROW>
// (the x^T one's deep layout; the tma engine's x rows).
template <bool XROW>
struct XtWsBars {
  using L = XtLayout<XROW, !XROW>;
  static constexpr int kEmptyOff = L::kBarOff + 8 * L::kStages;
  static constexpr int kOnesOff = (kEmptyOff + 8 * L::kStages + 1023) / 1024 * 1024;
  static constexpr int kSmemBytes = kEmptyOff + 8 * L::kStages + 1024;
  static constexpr int kSmemBytesDb = kOnesOff + L::kOnesBytes + 1024;
};

template <typename T, int DBK = 0>
__global__ void __launch_bounds__(kXtWsThreads, 1)
    SddmmWgmmaXtWsKernel(const SddmmParams p, const __grid_constant__ CUtensorMap tma_dy,
                         const __grid_constant__ CUtensorMap /*tma_xt: unused, the rows are gathered*/,
                         const __grid_constant__ CUtensorMap tma_dy1, const __grid_constant__ CUtensorMap tma_dy2,
                         const SddmmParts parts) {
#ifdef JAXSPARSE_WGMMA
  using L = XtLayout<false, true>;
  using B = XtWsBars<false>;
  constexpr int S = L::kStages, NC = L::kNC, GC = L::kGC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + L::kBarOff, empty0 = smem_base + B::kEmptyOff;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int row0 = blockIdx.x * kXtBR;
  const int g0 = blockIdx.y * GC;
  const auto [kt_begin, num_kt] = CtaTokenTiles<kXtBT>(p);  // this CTA's token tiles
  const PartOf part = PartOfRow(p, parts, row0, tma_dy, tma_dy1, tma_dy2);  // its layer (SddmmParams::dy_rows)

  const XtBiasGrad<T, DBK> bias(smem + B::kOnesOff, smem_base + B::kOnesOff, L::kOnesBytes, tid, kXtWsThreads);
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      MbarInit(full0 + 8 * s, kXtWsProducers + 1);  // thread 0's expect_tx arrival and each producer's cp.async one
      MbarInit(empty0 + 8 * s, 8);   // every consumer warp done with the stage
    }
  }
  __syncthreads();

  float acc[NC / 2];
#pragma unroll
  for (int i = 0; i < NC / 2; ++i) acc[i] = 0.f;
  float acc_db[4] = {0.f, 0.f, 0.f, 0.f};  // m64n8: every column holds the row's sum

  static_assert(kXtWsProducers == kXtThreads, "the producers gather as the deep kernel's threads do (XtRowGather)");
  if (tid < kXtWsProducers) {  // ------------------------------------ producers
    XtRowGather<T> gather;
    gather.Init(p, tid, part.row / p.v, g0, part.cols);  // one V block holds the CTA's rows
    for (int j = 0; j < num_kt; ++j) {
      const int s = j % S;
      const uint32_t base = smem_base + s * L::kStageBytes, full = full0 + 8 * s;
      if (j >= S) MbarWait(empty0 + 8 * s, ((j / S) & 1) ^ 1);  // the consumers gave the slot back
      const int t0 = (kt_begin + j) * kXtBT;
      if (tid == 0) {
        MbarArriveExpectTx(full, 2 * L::kDyHalf);
        TmaLoad2d(base, part.dy, part.row, t0, full);
        TmaLoad2d(base + L::kDyHalf, part.dy, part.row + 64, t0, full);
      }
      gather.Issue(base + L::kXcOff, t0, p.tokens);
      CpAsyncMbarArrive(full);
    }
    CpAsyncWait<0>();
  } else {  // ------------------------------------------------------ consumers
    XtWsConsume<T, false, DBK>(acc, acc_db, bias, smem_base, full0, empty0, num_kt, wg - kXtWsProducers / 128, lane);
    bias.Store(p, acc_db, row0, tid - kXtWsProducers);
  }

  __syncthreads();  // every copy landed and every wgmma completed: the ring becomes the epilogue's tile
  float* tile = reinterpret_cast<float*>(smem);
  if (tid >= kXtWsProducers) StageWgmmaAccumulators<NC>(tile, L::kEpiRowFloats, acc, tid - kXtWsProducers);
  __syncthreads();
  StoreKeptPairs<T, kXtBR, GC, kXtWsThreads>(p, tile, L::kEpiRowFloats, row0, g0, tid, part.meta, part.row);
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// The tma engine warp-specialized (session 57; XtLayout<true, false>: x rows, four 48 KB stages): warpgroup 0 is the
// producer, whose thread 0 alone fills the ring by TMA (dy's two boxes and x's four, one expect_tx a stage; the others
// leave at once), warpgroups 1 and 2 run the m64n256 products of the two 64-row halves and give each stage back on
// its empty barrier once wgmma.wait_group 1 shows its products completed, as SddmmWgmmaXtWsKernel does. So the loads
// run three stages ahead of the products with no CTA barrier inside the loop, where the barrier kernel that ran x rows
// before (SddmmWgmmaXtKernel's XROW) loaded two ahead behind a barrier a stage: 4.5-5.5 % faster in the step
// (docs/kernel-notes.md, session 57). The consumers stage and store the kept pairs alone (named barrier 1).
template <typename T, int DBK = 0>
__global__ void __launch_bounds__(kWsThreads, 1)
    SddmmWgmmaXrWsKernel(const SddmmParams p, const __grid_constant__ CUtensorMap tma_dy,
                         const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_dy1,
                         const __grid_constant__ CUtensorMap tma_dy2, const SddmmParts parts) {
#ifdef JAXSPARSE_WGMMA
  using L = XtLayout<true, false>;
  using B = XtWsBars<true>;
  constexpr int S = L::kStages, NC = L::kNC, GC = L::kGC;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + L::kBarOff, empty0 = smem_base + B::kEmptyOff;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int row0 = blockIdx.x * kXtBR;
  const int g0 = blockIdx.y * GC;
  const auto [kt_begin, num_kt] = CtaTokenTiles<kXtBT>(p);  // this CTA's token tiles
  const PartOf part = PartOfRow(p, parts, row0, tma_dy, tma_dy1, tma_dy2);  // its layer (SddmmParams::dy_rows)

  const XtBiasGrad<T, DBK> bias(smem + B::kOnesOff, smem_base + B::kOnesOff, L::kOnesBytes, tid, kWsThreads);
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      MbarInit(full0 + 8 * s, 1);  // thread 0's expect_tx arrival
      MbarInit(empty0 + 8 * s, 8);  // every consumer warp done with the stage
    }
  }
  __syncthreads();

  if (wg == 0) {  // ------------------------------------------------ producer
    SetMaxRegisters<WsRegs<true>::kProducer, false>();
    if (tid != 0) return;
    for (int j = 0; j < num_kt; ++j) {
      const int s = j % S;
      const uint32_t base = smem_base + s * L::kStageBytes, full = full0 + 8 * s;
      if (j >= S) MbarWait(empty0 + 8 * s, ((j / S) & 1) ^ 1);  // the consumers gave the slot back
      const int t0 = (kt_begin + j) * kXtBT;
      MbarArriveExpectTx(full, 2 * L::kDyHalf + L::kXcTile);
      TmaLoad2d(base, part.dy, part.row, t0, full);
      TmaLoad2d(base + L::kDyHalf, part.dy, part.row + 64, t0, full);
      LoadXRowBoxes<NC>(p, &tma_x, base + L::kXcOff, row0, g0, t0, full);
    }
    return;
  }
  // ---------------------------------------------------------------- consumers
  SetMaxRegisters<WsRegs<true>::kConsumer, true>();
  const int t = tid - 128, cw = wg - 1;  // t: the thread among the consumers
  float acc[NC / 2];
#pragma unroll
  for (int i = 0; i < NC / 2; ++i) acc[i] = 0.f;
  float acc_db[4] = {0.f, 0.f, 0.f, 0.f};  // m64n8: every column holds the row's sum
  XtWsConsume<T, true, DBK>(acc, acc_db, bias, smem_base, full0, empty0, num_kt, cw, lane);
  bias.Store(p, acc_db, row0, t);

  NamedBarSync(1, 256);  // every stage landed and every consumer's products completed: the ring becomes the tile
  float* tile = reinterpret_cast<float*>(smem);
  StageWgmmaAccumulators<NC>(tile, L::kEpiRowFloats, acc, t);
  NamedBarSync(1, 256);
  StoreKeptPairs<T, kXtBR, GC, 256>(p, tile, L::kEpiRowFloats, row0, g0, t, part.meta, part.row);
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// The four floats at src summed over `planes` planes n floats apart, in plane order (so the result does not depend on
// the grid).
__device__ __forceinline__ float4 SumPlanes(const float* __restrict__ src, int64_t n, int planes) {
  float4 acc = *reinterpret_cast<const float4*>(src);
  for (int s = 1; s < planes; ++s) {
    const float4 v = *reinterpret_cast<const float4*>(src + s * n);
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  return acc;
}

// out[i] = sum over the S token ranges of partial[s, i], in T or float32, for i < n (n = R * 2G; 0 when the values
// were not split); db[j] = sum over the db_planes planes of db_partial[q, j], for j < rows (the bias gradient; rows 0
// without one).
template <typename T>
__global__ void __launch_bounds__(256) SddmmReduceKernel(const float* __restrict__ partial, void* out, int64_t n,
                                                         int splits, int out_f32, const float* __restrict__ db_partial,
                                                         float* db, int rows, int db_planes) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * 4;
  for (int64_t i = first; i < n; i += step) {  // the values, over the S token ranges (n = 0: not split)
    const float4 acc = SumPlanes(partial + i, n, splits);
    if (out_f32) {
      *reinterpret_cast<float4*>(static_cast<float*>(out) + i) = acc;
    } else {
      uint2 packed = make_uint2(PackPair<T>(acc.x, acc.y), PackPair<T>(acc.z, acc.w));
      *reinterpret_cast<uint2*>(static_cast<T*>(out) + i) = packed;
    }
  }
  for (int64_t i = first; i < rows; i += step)  // the bias gradient, over its planes (rows = 0: none)
    *reinterpret_cast<float4*>(db + i) = SumPlanes(db_partial + i, rows, db_planes);
}

// ---------------------------------------------------------------- host side

// Token ranges for a grid of `tiles` (row, group) CTAs over `all_kt` token tiles: `split` as the attribute
// says (1 = none, 0 = auto, n > 1 = n), never more than the token tiles.
int ChooseSplits(int split, int tiles, int all_kt, int ctas_per_sm) {
  int s = split;
  if (s == 0) {
    // Measured on the H100 (docs/kernel-notes.md): splitting a grid that already fills the GPU costs more
    // than it gains (1024x4096 at M = 8: 256 tiles, 0.64 -> 0.69 ms with 2 ranges); a grid under one CTA
    // per SM gains 2.4x (1024x1024 at M = 8: 64 tiles, 0.42 -> 0.18 ms with 5 ranges).
    // The one-CTA x^T and tma engines split any grid of fewer tiles than SMs. They take the count whose waves of whole
    // SMs times token tiles a range is least (the fewest ranges among equals): one wave of SmCount / tiles ranges where
    // that is best, as before session 56; more waves where one wave leaves SMs idle (three stacked 1024-row layers
    // of the x^T engine: 48 tiles, 8 ranges in three waves against 2 in one; of the tma engine: 96 tiles, 4 ranges in
    // three waves against none). Engines of two CTAs per SM aim at two per SM.
    if (ctas_per_sm == 1 ? tiles >= SmCount() : 2 * tiles > SmCount())
      return 1;  // wgmma engine, 1024x4096 at M = 8: 128 tiles, 0.57 -> 0.61 ms split in 2
    if (ctas_per_sm == 1) {
      const int most = std::max(1, std::min(all_kt / 4, 16));
      int64_t best_cost = -1;
      for (int c = 1; c <= most; ++c) {
        const int64_t waves = (static_cast<int64_t>(tiles) * c + SmCount() - 1) / SmCount();
        const int64_t cost = waves * ((all_kt + c - 1) / c);
        if (best_cost < 0 || cost < best_cost) best_cost = cost, s = c;
      }
    } else {
      s = std::min(std::min((2 * SmCount() + tiles - 1) / tiles, all_kt / 4), 16);
    }
  }
  return std::max(1, std::min(s, all_kt));
}

// Engine attribute: 0 = auto (the TMA engine for 2:4 from x [T, K], else wgmma where it applies), 1 = mma.sync,
// 2 = wgmma (the row-major gather engine), 3 = tma (SddmmWgmmaXtKernel on x [T, K], 2:4 only); 2 and 3 are an
// error where they cannot run.
constexpr int kEngineAuto = 0, kEngineMma = 1, kEngineWgmma = 2, kEngineTma = 3;

// The float32 planes of the token split: the handler's second result.
struct Partials {
  float* data;
  int64_t elements;
};

// The operands of stacked layers (SddmmParams::dy_rows; the handler's further operands): layer i's dy [T, dy_rows]
// (ptr[0] is p.dy) and its columns and metadata (kernel.cols[0], kernel.meta[0] are p.cols, p.meta), for i < parts;
// entries past the last repeat the first (never read).
struct DyParts {
  const void* ptr[kSddmmMaxParts] = {};
  SddmmParts kernel{};
  int parts = 1;
};

// The bias gradient's output (the handler's third result, R floats) and how many column tiles share its token
// tiles (DbWays, the planes each token range writes); out null: none asked for.
struct BiasGrad {
  float* out = nullptr;
  int ways = 0;
};

// Splits the token range (`split` as ChooseSplits reads it, at most as many ranges as `partials` holds planes,
// after the bias gradient's db.ways planes a range) over `tiles` CTAs of BT-token stages, launches
// `launch(grid_z)` and the ordered reduction of the value planes and the bias gradient's.
template <typename T, typename LaunchFn>
ffi::Error LaunchSplit(cudaStream_t stream, SddmmParams p, int split, int tiles, int bt, const Partials& partials,
                       LaunchFn launch, int ctas_per_sm = 2, BiasGrad db = {}) {
  const int all_kt = (p.tokens + bt - 1) / bt;
  const int64_t n = static_cast<int64_t>(p.rows) * 2 * p.groups;
  const int64_t db_plane = db.out != nullptr ? static_cast<int64_t>(p.rows) * db.ways : 0;  // one range's planes
  if (partials.elements < db_plane)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the split buffer holds " + std::to_string(partials.elements) +
                                       " floats, under the bias gradient's " + std::to_string(db_plane));
  int splits = static_cast<int>(
      std::min<int64_t>(ChooseSplits(split, tiles, all_kt, ctas_per_sm), partials.elements / (n + db_plane)));
  p.kt_per_split = splits > 1 ? (all_kt + splits - 1) / splits : std::max(all_kt, 1);
  splits = splits > 1 ? (all_kt + p.kt_per_split - 1) / p.kt_per_split : 1;  // no empty range
  p.partial = splits > 1 ? partials.data : nullptr;
  p.db_partial = db.out != nullptr ? partials.data + (splits > 1 ? splits * n : 0) : nullptr;
  if (ffi::Error e = launch(p, splits); e.failure() || (splits == 1 && db.out == nullptr)) return e;
  const int64_t n_values = splits > 1 ? n : 0, rows = db.out != nullptr ? p.rows : 0;
  const int blocks = static_cast<int>(std::min<int64_t>(((n_values + rows) / 4 + 255) / 256, 4 * SmCount()));
  SddmmReduceKernel<T><<<blocks, 256, 0, stream>>>(p.partial, p.out, n_values, splits, p.out_f32, p.db_partial,
                                                   db.out, static_cast<int>(rows), splits * db.ways);
  return LastLaunchError("SddmmReduceKernel");
}

// x^T [K, T] (x_layout = 1): the x^T engine, the only one that reads it; with XROW (2:4), the same engine on
// x [T, K] (x_layout = 0), chosen by Dispatch. DBK > 0: with the bias gradient (DBK k16 steps a stage per CTA).
// DEEP: x^T where a CTA's rows sit in one V block (XtLayout). WS: the warp-specialized kernels, SddmmWgmmaXtWsKernel
// (with DEEP, gathered rows) and SddmmWgmmaXrWsKernel (XROW).
template <typename T, bool XROW, int DBK, bool DEEP, bool WS>
constexpr auto XtKernel() {
  if constexpr (WS && XROW)
    return SddmmWgmmaXrWsKernel<T, DBK>;
  else if constexpr (WS)
    return SddmmWgmmaXtWsKernel<T, DBK>;
  else
    return SddmmWgmmaXtKernel<T, DBK, DEEP>;
}

template <typename T, bool XROW, int DBK, bool DEEP = false, bool WS = false>
ffi::Error LaunchXtKernel(cudaStream_t stream, const SddmmParams& p, int split, const Partials& partials, float* db_out,
                          const DyParts& dys) {
  static_assert(XROW ? WS && !DEEP : !WS || DEEP, "x rows run warp-specialized; so does x^T, in the deep layout only");
  constexpr auto kernel = XtKernel<T, XROW, DBK, DEEP, WS>();
  const std::string what = XROW ? "jaxsparse_sddmm: the tma engine" : "jaxsparse_sddmm: x^T (x_layout 1)";
  if (!Sm90aImageLoaded<kernel>()) return ffi::Error::InvalidArgument(what + " needs an sm_90a build on a Hopper GPU");
  if (!XROW && !WS && DEEP != (p.cols == nullptr))  // the deep kernel takes x^T's rows by TMA, the other gathers them
    return ffi::Error::Internal(what + ": the deep layout is for 2:4, the gathering one for V:2:M (LaunchXt)");
  if (p.rows % kXtBR || (!XROW && p.tokens % 8))
    return ffi::Error::InvalidArgument(what + (XROW ? " needs R % 128 == 0" : " needs R % 128 == 0 and T % 8 == 0"));
  using L = XtLayout<XROW, DEEP>;
  using B = XtWsBars<XROW>;
  constexpr int kSmem = WS ? (DBK > 0 ? B::kSmemBytesDb : B::kSmemBytes) : (DBK > 0 ? L::kSmemBytesDb : L::kSmemBytes);
  constexpr int kThreads = !WS ? kXtThreads : XROW ? kWsThreads : kXtWsThreads;
  if (ffi::Error e = RaiseSmemLimit<kernel>(kSmem, "cudaFuncSetAttribute(SddmmWgmmaXtKernel)"); e.failure()) return e;
  if (p.dy_rows % kXtBR || p.rows != p.dy_rows * dys.parts)  // a CTA's 128 rows in one layer's dy (PartOfRow)
    return ffi::Error::Internal(what + ": stacked layers need dy_rows % 128 == 0 and R = parts * dy_rows");
  CUtensorMap tma_dy[kSddmmMaxParts] = {}, tma_xt{};
  for (int i = 0; i < kSddmmMaxParts; ++i)  // parts past the last repeat the first (PartOfRow never picks them)
    if (!MakeTensorMap2d(&tma_dy[i], dys.ptr[i < dys.parts ? i : 0], p.tokens, p.dy_rows, kXtBT))
      return ffi::Error::Internal("jaxsparse_sddmm: cuTensorMapEncodeTiled failed for dy");
  if ((XROW && !MakeTensorMap2d(&tma_xt, p.x, p.tokens, static_cast<uint64_t>(p.k) * p.x_blocks, kXtBT)) ||
      (!XROW && p.cols == nullptr && !MakeTensorMap2d(&tma_xt, p.x, p.k, p.tokens, L::kNC)))
    return ffi::Error::Internal("jaxsparse_sddmm: cuTensorMapEncodeTiled failed for the x^T engine");
  const int gy = (p.groups + L::kGC - 1) / L::kGC;
  if (gy < DbWays(DBK))  // (jaxsparse.ffi.calls.sddmm_bias_grad_fused asks for it only where the grid has them)
    return ffi::Error::InvalidArgument(what + ": the bias gradient needs at least " + std::to_string(DbWays(DBK)) +
                                       " column tiles of " + std::to_string(L::kGC) + " groups");
  const BiasGrad db{db_out, DbWays(DBK)};
  return LaunchSplit<T>(
      stream, p, split, (p.rows / kXtBR) * gy, kXtBT, partials,
      [&](const SddmmParams& q, int z) {
        kernel<<<dim3(p.rows / kXtBR, gy, z), kThreads, kSmem, stream>>>(q, tma_dy[0], tma_xt, tma_dy[1],
                                                                          tma_dy[2], dys.kernel);
        return LastLaunchError("SddmmWgmmaXtKernel");
      },
      1, db);
}

// The x^T engine with or without the bias gradient (db_out): its tiles hold half as many groups as the tma engine's,
// so a stage's four k16 steps are shared over two column tiles where it has them, else every CTA takes all four.
template <typename T, bool DEEP, bool WS = false>
ffi::Error LaunchXtColumns(cudaStream_t stream, const SddmmParams& p, int split, const Partials& partials,
                           float* db_out, const DyParts& dys) {
  if (db_out == nullptr) return LaunchXtKernel<T, false, 0, DEEP, WS>(stream, p, split, partials, nullptr, dys);
  if (p.groups > XtLayout<false, DEEP>::kGC)
    return LaunchXtKernel<T, false, 2, DEEP, WS>(stream, p, split, partials, db_out, dys);
  return LaunchXtKernel<T, false, 4, DEEP, WS>(stream, p, split, partials, db_out, dys);
}

// With the bias gradient (db_out): the tma engine (XROW) shares a stage's four k16 steps over four column tiles (it
// is asked for only where the grid has them); the x^T engine as LaunchXtColumns says, six stages deep where a CTA's
// rows sit in one V block.
template <typename T, bool XROW>
ffi::Error LaunchXt(cudaStream_t stream, const SddmmParams& p, int split, const Partials& partials, float* db_out,
                    const DyParts& dys) {
  if constexpr (XROW) {  // warp-specialized (SddmmWgmmaXrWsKernel)
    if (db_out == nullptr) return LaunchXtKernel<T, true, 0, false, true>(stream, p, split, partials, nullptr, dys);
    return LaunchXtKernel<T, true, 1, false, true>(stream, p, split, partials, db_out, dys);
  } else {
    // One V block a CTA (V % 128 == 0, or 2:4): one B tile a stage, six stages deep; gathered rows (V:2:M) by the
    // warp-specialized kernel.
    if (p.cols != nullptr && p.v % kXtBR == 0)
      return LaunchXtColumns<T, true, true>(stream, p, split, partials, db_out, dys);
    if (p.cols == nullptr) return LaunchXtColumns<T, true>(stream, p, split, partials, db_out, dys);
    return LaunchXtColumns<T, false>(stream, p, split, partials, db_out, dys);
  }
}

template <typename T, int M>
ffi::Error Launch(cudaStream_t stream, const SddmmParams& p, int split, int engine, const Partials& partials) {
  if constexpr (M <= 16) {
    const bool fits = p.rows % kWgBR == 0;
    if (engine == kEngineWgmma && !(fits && Sm90aImageLoaded<SddmmWgmmaKernel<T, M>>()))
      return ffi::Error::InvalidArgument(
          "jaxsparse_sddmm: the wgmma engine needs an sm_90a build on a Hopper GPU and R a multiple of 128");
    if (engine != kEngineMma && fits && Sm90aImageLoaded<SddmmWgmmaKernel<T, M>>()) {
      constexpr int kSmem = WgLayout<M>::kSmemBytes;
      constexpr int GC = WgCfg<M>::GC;
      if (ffi::Error e = RaiseSmemLimit<SddmmWgmmaKernel<T, M>>(kSmem, "cudaFuncSetAttribute(SddmmWgmmaKernel)");
          e.failure())
        return e;
      const int gy = (p.groups + GC - 1) / GC;
      return LaunchSplit<T>(stream, p, split, (p.rows / kWgBR) * gy, kWgBT, partials, [&](const SddmmParams& q, int z) {
        SddmmWgmmaKernel<T, M><<<dim3(p.rows / kWgBR, gy, z), kWgThreads, kSmem, stream>>>(q);
        return LastLaunchError("SddmmWgmmaKernel");
      });
    }
  } else if (engine == kEngineWgmma) {
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the wgmma engine takes M in {4, 8, 16}");
  }
  constexpr int kSmem = SddmmLayout<M>::kSmemBytes;
  constexpr int GC = SddmmCfg<M>::GC;
  if (ffi::Error e = RaiseSmemLimit<SddmmKernel<T, M>>(kSmem, "cudaFuncSetAttribute(SddmmKernel)"); e.failure())
    return e;
  const int gy = (p.groups + GC - 1) / GC;
  return LaunchSplit<T>(stream, p, split, (p.rows / kSdBR) * gy, kSdBT, partials, [&](const SddmmParams& q, int z) {
    SddmmKernel<T, M><<<dim3(p.rows / kSdBR, gy, z), kSdThreads, kSmem, stream>>>(q);
    return LastLaunchError("SddmmKernel");
  });
}

// The engine for (m, engine, x_layout) as the handler chooses it. A bias gradient (db_out) is computed by the tma
// engine and the x^T engine only; elsewhere asking for one is an error, which
// jaxsparse.ffi.calls.sddmm_bias_grad_fused predicts.
template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const SddmmParams& p, int m, int split, int engine, int x_layout,
                    const Partials& partials, float* db_out, const DyParts& dys) {
  const auto no_db = [&]() -> ffi::Error {
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the bias gradient (a third result of R floats) is computed "
                                       "by the tma engine (x [T, K], M = 4 or the 2:4 view) and the x^T engine "
                                       "(x_layout 1) only, R % 128 == 0, an sm_90a build on a Hopper GPU; pass an "
                                       "empty third result elsewhere");
  };
  if (x_layout == 1) return LaunchXt<T, false>(stream, p, split, partials, db_out, dys);
  const bool tma_image = Sm90aImageLoaded<SddmmWgmmaXrWsKernel<T>>();  // the tma engine can run
  // Only the tma engine reads a diagonal block's columns of x and, besides the x^T engine, stacked layers' dy (by TMA;
  // the handler refuses the two together).
  if (dys.parts > 1 || p.x_blocks > 1 || p.x_chunks != nullptr) {
    if (m != 4 || engine == kEngineMma || engine == kEngineWgmma || !tma_image)
      return ffi::Error::InvalidArgument("jaxsparse_sddmm: x_blocks > 1, x_chunks and stacked layers (further "
                                         "operands) run on the tma engine (engine auto or tma, 2:4, an sm_90a build on "
                                         "a Hopper GPU); stacked layers also on the x^T engine (x_layout 1)");
    return LaunchXt<T, true>(stream, p, split, partials, db_out, dys);
  }
  // 2:4 from x [T, K] on Hopper: the TMA engine reads x as it is (the x^T engine's TMA path took 0.28 ms against
  // 0.39 for the row-major wgmma engine at 16384x1024x4096; docs/kernel-notes.md, sessions 6 and 7).
  if (engine == kEngineTma) {
    if (m != 4) return ffi::Error::InvalidArgument("jaxsparse_sddmm: the tma engine takes 2:4 only");
    return LaunchXt<T, true>(stream, p, split, partials, db_out, dys);
  }
  if (m == 4 && engine == kEngineAuto && p.rows % kXtBR == 0 && tma_image)
    return LaunchXt<T, true>(stream, p, split, partials, db_out, dys);
  if (db_out != nullptr) return no_db();
  return DispatchGroupWidth("jaxsparse_sddmm", m, [&](auto width) {
    return Launch<T, decltype(width)::value>(stream, p, split, engine, partials);
  });
}

ffi::Error SddmmImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Buffer<ffi::U8> columns,
                     ffi::Buffer<ffi::U32> metadata, ffi::Buffer<ffi::S32> x_chunks, ffi::RemainingArgs further,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::F32>> dbias, int32_t v,
                     int32_t m, int32_t split, int32_t engine, int32_t x_layout, int32_t x_blocks) {
  if (x.dimensions().size() != 2 || dy.dimensions().size() != 2 || metadata.dimensions().size() != 2 ||
      out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x, dy, metadata and output must be 2-D");
  // x_layout 1: the operand is x^T [K, T] (jaxsparse_transpose's output), row-major.
  if (x_blocks < 1 || (x_blocks > 1 && x_layout != 0))
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x_blocks must be >= 1, and above 1 needs x [T, K] (x_layout 0)");
  // Stacked layers of one input: the further operands are the other layers' (dy, columns, metadata) triples, each of
  // the first's shapes and dtype; the output's rows stack the layers' (R = parts * dy's columns).
  if (further.size() % 3 || further.size() / 3 + 1 > static_cast<size_t>(kSddmmMaxParts))
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the further layers come as (dy, columns, metadata) triples, "
                                       "at most " + std::to_string(kSddmmMaxParts - 1) + ", got " +
                                       std::to_string(further.size()) + " operands");
  const int parts = static_cast<int>(further.size() / 3) + 1;
  if (parts > 1 && (x_blocks != 1 || x_chunks.element_count() != 0 || Dim(dy, 1) % kXtBR))
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: stacked layers need x_blocks = 1, no x_chunks and each dy's "
                                       "R % 128 == 0, got dy " + ShapeString(dy));
  const int64_t tokens = Dim(x, x_layout == 1 ? 1 : 0), width = Dim(x, x_layout == 1 ? 0 : 1), k = width / x_blocks,
                dy_rows = Dim(dy, 1), rows = dy_rows * parts, groups = out->dimensions()[1] / 2;
  if (width % x_blocks || (x_blocks > 1 && rows % (int64_t(kXtBR) * x_blocks)))
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x_blocks = " + std::to_string(x_blocks) + " diagonal blocks "
                                       "need x's width a multiple of x_blocks and R % (128 x_blocks) == 0, got x " +
                                       ShapeString(x) + ", R = " + std::to_string(rows));
  if (x_chunks.element_count() != 0 &&
      (x_layout != 0 || k % 64 || static_cast<int64_t>(x_chunks.element_count()) != x_blocks * (k / 64)))
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x_chunks needs x [T, K] (x_layout 0), K % 64 == 0 per block "
                                       "and x_blocks * K/64 entries, got " + ShapeString(x_chunks) + " for K = " +
                                       std::to_string(k) + ", x_blocks = " + std::to_string(x_blocks));
  // Stacked 2:4 metadata (jaxsparse.ffi.calls.as_2_4_stacked's views): the first metadata holds every part's rows,
  // [parts R, G/8], and the further triples carry empty columns and metadata; part i's words are its rows i R ...
  const bool meta_stacked = parts > 1 && m == 4 && metadata.dimensions()[0] == rows;
  const int64_t words = groups / 8;
  if (meta_stacked) {
    if (ffi::Error e = CheckSparseWeight("jaxsparse_sddmm", rows, groups, columns, metadata, v, m); e.failure())
      return e;
  } else if (ffi::Error e = CheckSparseWeight("jaxsparse_sddmm", dy_rows, groups, columns, metadata, v, m);
             e.failure()) {
    return e;
  }
  DyParts dys;
  dys.parts = parts;
  for (int i = 0; i < kSddmmMaxParts; ++i) {  // entries past the last repeat the first (never read)
    dys.ptr[i] = dy.untyped_data();
    dys.kernel.cols[i] = m > 4 ? columns.typed_data() : nullptr;
    dys.kernel.meta[i] = metadata.typed_data() + (meta_stacked && i < parts ? i * dy_rows * words : 0);
  }
  for (int i = 1; i < parts; ++i) {
    auto d = further.get<ffi::AnyBuffer>(3 * (i - 1));
    auto c = further.get<ffi::Buffer<ffi::U8>>(3 * (i - 1) + 1);
    auto md = further.get<ffi::Buffer<ffi::U32>>(3 * (i - 1) + 2);
    if (d.has_error()) return d.error();
    if (c.has_error()) return c.error();
    if (md.has_error()) return md.error();
    if (d->dimensions().size() != 2 || Dim(*d, 0) != Dim(dy, 0) || Dim(*d, 1) != dy_rows ||
        d->element_type() != dy.element_type())
      return ffi::Error::InvalidArgument("jaxsparse_sddmm: every further dy must have dy's shape " + ShapeString(dy) +
                                         " and dtype, got " + ShapeString(*d));
    dys.ptr[i] = d->untyped_data();
    if (meta_stacked) {
      if (c->element_count() != 0 || md->element_count() != 0)
        return ffi::Error::InvalidArgument("jaxsparse_sddmm: with stacked metadata (" + ShapeString(metadata) +
                                           ") the further layers' columns and metadata must be empty, got " +
                                           ShapeString(*c) + " and " + ShapeString(*md));
      continue;
    }
    if (ffi::Error e = CheckSparseWeight("jaxsparse_sddmm", dy_rows, groups, *c, *md, v, m); e.failure()) return e;
    dys.kernel.cols[i] = m > 4 ? c->typed_data() : nullptr;
    dys.kernel.meta[i] = md->typed_data();
  }
  if (Dim(dy, 0) != tokens || k != groups * m || out->dimensions()[0] != rows ||
      out->dimensions()[1] != 2 * groups || rows % kSdBR)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: inconsistent shapes: x " + ShapeString(x) + ", dy " +
                                       ShapeString(dy) + ", metadata " + ShapeString(metadata) + ", out " +
                                       ShapeString(*out));
  const auto dt = x.element_type();
  if (dy.element_type() != dt)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x and dy must share one dtype");
  if (out->element_type() != dt && out->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the output must be in the input dtype or float32");
  if (split < 0) return ffi::Error::InvalidArgument("jaxsparse_sddmm: split must be >= 0 (0 = auto, 1 = none)");
  if (engine < kEngineAuto || engine > kEngineTma)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: engine must be 0 (auto), 1 (mma.sync), 2 (wgmma) or 3 (tma)");
  if (engine == kEngineTma && x_layout != 0)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the tma engine reads x [T, K] (x_layout 0)");
  if (x_layout != 0 && x_layout != 1)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: x_layout must be 0 (x [T, K]) or 1 (x^T [K, T])");
  if (dbias->element_count() != 0 && static_cast<int64_t>(dbias->element_count()) != rows)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: the bias gradient result must hold R = " + std::to_string(rows) +
                                       " floats, or none, got " + ShapeString(*dbias));
  float* db_out = dbias->element_count() != 0 ? dbias->typed_data() : nullptr;
  if (groups == 0 && db_out != nullptr)  // no CTA would run to write it
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: a bias gradient needs K > 0");
  if (rows == 0 || groups == 0) return ffi::Error::Success();
  if (tokens >= (int64_t(1) << 30) || k >= (int64_t(1) << 30) || rows >= (int64_t(1) << 30) ||
      (groups + 7) / 8 > 65535)
    return ffi::Error::InvalidArgument("jaxsparse_sddmm: shape too large");

  SddmmParams p;
  p.x = x.untyped_data();
  p.dy = dy.untyped_data();
  p.cols = m > 4 ? columns.typed_data() : nullptr;
  p.meta = metadata.typed_data();
  p.out = out->untyped_data();
  p.tokens = static_cast<int>(tokens);  // 0 tokens: the kernel writes zeros
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);
  p.groups = static_cast<int>(groups);
  p.v = v;
  p.out_f32 = out->element_type() == ffi::F32;
  p.x_blocks = x_blocks;
  p.x_chunks = x_chunks.element_count() != 0 ? x_chunks.typed_data() : nullptr;
  p.dy_rows = static_cast<int>(dy_rows);
  const Partials partials{partial->typed_data(), static_cast<int64_t>(partial->element_count())};
  p.db_partial = nullptr;
  if (dt == ffi::BF16) return Dispatch<__nv_bfloat16>(stream, p, m, split, engine, x_layout, partials, db_out, dys);
  if (dt == ffi::F16) return Dispatch<__half>(stream, p, m, split, engine, x_layout, partials, db_out, dys);
  return ffi::Error::InvalidArgument("jaxsparse_sddmm: x must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSddmm, jaxsparse::SddmmImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x [T, K], or x^T [K, T] (x_layout 1)
                                  .Arg<xla::ffi::AnyBuffer>()               // dy [T, R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // x_chunks [x_blocks, K/64] or [0]
                                  .RemainingArgs()                          // up to 2 more stacked layers' (dy,
                                                                            // columns, metadata)
                                  .Ret<xla::ffi::AnyBuffer>()               // dvalues [R, 2G], T or f32
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // token-split partial sums [S*R*2G] (+ the
                                                                            // bias gradient's planes) or [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()   // the bias gradient: dy summed over tokens
                                                                            // [R] (the tma engine), or [0] for none
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m")
                                  .Attr<int32_t>("split")    // 1 = none, 0 = auto, n > 1 = n ranges
                                  .Attr<int32_t>("engine")     // 0 = auto, 1 = mma.sync, 2 = wgmma, 3 = tma
                                  .Attr<int32_t>("x_layout")   // 0 = x [T, K], 1 = x^T [K, T]
                                  .Attr<int32_t>("x_blocks"),  // diagonal blocks of the weight (x_layout 0), 1 = none
                              JAXSPARSE_GRAPH_SAFE);

// Forward SpMM on Hopper from x^T:  Y[T, R] = act(X[T, K] @ W[K, R] + bias[R])  with the activations given
// as x^T [K, T] (tokens contiguous; jaxsparse_transpose writes it, and sparse_linear keeps it as the
// residual that the x^T SDDMM reads in the backward pass) and W as the compressed SparseWeight: values
// [R, 2G], metadata [R, G/8] and the kept columns [R/V, G, 4] (docs/format.md).
//
// Math view: Y^T[R, T] = A[R, 4G] Xc[4G, T], where A is W^T over each V block's 4 kept columns per group (2:4
// sparse: the stored values at their metadata positions) and Xc holds the kept rows of x^T (Y is stored [T, R]).
// A CTA owns BR output features inside one V block, so its condensed reduction has one column set: each kept
// column of X is a contiguous row of x^T, copied straight into shared memory (16 bytes = 8 tokens); only 4/M
// of X's bytes move, and no gather pass runs.  The product is wgmma.sp.m64nNk32 over the condensed reduction
// 4G: the tensor cores skip A's zeros, and A arrives compressed (the stored values, 2 per group).
//
// Per 64-k stage: A's values [BR][32] land K-major 64B-swizzled (trans-a = 0), Xc [64 k][BT tokens] MN-major
// 128B-swizzled (trans-b = 1); the stage's metadata words come into shared memory with it, and each thread builds
// its wgmma.sp operands from there into one of two register arrays (kSparseMetaRule).  Two warpgroups: BR = 128 puts
// them on the two 64-row halves (each over all BT tokens), BR = 64 on two token halves.  Pipeline: loads for stage
// kt+STAGES-2 issued right after stage kt's barrier; after issuing stage kt a warpgroup waits for its products of
// stage kt-1 (wgmma.wait_group 1), so one stage's products are in flight while the next is issued.
// Epilogue: + bias, optional activation (Activate), convert, stage as [BT tokens][BR features], 16-byte row stores.
// With attribute act_mode 1 (a feed-forward block's first layer, jaxsparse.ops.sparse_mlp) the stores write act(z)
// to y and act'(z) to a second output, z = x W + b (StagedExtra): the backward needs act'(z), and the activation's
// separate pass over z is gone.  Session 22 also built the backward's half (the input gradient times act'(z) in the
// epilogue, reading it where the stores write) and measured it no faster than XLA's multiply after the product
// (0.314 against 0.310 ms at 16384 x 1024 x 4096, benchmarks/ffn_epilogue.py), which XLA also fuses with the bias
// gradient's reduction: it was removed.  act_mode 2 (session 28) is act_mode 1 with act(z) stored transposed, [R, T],
// staged as a second tile (StageXtActTransposed, StoreStagedTileT): that is the x^T the block's second layer reads on
// this route, so its jaxsparse_transpose is gone (the plain kernel only, not the warp-specialized one).  Its staging
// computes act and act' once per element (v2 computed act there and both again in the store pass: no faster than
// act_mode 1 plus a transpose on the H100; docs/kernel-notes.md, session 28).  In bf16 with a GELU (attribute
// act_table, JAXSPARSE_ACT_TABLE) both modes read act and act' from the activation table of act_table.cuh, which each
// CTA copies into shared memory after its other buffers (4-10 % faster than the float32 formula, session 30).
// Needs T % 8 == 0 (16-byte rows of x^T) and R % BR == 0, BR <= V; the Python side takes this path only then.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "act_table.cuh"
#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"
#include "wgmma.cuh"

namespace jaxsparse {
namespace {

struct SpmmXtParams {
  const void* xt;        // [K, T]
  const void* values;    // [R, 2G]
  const uint32_t* meta;  // [R, G/8]
  const uint8_t* cols;   // [R/V, G, 4] or null (M = 4: every column kept)
  const void* bias;      // [R] or null
  void* y;               // [T, R]
  int tokens, k, rows, groups, v, m;
  int bias_f32;          // bias is float32 (else the input dtype)
  int activation;        // 0 none, 1 gelu (tanh), 2 gelu_erf, 3 relu (Activate)
  void* y2;              // null: y = act(x W + b); else (act_mode 1, 2) y = act(z), y2 = act'(z) for z = x W + b
  int y_t;               // act_mode 2: y is stored transposed, [R, T] (y2 stays [T, R])
  int meta_pairs;        // warp-specialized kernel: metadata by TMA pairs where they fit (LaunchWs clears it where not)
  int act_table;         // act_mode 1, 2 in bf16 with a GELU: act and act' from the table of cuda/act_table.cuh
  int x_blocks;          // x [T, x_blocks K] (x_rows, warp-specialized kernel): the weight is x_blocks diagonal blocks,
                         // row r reading x's columns (r / (rows / x_blocks)) K + [0, K); 1 = one block (x [T, K])
  const int32_t* x_chunks;  // [x_blocks, K/64] or null: block b's k-step j reads x's columns
                            // x_chunks[b, j] * 64 + [0, 64) (its input set in 64-column chunks, no relabelling);
                            // null = (b K/64 + j) * 64
  const int32_t* y_chunks;  // [R/64] or null (no y2): feature f is stored at y's column y_chunks[f/64] * 64 + f % 64
  const void* mul = nullptr;  // [T, R] or null (the warp-specialized kernel on x [T, K], act_mode 0, no y_chunks):
                              // y = (x W + b) * mul, the product in float32 rounded to T (the backward's dz)
};
// 128 bytes, as it was when the warp-specialized kernel was measured fast: a 152-byte version (x_parts as two fields
// here, session 54) made every warp-specialized kernel 3.4x slower with its code unchanged (docs/kernel-notes.md,
// session 54, calls 2-6). New fields go into a parameter of their own, as XtParts does.
static_assert(sizeof(SpmmXtParams) == 128, "SpmmXtParams: keep it 128 bytes (see above)");

// The warp-specialized kernel on x [T, K], x_blocks 1, no x_chunks, with count P > 1: the reduction runs over P
// operands of one shape [T, K/P], p.xt then x[0 .. P-2], in that order: y = sum_i x_i W_i for the weight [W_0; W_1;
// ...] (the input gradient of layers sharing their input, ops.shared_linear).  K/P % 64 == 0, so no k-step straddles
// two operands.
struct XtParts {
  int count = 1;
  const void* x[2] = {nullptr, nullptr};
};

// Attribute y_parts = P > 1 (act_mode 0, no y_chunks, no mul): the weight's R rows are P layers of R/P features each
// (attention's query, key and value stacked, ops.shared_linear), and feature f is stored in output f / (R/P) at
// column f % (R/P): y = [y_0, y_1, y_2] written where XLA holds them, so no slice follows.  (R/P) % BR == 0: no
// tile straddles two outputs.  A kernel parameter of its own (SpmmXtParams stays 128 bytes, see above).
struct YParts {
  int count = 1;
  int rows = 0;  // features per output, R/P
  void* y[3] = {nullptr, nullptr, nullptr};
};

// Where the tile of features [row0, row0 + BR) is stored: its output, that output's row length, and the tile's first
// column there.
struct TileOut {
  void* y;
  int rows, row0;
};
__device__ __forceinline__ TileOut TileOutput(const SpmmXtParams& p, const YParts& yp, int row0) {
  if (yp.count <= 1) return {p.y, p.rows, row0};
  const int part = row0 / yp.rows;
  return {part == 0 ? yp.y[0] : part == 1 ? yp.y[1] : yp.y[2], yp.rows, row0 - part * yp.rows};
}

// The stores' extra work for act_mode 1 (none without y2; act_mode 2 stages act and act' itself); `table` is the
// activation table in shared memory, or null; `mul`, the staged tile of p.mul (SpmmWgmmaXtWsKernel), or null.
__device__ __forceinline__ StagedExtra Extra(const SpmmXtParams& p, const uint32_t* table,
                                             const unsigned char* mul = nullptr, int mul_row_bytes = 0) {
  return StagedExtra{p.y2, p.activation, table, p.y_chunks, mul, mul_row_bytes};
}

// Where a CTA keeps the activation table: the table of p.activation copied from global memory into shared memory at
// `dst` (shared address; generic pointer `ptr`) by `threads` threads, or null where p.act_table is off.  The copies
// are cp.async, uncommitted: the caller commits them with its next group and waits for them before the epilogue.
template <typename T>
__device__ __forceinline__ const uint32_t* StartActTable(const SpmmXtParams& p, uint32_t dst, unsigned char* ptr,
                                                         int thread, int threads) {
  if constexpr (!std::is_same<T, __nv_bfloat16>::value) return nullptr;
  if (!p.act_table) return nullptr;
  LoadActTable(dst, p.activation, thread, threads);
  return reinterpret_cast<const uint32_t*>(ptr);
}

constexpr int kKc = 64;           // condensed k per stage: one 128-byte swizzle row of 16-bit values per k
constexpr int kThreads = 256;     // two warpgroups
constexpr int kColBytes = kKc * 128;  // one 64-wide M/N column of swizzle atoms over the stage's 64 k
constexpr int kAColBytes = 64 * 64;   // 64 rows of A's 32 stored values (64-byte swizzle) for the stage's 64 k

template <int BR, int BT, int STAGES>
struct XtLayout {
  static constexpr int kABytes = (BR / 64) * kAColBytes;
  static constexpr int kBBytes = (BT / 64) * kColBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  static constexpr int kMetaBytes = BR * 8;  // a stage's metadata words: [BR rows][2]
  static constexpr int kMetaOff = kPipeBytes;
  static constexpr int kYRowBytes = BR * 2 + 16;  // [BT tokens][BR features] + pad
  static constexpr int kEpiBytes = BT * kYRowBytes;
  static constexpr int kYtRowBytes = BT * 2 + 16;  // act_mode 2's act(z)^T: [BR features][BT tokens] + pad, after it
  static constexpr int kEpiTOff = kEpiBytes;
  static constexpr int kLoopBytes = kMetaOff + STAGES * kMetaBytes;
  static_assert(kEpiTOff + BR * kYtRowBytes <= kLoopBytes, "both epilogue tiles fit where the pipeline was");
  static constexpr int kColsOff = kLoopBytes > kEpiBytes ? kLoopBytes : kEpiBytes;  // the block's column bytes
  // The activation table (p.act_table) after the column bytes; LaunchTile's shared memory and the kernel both use it.
  __host__ __device__ static int TableOff(const SpmmXtParams& p) {
    return kColsOff + (p.cols != nullptr ? (4 * p.groups + 15) / 16 * 16 : 0);
  }
  static_assert(kStageBytes % 1024 == 0, "swizzle atoms are 1024-byte aligned");
};

// How a BR x BT tile splits over two (consumer) warpgroups: BR = 128 puts them on the two 64-feature halves,
// BR = 64 on two token halves; each runs NCH wgmmas of N = NW (at most NWMAX) per k32 step.
template <int BR, int BT, int NWMAX = 128>
struct XtWarps {
  static constexpr int WR = BR / 64;                // warpgroups along the features (1 or 2)
  static constexpr int WN = BT * WR / 2;            // tokens per warpgroup
  static constexpr int NW = WN >= NWMAX ? NWMAX : WN >= 128 ? 128 : 64;  // N of one wgmma
  static constexpr int NCH = WN / NW;               // wgmmas per k16 step
  static_assert(WN % NW == 0, "token tile");
};

// One pipeline stage (condensed k [q0, q0 + 64)) of A's values [BR][32] (unless WITH_A is false) and Xc [64
// k][BT tokens] into shared memory at `base` by cp.async from THREADS threads (this one is `thread`); `tcols` is
// the V block's kept columns (null at M = 4).
template <typename T, int BR, int BT, int THREADS, bool WITH_A = true>
__device__ __forceinline__ void LoadXtStage(uint32_t base, int q0, int thread, const SpmmXtParams& p, int row0, int tok0,
                                            const uint8_t* tcols) {
  constexpr int kBChunks = BT / 8;                 // 16-byte chunks of 8 tokens per k row of Xc
  constexpr int kBRows = THREADS / kBChunks;       // k rows of Xc per pass
  constexpr int kARows = THREADS / 4;              // A rows per pass (4 chunks of 8 stored values per row)
  const int kc_total = 4 * p.groups;
  const T* __restrict__ xt = static_cast<const T*>(p.xt);
  if (WITH_A) {
    const T* __restrict__ vals = static_cast<const T*>(p.values);
    const int a_r = thread >> 2, a_c = thread & 3, vs_total = 2 * p.groups;
    const bool a_ok = q0 / 2 + a_c * 8 < vs_total;  // 2G % 16 == 0: a chunk is all in or all out
    const T* a_src = vals + static_cast<int64_t>(row0 + a_r) * vs_total + q0 / 2 + a_c * 8;
#pragma unroll
    for (int i = 0; i < BR / kARows; ++i) {
      const int r = a_r + kARows * i;
      CpAsync16(base + Sw64KOffset(r, a_c * 8), a_ok ? a_src + static_cast<int64_t>(kARows * i) * vs_total : vals,
                a_ok ? 16 : 0);
    }
  }
  const int b_k = thread / kBChunks, b_c = thread % kBChunks;
  const bool b_tok_ok = tok0 + b_c * 8 < p.tokens;  // T % 8 == 0: a chunk is all in or all out
  const char* b_src = reinterpret_cast<const char*>(xt + tok0 + b_c * 8);
  const int row_bytes = p.tokens * static_cast<int>(sizeof(T));  // tokens < 2^30 (SpmmXtImpl)
  const uint32_t b_base = base + (BR / 64) * kAColBytes;
#pragma unroll
  for (int i = 0; i < kKc / kBRows; ++i) {
    const int kk = b_k + kBRows * i, q = q0 + kk;
    const bool ok = b_tok_ok && q < kc_total;
    const int krow = tcols != nullptr ? (q >> 2) * p.m + tcols[ok ? q : 0] : q;
    const void* src = ok ? static_cast<const void*>(b_src + MulWide(krow, row_bytes)) : xt;
    CpAsync16(b_base + Sw128MnOffset(b_c * 8, kk, kColBytes), src, ok ? 16 : 0);
  }
}

// kSparseMetaRule: a wgmma.sp reads its metadata register while it runs, not when it is issued, so that register
// must hold its value until the product completed.  Measured the hard way (session 7, device call 2): reloading
// the one metadata array after wait_group 1, with the stage's own products still in flight, gave wrong results
// on every 128-feature tile and on some 64-feature ones, and ptxas did not warn.  So the consumers keep two
// metadata arrays, one per stage parity (the k loop is unrolled by two so each array is a fixed set of
// registers): stage kt's array is filled when stage kt starts, while stage kt-1's products (on the other array)
// may still run, and the array was last read by stage kt-2, whose products have completed by then.  KeepMetaLive
// keeps the array's values live in the C++ compiler's view up to that point; it is an empty asm and emits no
// instruction, so below PTX the guarantee rests on ptxas treating a wgmma.sp's metadata operand as in use until
// its wait_group, which the x^T SpMM tests confirm on the H100 (sessions 8 and 9).
//
// Where the words come from (session 9): each stage's words, [BR rows][2] (words 2 kt and 2 kt + 1 of every row
// of the tile: condensed k [64 kt, 64 kt + 64)), are copied into shared memory with the stage by the threads
// that load it (cp.async, counted by the stage's barrier), and a consumer builds its operands from there once
// the stage is ready, so no consumer waits on a global load.  Measured on the 2:4 row kernel (Nsight Compute,
// docs/kernel-notes.md): loaded by the consumers right before use, the tensor pipe was active 31 % of the time
// (long-scoreboard stalls); fetched two stages ahead, 38 % (0.244 -> 0.212 ms at 1024x4096); staged here, 40 %
// (0.200 ms, within noise of the previous step).
template <int BR, int THREADS>
__device__ __forceinline__ void LoadStageMetaWords(uint32_t dst, const SpmmXtParams& p, int row0, int kt, int thread) {
  const int words = p.groups / 8;
#pragma unroll
  for (int q = 0; q < (2 * BR + THREADS - 1) / THREADS; ++q) {
    const int i = thread + q * THREADS;
    if (i >= 2 * BR) break;
    const int w = 2 * kt + (i & 1);
    const bool ok = w < words;
    CpAsync4Zfill(dst + 4 * i, ok ? p.meta + static_cast<int64_t>(row0 + (i >> 1)) * words + w : p.meta, ok ? 4 : 0);
  }
}

// Keeps the metadata array `e` live and unchanged in the C++ compiler's view up to this point, placed where the
// last wgmma.sp that read it has completed (kSparseMetaRule; emits no instruction).
__device__ __forceinline__ void KeepMetaLive(uint32_t (&e)[2]) { asm volatile("" : "+r"(e[0]), "+r"(e[1])::"memory"); }

// A consumer's wgmma.sp metadata operands: one array per stage parity (the k loop is
// unrolled by two, kSparseMetaRule).  `r` is the tile-local row of this thread's first word (rows r and r + 8),
// `words` = G/8 per row; past the end of the reduction the operand is 0x44444444 (positions 0 and 1: a valid
// pattern; A and Xc are zero there).
struct XtMeta {
  uint32_t e_even[2], e_odd[2];
  int r, words, tig;
  // Lane `lane` of warp wq of the warpgroup on 64-feature block `blk` of the tile; `words` = G/8.
  __device__ __forceinline__ XtMeta(int blk, int wq, int lane, int words_)
      : r(64 * blk + 16 * wq + (lane >> 2)), words(words_), tig(lane & 3) {}
  template <bool ODD>
  __device__ __forceinline__ uint32_t (&Operands())[2] {
    if constexpr (ODD) return e_odd;
    else return e_even;
  }
  // Stage kt's operands (parity ODD) from its words in shared memory (`stage_words`: row i's two words at
  // row_words * i and the next); the array was last read by stage kt-2, whose products have completed.
  template <bool ODD>
  __device__ __forceinline__ void Load(const uint32_t* stage_words, int kt, int row_words = 2) {
    uint32_t(&e)[2] = Operands<ODD>();
    KeepMetaLive(e);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      e[j] = 2 * kt + j < words
                 ? MetaWord(stage_words[row_words * r + j], stage_words[row_words * (r + 8) + j], tig, 0)
                 : 0x44444444u;
  }
};

// The wgmma.sp products of one stage for one warpgroup: its A rows (64-feature block `blk` of the tile) times its
// Xc tokens (from b_col, a 64-token column index), NCH products of N = NW per k32 step, with the metadata `e` of
// the two steps.
// Xc is MN-major (x^T rows: 64-token columns of kColBytes) or, with XROW, K-major (x's own rows: one 128-byte
// row of the stage's 64 k per token, as TMA lands a box of x [T, K]; trans-b = 0).
template <typename T, int BR, int NW, int NCH, bool XROW = false>
__device__ __forceinline__ void XtStageMma(float (&acc)[NCH][NW / 2], uint32_t stage, int blk, int b_col,
                                           const uint32_t (&e)[2]) {
#ifdef JAXSPARSE_WGMMA
  const uint32_t a_base = stage + blk * kAColBytes;
  const uint32_t b_base = stage + (BR / 64) * kAColBytes + b_col * kColBytes;  // (64 tokens x 128 B either way)
#pragma unroll
  for (int ks = 0; ks < kKc / 32; ++ks) {
    const uint64_t da = WgmmaDescSw64K(a_base + ks * 32, 512);
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      if (XROW) {
        const uint64_t db = WgmmaDescSw128(b_base + c * NW * 128 + ks * 64, 16, 1024);
        WgmmaSp<NW, T, 0>::Run(acc[c], da, db, e[ks]);
      } else {
        const uint64_t db = WgmmaDescSw128(b_base + c * (NW / 64) * kColBytes + ks * 4096, kColBytes, 1024);
        WgmmaSp<NW, T, 1>::Run(acc[c], da, db, e[ks]);
      }
    }
  }
#endif
}

// The plain x^T kernel's epilogue of one warpgroup (warp wq of it): + bias, the activation ACT (Activate's code, fixed
// at compile time), convert, into the staged [BT][BR] tile. The accumulators go in groups of two 8-token blocks of the
// warp's 16 features (four 8x8 tiles of the fragment); one stmatrix.trans stores each group as 16-byte feature rows of
// 16 tokens: 8 instructions a thread for 64 accumulators, where StageXtAccumulators below issues 64 2-byte stores.
// Session 48 measured both: stmatrix made the plain tile's 128:2:16 forward 6 % faster (8.22 -> 7.74 ms a step) and
// the warp-specialized kernel no faster (its input gradient) or 2 % slower (its 64:2:8 forward), so only the plain
// kernel takes it. The rows are row_bytes apart (BR * 2 + 16): a tile's 8 rows fall on 32 different banks.
template <typename T, int NW, int NCH, int ACT>
__device__ __forceinline__ void StageXtTileStMatrix(float (&acc)[NCH][NW / 2], unsigned char* tile, int row_bytes,
                                                    const SpmmXtParams& p, int row0, int r_base, int t_base, int wq,
                                                    int lane) {
#ifdef JAXSPARSE_WGMMA
  const int r_lo = r_base + 16 * wq + (lane >> 2);  // tile-local features r_lo, r_lo + 8
  const float bias_lo = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo);
  const float bias_hi = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo + 8);
  // Lane l gives row l % 8 of tile l / 8: token 8 (l / 16) + l % 8 of the 16, features 8 ((l / 8) % 2) on.
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) +
                        (t_base + 8 * (lane >> 4) + (lane & 7)) * row_bytes +
                        2 * (r_base + 16 * wq + 8 * ((lane >> 3) & 1));
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int u = 0; u < NW / 16; ++u) {
      const int t16 = c * NW + 16 * u;  // the 16 tokens of this group
      uint32_t r[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // tile j: 8-token block 2u + j / 2, feature half j % 2
        const int i = 4 * (2 * u + (j >> 1)) + 2 * (j & 1);
        const float b = (j & 1) ? bias_hi : bias_lo;
        r[j] = PackPair<T>(Activate(ACT, acc[c][i] + b), Activate(ACT, acc[c][i + 1] + b));
      }
      StMatrixX4Trans(base + t16 * row_bytes, r[0], r[1], r[2], r[3]);
    }
  }
#endif
}

// StageXtTileStMatrix with the activation chosen once, outside the unrolled loops (none with act_mode 1, whose stores
// apply it): with the stmatrix asm inside them the compiler no longer made one copy of the loops per activation, the
// code stayed a branch an element, and the kernels ran up to 38 % slower (session 48).
template <typename T, int NW, int NCH>
__device__ __forceinline__ void StageXtAccumulatorsStMatrix(float (&acc)[NCH][NW / 2], unsigned char* tile,
                                                            int row_bytes, const SpmmXtParams& p, int row0, int r_base,
                                                            int t_base, int wq, int lane) {
  auto stage = [&](auto act) {
    StageXtTileStMatrix<T, NW, NCH, decltype(act)::value>(acc, tile, row_bytes, p, row0, r_base, t_base, wq, lane);
  };
  switch (p.y2 == nullptr ? p.activation : 0) {
    case 1: return stage(std::integral_constant<int, 1>{});
    case 2: return stage(std::integral_constant<int, 2>{});
    case 3: return stage(std::integral_constant<int, 3>{});
    default: return stage(std::integral_constant<int, 0>{});
  }
}

// Epilogue of one warpgroup (warp wq of it): + bias, the activation (unless act_mode 1), convert, into the staged [BT][BR] tile; with
// CHUNK > 0 only the tokens of chunk `ch` (warpgroup-local tokens [CHUNK ch, CHUNK ch + CHUNK), staged from row
// t_base).
template <typename T, int NW, int NCH, int CHUNK = 0>
__device__ __forceinline__ void StageXtAccumulators(float (&acc)[NCH][NW / 2], unsigned char* tile, int row_bytes,
                                                    const SpmmXtParams& p, int row0, int r_base, int t_base, int wq,
                                                    int lane, int ch = 0) {
  const int r_lo = r_base + 16 * wq + (lane >> 2);  // tile-local features r_lo, r_lo + 8
  const float bias_lo = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo);
  const float bias_hi = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo + 8);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) {
      const int t8 = c * NW + 8 * (i >> 2);  // the 8-token column of this accumulator
      if (CHUNK > 0 && t8 / CHUNK != ch) continue;
      const int hi = (i >> 1) & 1;
      const int t = t_base + t8 - (CHUNK > 0 ? CHUNK * ch : 0) + 2 * (lane & 3) + (i & 1);
      float v = acc[c][i] + (hi ? bias_hi : bias_lo);
      if (p.y2 == nullptr) v = Activate(p.activation, v);  // act_mode 1: the stores apply it
      reinterpret_cast<T*>(tile + t * row_bytes)[r_lo + 8 * hi] = FromFloat<T>(v);
    }
  }
}

// act_mode 2's staging of one warpgroup's accumulators (warp wq of it): act(z) transposed into `tile_t`, [BR features]
// [BT tokens] (feature rows `row_bytes_t` apart), for StoreStagedTileT, and act'(z) into `tile`, [BT tokens][BR
// features], for a plain copy to y2: each element's activation and derivative computed once (ActivateWithGrad), as
// act_mode 1's store pass does, or with TABLE (bf16) read from the activation table (ActGradBf16).  A thread holds two
// adjacent tokens of a feature per accumulator pair (i, i + 1): one 32-bit word of `tile_t`; with its rows 16 bytes
// longer than the tokens (4 banks), a warp's 8 features x 4 token pairs land on 32 different banks.  z is rounded to T
// first, as act_mode 1's staged tile rounds it.
template <typename T, int NW, int NCH, bool TABLE>
__device__ __forceinline__ void StageXtActTransposed(float (&acc)[NCH][NW / 2], unsigned char* tile, int row_bytes,
                                                     unsigned char* tile_t, int row_bytes_t, const SpmmXtParams& p,
                                                     int row0, int r_base, int t_base, int wq, int lane,
                                                     const uint32_t* table) {
  const int r_lo = r_base + 16 * wq + (lane >> 2);
  const float bias_lo = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo);
  const float bias_hi = BiasAt<T>(p.bias, p.bias_f32, row0 + r_lo + 8);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
#pragma unroll
    for (int i = 0; i < NW / 2; i += 2) {
      const int hi = (i >> 1) & 1, r = r_lo + 8 * hi;
      const int t = t_base + c * NW + 8 * (i >> 2) + 2 * (lane & 3);  // tile-local, even
      const float b = hi ? bias_hi : bias_lo;
      if constexpr (TABLE) {  // bf16 (StageXtActTransposedAny)
        const uint32_t w0 = ActGradBf16(table, __bfloat16_as_ushort(FromFloat<T>(acc[c][i] + b)), p.activation);
        const uint32_t w1 = ActGradBf16(table, __bfloat16_as_ushort(FromFloat<T>(acc[c][i + 1] + b)), p.activation);
        *reinterpret_cast<uint32_t*>(tile_t + r * row_bytes_t + 2 * t) = __byte_perm(w0, w1, 0x5410);
        reinterpret_cast<uint16_t*>(tile + t * row_bytes)[r] = static_cast<uint16_t>(w0 >> 16);
        reinterpret_cast<uint16_t*>(tile + (t + 1) * row_bytes)[r] = static_cast<uint16_t>(w1 >> 16);
      } else {
        float f0, d0, f1, d1;
        ActivateWithGrad(p.activation, ToFloat(FromFloat<T>(acc[c][i] + b)), f0, d0);
        ActivateWithGrad(p.activation, ToFloat(FromFloat<T>(acc[c][i + 1] + b)), f1, d1);
        *reinterpret_cast<uint32_t*>(tile_t + r * row_bytes_t + 2 * t) = PackPair<T>(f0, f1);
        reinterpret_cast<T*>(tile + t * row_bytes)[r] = FromFloat<T>(d0);
        reinterpret_cast<T*>(tile + (t + 1) * row_bytes)[r] = FromFloat<T>(d1);
      }
    }
  }
}

// StageXtActTransposed with the table where there is one (bf16), the float32 formula otherwise: the choice made once,
// outside the unrolled loop (a branch inside it kept the compiler from overlapping one pair's math with the next).
template <typename T, int NW, int NCH>
__device__ __forceinline__ void StageXtActTransposedAny(float (&acc)[NCH][NW / 2], unsigned char* tile, int row_bytes,
                                                        unsigned char* tile_t, int row_bytes_t, const SpmmXtParams& p,
                                                        int row0, int r_base, int t_base, int wq, int lane,
                                                        const uint32_t* table) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if (table != nullptr) {
      StageXtActTransposed<T, NW, NCH, true>(acc, tile, row_bytes, tile_t, row_bytes_t, p, row0, r_base, t_base, wq,
                                             lane, table);
      return;
    }
  }
  StageXtActTransposed<T, NW, NCH, false>(acc, tile, row_bytes, tile_t, row_bytes_t, p, row0, r_base, t_base, wq, lane,
                                          nullptr);
}

// Writes a tile staged as [BR features][BT tokens] to y^T [rows, tokens] at (row0, tok0) with 16-byte stores along the
// tokens (a feature's BT tokens are 2 BT contiguous bytes); tokens past `tokens` are skipped (T % 8 == 0).
template <typename T, int BT, int BR, int THREADS>
__device__ __forceinline__ void StoreStagedTileT(const unsigned char* tile, int row_bytes, T* __restrict__ yt,
                                                 int tokens, int tok0, int row0, int thread) {
  constexpr int kChunks = BT / 8;  // 16-byte chunks per feature row
#pragma unroll 4
  for (int i = thread; i < BR * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    if (tok0 + 8 * c < tokens)
      *reinterpret_cast<uint4*>(yt + static_cast<int64_t>(row0 + r) * tokens + tok0 + 8 * c) =
          *reinterpret_cast<const uint4*>(tile + r * row_bytes + 16 * c);
  }
}

template <typename T, int BR, int BT, int STAGES, int MIN_BLOCKS>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS) SpmmWgmmaXtKernel(const SpmmXtParams p, const YParts yp) {
#ifdef JAXSPARSE_WGMMA
  using L = XtLayout<BR, BT, STAGES>;
  using W = XtWarps<BR, BT>;
  constexpr int WR = W::WR, WN = W::WN, NW = W::NW, NCH = W::NCH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int wr = WR == 2 ? wg : 0;  // feature half of this warpgroup
  const int wt = WR == 2 ? 0 : wg;  // token half
  const int row0 = blockIdx.x * BR;
  const int tok0 = blockIdx.y * BT;
  const int kc_total = 4 * p.groups;
  const int num_kt = (kc_total + kKc - 1) / kKc;

  // The V block's kept columns, one byte per condensed k (BR <= V: one block per CTA).
  uint8_t* scol = p.cols != nullptr ? smem + L::kColsOff : nullptr;
  if (p.cols != nullptr) {
    const uint8_t* src = p.cols + static_cast<int64_t>(row0 / p.v) * kc_total;
    for (int i = tid; i < kc_total; i += kThreads) scol[i] = src[i];
  }
  __syncthreads();

  float acc[NCH][NW / 2];
#pragma unroll
  for (int c = 0; c < NCH; ++c)
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) acc[c][i] = 0.f;
  XtMeta meta(wr, warp & 3, lane, p.groups / 8);
  // The activation table after the column bytes, its copies in the first stage's group.
  const int table_off = L::TableOff(p);
  const uint32_t* table = StartActTable<T>(p, smem_base + table_off, smem + table_off, tid, kThreads);
  // Stage s (operands and metadata words) into ring slot s % STAGES.
  auto load = [&](int s) {
    LoadXtStage<T, BR, BT, kThreads>(smem_base + (s % STAGES) * L::kStageBytes, s * kKc, tid, p, row0, tok0, scol);
    LoadStageMetaWords<BR, kThreads>(smem_base + L::kMetaOff + (s % STAGES) * L::kMetaBytes, p, row0, s, tid);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < num_kt) load(s);
    CpAsyncCommit();
  }
  // Stage kt (parity `odd`).
  auto run_stage = [&](int kt, auto odd) {
    CpAsyncWait<STAGES - 3>();  // this thread's copies of stage kt landed
    FenceProxyAsyncShared();
    __syncthreads();  // stage kt visible to all; every warpgroup's wgmmas up to stage kt-2 completed
    const uint32_t* words = reinterpret_cast<const uint32_t*>(smem + L::kMetaOff + (kt % STAGES) * L::kMetaBytes);
    meta.Load<decltype(odd)::value>(words, kt);
    {
      const int next = kt + STAGES - 2;  // into the buffer of stage kt-2
      if (next < num_kt) load(next);
      CpAsyncCommit();
    }
#pragma unroll
    for (int c = 0; c < NCH; ++c) WgmmaFenceOperands(acc[c]);
    WgmmaFence();
    XtStageMma<T, BR, NW, NCH>(acc, smem_base + (kt % STAGES) * L::kStageBytes, wr, wt * WN / 64,
                               meta.Operands<decltype(odd)::value>());
    WgmmaCommit();
    WgmmaWait<1>();  // stage kt-1's products completed
#pragma unroll
    for (int c = 0; c < NCH; ++c) WgmmaFenceOperands(acc[c]);
  };
  for (int kt = 0; kt < num_kt; kt += 2) {
    run_stage(kt, std::false_type{});
    if (kt + 1 < num_kt) run_stage(kt + 1, std::true_type{});
  }
  WgmmaWait<0>();
#pragma unroll
  for (int c = 0; c < NCH; ++c) WgmmaFenceOperands(acc[c]);

  // ---------------------------------------------------------------- epilogue
  CpAsyncWait<0>();
  __syncthreads();  // no wgmma or copy touches the pipeline buffers any more: reuse them as the Y tile
  if (p.y_t) {  // act_mode 2: act'(z) [T, R] copied to y2, act(z)^T [R, T] to y
    StageXtActTransposedAny<T, NW, NCH>(acc, smem, L::kYRowBytes, smem + L::kEpiTOff, L::kYtRowBytes, p, row0,
                                        64 * wr, wt * WN, wq, lane, table);
    __syncthreads();
    StoreStagedTile<T, BT, BR, kThreads>(smem, L::kYRowBytes, static_cast<T*>(p.y2), p.tokens, p.rows, tok0, row0,
                                         threadIdx.x);
    StoreStagedTileT<T, BT, BR, kThreads>(smem + L::kEpiTOff, L::kYtRowBytes, static_cast<T*>(p.y), p.tokens, tok0,
                                          row0, threadIdx.x);
    return;
  }
  StageXtAccumulatorsStMatrix<T, NW, NCH>(acc, smem, L::kYRowBytes, p, row0, 64 * wr, wt * WN, wq, lane);
  __syncthreads();
  const TileOut out = TileOutput(p, yp, row0);
  StoreStagedTile<T, BT, BR, kThreads>(smem, L::kYRowBytes, static_cast<T*>(out.y), p.tokens, out.rows, tok0, out.row0,
                                       threadIdx.x, Extra(p, table));
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// ---------------------------------------------------------------- warp-specialized, persistent version
//
// 384 threads: warpgroup 0 is the producer, warpgroups 1 and 2 consume (wait full, issue the stage's wgmmas,
// wait for the previous stage's products, release that stage to the producer; metadata staged with each stage and
// double-buffered in registers, kSparseMetaRule).  The producer fills a STAGES-deep ring: thread 0 loads A's
// values by TMA (one box per stage, 64-byte swizzled, arrival with expect_tx); Xc comes by TMA too at M = 4 (dense
// rows of x^T: BT/64 boxes of 64 tokens x 64 k; or x's own rows, XROW: one box of BT tokens x 64 k), and
// otherwise by cp.async from all 128 producer threads, each marking its part with cp.async.mbarrier.arrive; the
// metadata words come by TMA pairs where they fit (MetaPairsFit), else by cp.async from all 128.  With everything
// by TMA, thread 0 fills the ring alone and the other producer threads leave at once.  The
// grid is persistent (one CTA per SM, tiles strided over the grid, features fastest so CTAs running together share
// x rows); the Y tile is staged in its own shared-memory region, so the producer loads the next tile's first
// stages while the consumers run this tile's epilogue.  Barrier phases run on across tiles.
//
// From x rows the consumers run m64n256 products (NWMAX = 256: 0.200 / 0.170 ms against 0.207 / 0.176 with two
// m64n128 at 2:4, 1024x4096 / 4096x1024; session 9, device call 4).  What sets the time (session 10,
// benchmarks/ws_probe.cu, 2:4, 16384 tokens, 1024x4096, kernel alone; docs/kernel-notes.md): the full kernel
// 0.187 ms, without its epilogue 0.117, its loads alone 0.120, its epilogue alone 0.053 (128 MB of Y at HBM write
// speed): the main loop runs at the rate of its loads and the epilogue adds on top.  One group in flight (wait
// for the previous stage's products, not this one's) measured 0.175 against 0.187 and is what runs now.  Three
// ways of overlapping the epilogue with the next tile were built and measured slower, so this one stays: a TMA
// store of per-warpgroup Y buffers (0.194-0.200 ms), and storer warps in the producer warpgroup copying Y while
// the consumers go on (0.236: one loading warp left could not keep the ring full).
// With p.mul (the backward's dz = dh * act'(z), session 45): after a tile's last k stage the producer loads the
// tile's mul, one epilogue chunk per ring slot, by TMA on the ring's own barriers; the consumers read it from shared
// memory as they store the chunk and then release the slot. The loads are in flight during the tile's last stages and
// its staging, where session 35's loads from global memory in the store loop paid their latency on every store.
// kWsThreads and WsRegs (the roles' registers): wgmma.cuh.

// The Y tile is staged kEpiChunks chunks of 128 tokens at a time where the two warpgroups share every token (BR >=
// 128), which leaves shared memory for a deeper ring.
template <int BR, int BT, int STAGES>
struct XtWsLayout {
  static constexpr int kABytes = (BR / 64) * kAColBytes;
  static constexpr int kBBytes = (BT / 64) * kColBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kYRowBytes = BR * 2 + 16;
  static constexpr int kEpiChunks = XtWarps<BR, BT>::WR == 2 ? BT / 128 : 1;
  static constexpr int kEpiTokens = BT / kEpiChunks;
  static constexpr int kEpiOff = STAGES * kStageBytes;
  static constexpr int kMetaBytes = BR * 8;  // a stage's metadata words: [BR rows][2]
  static constexpr int kMetaOff = kEpiOff + kEpiTokens * kYRowBytes;
  static constexpr int kBarOff = kMetaOff + STAGES * kMetaBytes;  // full[STAGES] then empty[STAGES], 8 bytes each
  static constexpr int kTableOff = (kBarOff + 2 * STAGES * 8 + 15) / 16 * 16;  // the activation table (act_table)
  static constexpr int kBytes = kTableOff + kActTableBytes;
  // p.mul: one epilogue chunk of it, [kEpiTokens tokens][BR features] unswizzled, fills a ring slot (below)
  static constexpr int kMulBytes = kEpiTokens * BR * 2;
  static_assert(kStageBytes % 1024 == 0 && kBarOff % 8 == 0, "alignment");
  static_assert(kMulBytes <= kStageBytes, "a chunk of mul fits a ring slot");
};

// Probe modes of the warp-specialized kernel, for benchmarks/ws_probe.cu only (the extension builds PROBE = 0):
// each bit removes one part of the work, so the probe can time the load pipeline, the products, the epilogue and
// the synchronization apart.  Results are wrong in every mode but 0.  kProbeNoLoad still loads the first STAGES
// stages, so the products run on real operands and metadata.
// kProbeMetaOnce loads the metadata words of the first STAGES stages only (the kernel's time without its metadata
// loads).
enum XtProbe { kProbeNoMma = 1, kProbeNoLoad = 2, kProbeNoEpilogue = 4, kProbeMetaOnce = 8 };

// Whether the warp-specialized kernel can take its metadata as TMA pairs (p.meta_pairs): at every even stage, thread
// 0 loads one TMA box of [BR rows][4 words], the words of that stage and the next, into the two stages' slots (rows
// of 16 bytes).  Needs G/8 % 4 == 0 (16-byte rows in global memory; then the stage count is even too) and an even
// ring, so that a pair never straddles the ring's end.  The box completes on the even stage's barrier, which the
// consumers pass before they read the odd stage's words.  Otherwise every producer thread copies its part of each
// stage's words by 4-byte cp.async (LoadStageMetaWords).  Session 18 (benchmarks/ws_probe.cu, 2:4, 16384 tokens,
// ws128x256, kernel alone, 1024x4096 / 4096x1024): 0.173-0.180 / 0.148-0.167 ms with the cp.async words; 0.168 /
// 0.145 with TMA pairs; 0.157 / 0.136 once thread 0 also fills the ring alone (tma_only; the 127 producer threads
// that had waited on the ring's barriers each stage took issue slots from the consumers).  Without any metadata
// loads but with those threads: 0.161-0.165 / 0.132-0.143.  One 8-byte cp.async per row was slower than two 4-byte
// ones (0.191 / 0.155).
template <int STAGES>
bool MetaPairsFit(const SpmmXtParams& p) {
  return STAGES % 2 == 0 && (p.groups / 8) % 4 == 0;
}

// x_parts: XtParts::count (tma_x1, tma_x2: its operands' maps); yp: the outputs (YParts).
template <typename T, int BR, int BT, int STAGES, bool XROW, int NWMAX = 128, int PROBE = 0>
__global__ void __launch_bounds__(kWsThreads, 1)
    SpmmWgmmaXtWsKernel(const SpmmXtParams p, const __grid_constant__ CUtensorMap tma_a,
                        const __grid_constant__ CUtensorMap tma_x, const __grid_constant__ CUtensorMap tma_m,
                        const __grid_constant__ CUtensorMap tma_mul, const __grid_constant__ CUtensorMap tma_x1,
                        const __grid_constant__ CUtensorMap tma_x2, const int x_parts, const YParts yp) {
#ifdef JAXSPARSE_WGMMA
  using L = XtWsLayout<BR, BT, STAGES>;
  using W = XtWarps<BR, BT, NWMAX>;  // over the two consumer warpgroups
  constexpr int WR = W::WR, WN = W::WN, NW = W::NW, NCH = W::NCH;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  unsigned char* smem = aligned.ptr;
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + L::kBarOff, empty0 = full0 + STAGES * 8;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const bool x_by_tma = XROW || p.cols == nullptr;  // M = 4: Xc is x^T (or x) itself
  const bool tma_only = x_by_tma && p.meta_pairs;    // thread 0 fills the ring alone (MetaPairsFit)
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // Thread 0's expect_tx arrival, plus (unless it loads alone) every producer thread's cp.async arrival (metadata
      // words, and Xc when it is gathered).
      MbarInit(full0 + 8 * s, tma_only ? 1 : 129);
      MbarInit(empty0 + 8 * s, 8);  // every consumer warp done with the stage
    }
  }
  __syncthreads();

  const int kc_total = 4 * p.groups;
  const int num_kt = (kc_total + kKc - 1) / kKc;
  const int nfb = p.rows / BR;
  const int ntiles = nfb * ((p.tokens + BT - 1) / BT);

  if (wg == 0) {  // ------------------------------------------------ producer
    SetMaxRegisters<WsRegs<XROW>::kProducer, false>();
    if (tma_only && tid != 0) return;  // nothing to copy: no thread of theirs spins on the ring's barriers
    int it = 0;
    const int block_rows = p.rows / p.x_blocks;  // rows per diagonal block (a multiple of BR: SpmmXtImpl checks)
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
      const int row0 = (tile % nfb) * BR, tok0 = (tile / nfb) * BT;
      const int xk0 = XROW ? (row0 / block_rows) * kc_total : 0;  // the tile's diagonal block's first column of x
      const int32_t* xch = XROW && p.x_chunks != nullptr ? p.x_chunks + (row0 / block_rows) * num_kt : nullptr;
      int xnext = tid == 0 && xch != nullptr ? __ldg(xch) : 0;  // x_chunks: the next stage's chunk, read a stage ahead
      const uint8_t* tcols = p.cols != nullptr ? p.cols + static_cast<int64_t>(row0 / p.v) * kc_total : nullptr;
      for (int kt = 0; kt < num_kt; ++kt, ++it) {
        const int s = it % STAGES;
        const uint32_t stage = smem_base + s * L::kStageBytes, full = full0 + 8 * s;
        if (it >= STAGES) MbarWait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1);
        if ((PROBE & kProbeNoLoad) && it >= STAGES) {  // the ring keeps the first STAGES stages' data
          if (tid == 0) MbarArrive(full);
          if (!tma_only) CpAsyncMbarArrive(full);
          continue;
        }
        const bool meta_now = !(PROBE & kProbeMetaOnce) || it < STAGES;
        const bool meta_box = p.meta_pairs && meta_now && (kt & 1) == 0;
        if (tid == 0) {
          MbarArriveExpectTx(full, L::kABytes + (x_by_tma ? L::kBBytes : 0) + (meta_box ? 2 * L::kMetaBytes : 0));
          TmaLoad2d(stage, &tma_a, kt * (kKc / 2), row0, full);
          if (meta_box)  // words 2 kt .. 2 kt + 3 of the tile's rows: 4 kt in 16-bit columns
            TmaLoad2d(smem_base + L::kMetaOff + s * L::kMetaBytes, &tma_m, 4 * kt, row0, full);
          if (XROW) {  // x [T, K]: BT rows of the stage's 64 k
            const int xcol = xch != nullptr ? xnext * kKc : xk0 + kt * kKc;
            if (xch != nullptr && kt + 1 < num_kt) xnext = __ldg(xch + kt + 1);
            // x_parts: operand kt / (num_kt / P), at its own column; each TMA names its map's parameter.
            const int per = num_kt / x_parts, part = kt / per;
            if (part == 0) {
              TmaLoad2d(stage + L::kABytes, &tma_x, xcol, tok0, full);
            } else if (part == 1) {
              TmaLoad2d(stage + L::kABytes, &tma_x1, (kt - per) * kKc, tok0, full);
            } else {
              TmaLoad2d(stage + L::kABytes, &tma_x2, (kt - 2 * per) * kKc, tok0, full);
            }
          } else if (x_by_tma) {
#pragma unroll
            for (int c = 0; c < BT / 64; ++c) TmaLoad2d(stage + L::kABytes + c * kColBytes, &tma_x, tok0 + 64 * c, kt * kKc, full);
          }
        }
        if (tma_only) continue;
        if (!p.meta_pairs && meta_now)
          LoadStageMetaWords<BR, 128>(smem_base + L::kMetaOff + s * L::kMetaBytes, p, row0, kt, tid);
        if (!x_by_tma) LoadXtStage<T, BR, BT, 128, false>(stage, kt * kKc, tid, p, row0, tok0, tcols);
        CpAsyncMbarArrive(full);
      }
      if (p.mul != nullptr) {  // the tile's mul, one epilogue chunk a ring slot
        for (int ch = 0; ch < L::kEpiChunks; ++ch, ++it) {
          const int s = it % STAGES;
          const uint32_t full = full0 + 8 * s;
          if (it >= STAGES) MbarWait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1);
          if (tid == 0) {
            MbarArriveExpectTx(full, L::kMulBytes);
            TmaLoad2d(smem_base + s * L::kStageBytes, &tma_mul, row0, tok0 + ch * L::kEpiTokens, full);
          }
          if (!tma_only) CpAsyncMbarArrive(full);
        }
      }
    }
    CpAsyncWait<0>();
  } else {  // ------------------------------------------------------ consumers
    SetMaxRegisters<WsRegs<XROW>::kConsumer, true>();
    const int cw = wg - 1, wq = warp & 3, ctid = tid - 128;
    const int wr = WR == 2 ? cw : 0;  // feature half of this warpgroup
    const int wt = WR == 2 ? 0 : cw;  // token half
    unsigned char* ytile = smem + L::kEpiOff;
    // The consumers copy the activation table once; each waits for its copies before its first epilogue, whose
    // named barrier then shows all of them to every consumer.
    const uint32_t* table = StartActTable<T>(p, smem_base + L::kTableOff, smem + L::kTableOff, ctid, 256);
    CpAsyncCommit();
    int it = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
      const int row0 = (tile % nfb) * BR, tok0 = (tile / nfb) * BT;
      float acc[NCH][NW / 2];
#pragma unroll
      for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) acc[c][i] = 0.f;
      XtMeta meta(wr, wq, lane, p.groups / 8);
      auto fence_acc = [&] {
#pragma unroll
        for (int c = 0; c < NCH; ++c) WgmmaFenceOperands(acc[c]);
      };
      // Stage kt (parity `odd`, ring slot it % STAGES); once stage kt-1's products completed, its ring slot goes
      // back to the producer.
      auto run_stage = [&](int kt, int it, auto odd) {
        constexpr bool kOdd = decltype(odd)::value;
        const int s = it % STAGES;
        MbarWait(full0 + 8 * s, (it / STAGES) & 1);
        FenceProxyAsyncShared();  // the producers' cp.async writes, seen through the barrier, before wgmma reads
        if (PROBE & kProbeNoMma) {
          if (lane == 0) MbarArrive(empty0 + 8 * s);
          return;
        }
        // TMA pairs: rows of 4 words from the even stage's slot, this stage's two at 2 * kOdd.
        const unsigned char* slot = smem + L::kMetaOff + (p.meta_pairs ? s & ~1 : s) * L::kMetaBytes;
        meta.Load<kOdd>(reinterpret_cast<const uint32_t*>(slot) + (p.meta_pairs ? 2 * kOdd : 0), kt,
                        p.meta_pairs ? 4 : 2);
        fence_acc();
        WgmmaFence();
        XtStageMma<T, BR, NW, NCH, XROW>(acc, smem_base + s * L::kStageBytes, wr, wt * WN / 64, meta.Operands<kOdd>());
        WgmmaCommit();
        WgmmaWait<1>();  // stage kt-1's products completed
        fence_acc();
        if (lane == 0 && kt > 0) MbarArrive(empty0 + 8 * ((it - 1) % STAGES));
      };
      for (int kt = 0; kt < num_kt; kt += 2) {
        run_stage(kt, it + kt, std::false_type{});
        if (kt + 1 < num_kt) run_stage(kt + 1, it + kt + 1, std::true_type{});
      }
      it += num_kt;
      WgmmaWait<0>();
      fence_acc();
      if (!(PROBE & kProbeNoMma) && lane == 0) MbarArrive(empty0 + 8 * ((it - 1) % STAGES));  // the tile's last stage
      if (PROBE & kProbeNoEpilogue) {
        // Read one accumulator of each chain (a compare that never stores): with none read, ptxas drops products
        // whose results are dead (session 17: 2 sparse wgmma in this mode's SASS where the kernel has 4).
        bool hit = false;
#pragma unroll
        for (int c = 0; c < NCH; ++c) hit |= acc[c][0] == -1.2345e30f;
        if (hit) static_cast<float*>(p.y)[tid] = acc[0][1];
        continue;
      }
      CpAsyncWait<0>();  // the activation table landed (this thread's copies; a no-op after the first tile)
      const TileOut out = TileOutput(p, yp, row0);
#pragma unroll
      for (int ch = 0; ch < L::kEpiChunks; ++ch) {
        NamedBarSync(1, 256);  // the previous chunk's (or tile's) stores have read the staged Y
        StageXtAccumulators<T, NW, NCH, (L::kEpiChunks > 1 ? L::kEpiTokens : 0)>(acc, ytile, L::kYRowBytes, p, row0,
                                                                                 64 * wr, wt * WN, wq, lane, ch);
        NamedBarSync(1, 256);
        const bool mul = p.mul != nullptr;  // the chunk's mul, in ring slot (it + ch) % STAGES
        const int s = (it + ch) % STAGES;
        if (mul) MbarWait(full0 + 8 * s, ((it + ch) / STAGES) & 1);
        StoreStagedTile<T, L::kEpiTokens, BR, 256>(
            ytile, L::kYRowBytes, static_cast<T*>(out.y), p.tokens, out.rows, tok0 + ch * L::kEpiTokens, out.row0, ctid,
            Extra(p, table, mul ? smem + s * L::kStageBytes : nullptr, BR * 2));
        if (mul) {
          __syncwarp();
          if (lane == 0) MbarArrive(empty0 + 8 * s);  // this warp's reads of the slot are done
        }
      }
      if (p.mul != nullptr) it += L::kEpiChunks;
    }
  }
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// ---------------------------------------------------------------- host side

// Tile configurations <BR features, BT tokens, stages, CTAs per SM>; the attribute `tile` picks one
// (0 = auto).  BR = 64 is the only choice for V = 64 (one column set per CTA).
// 5 and 6 are the warp-specialized persistent kernel (SpmmWgmmaXtWsKernel) at 128x256 and 64x256 (the only
// tiles that read x [T, K], x_rows 1; at 128x256 on m64n256 products there).  The 128x128 tile runs a 4-stage ring
// (loads two stages ahead; two CTAs an SM still fit): 1-13 % faster than 3 stages in all 18 pairs of BERT-large
// shape and epilogue mode (session 29, benchmarks/xt_tiles.py); a fifth stage for 128x256 gained nothing consistent.
enum XtTile {
  kTileAuto = 0,
  kTile128x256 = 1,
  kTile64x256 = 2,
  kTile128x128 = 3,
  kTile64x128 = 4,
  kTileWs128x256 = 5,
  kTileWs64x256 = 6,
};

template <typename T, int BR, int BT, int STAGES, int MIN_BLOCKS>
ffi::Error LaunchTile(cudaStream_t stream, const SpmmXtParams& p, const YParts& yp) {
  constexpr auto kernel = SpmmWgmmaXtKernel<T, BR, BT, STAGES, MIN_BLOCKS>;
  if (!Sm90aImageLoaded<kernel>())
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: needs an sm_90a build on a Hopper GPU");
  using L = XtLayout<BR, BT, STAGES>;
  const int smem = L::TableOff(p) + (p.act_table ? kActTableBytes : 0) + 1024;
  if (smem > 227 * 1024)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: K too large for the column table in shared memory (4G = " +
                                       std::to_string(4 * p.groups) + " bytes)");
  if (ffi::Error e = RaiseSmemLimit<kernel>(227 * 1024, "cudaFuncSetAttribute(SpmmWgmmaXtKernel)"); e.failure())
    return e;
  const dim3 grid(p.rows / BR, (p.tokens + BT - 1) / BT);
  kernel<<<grid, kThreads, smem, stream>>>(p, yp);
  return LastLaunchError("SpmmWgmmaXtKernel");
}

template <typename T, int BR, int BT, int STAGES, bool XROW, int NWMAX = 128, int PROBE = 0>
ffi::Error LaunchWs(cudaStream_t stream, const SpmmXtParams& params, const XtParts& parts = {},
                    const YParts& yp = {}) {
  constexpr auto kernel = SpmmWgmmaXtWsKernel<T, BR, BT, STAGES, XROW, NWMAX, PROBE>;
  SpmmXtParams p = params;
  p.meta_pairs = p.meta_pairs && MetaPairsFit<STAGES>(p);
  if (!Sm90aImageLoaded<kernel>())
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: needs an sm_90a build on a Hopper GPU");
  constexpr int smem = XtWsLayout<BR, BT, STAGES>::kBytes + 1024;
  static_assert(smem <= 227 * 1024, "shared memory");
  if (ffi::Error e = RaiseSmemLimit<kernel>(smem, "cudaFuncSetAttribute(SpmmWgmmaXtWsKernel)"); e.failure()) return e;
  CUtensorMap tma_a{}, tma_x{}, tma_m{}, tma_mul{}, tma_x1{}, tma_x2{};
  if (!MakeTensorMap2d(&tma_a, p.values, p.rows, 2 * static_cast<uint64_t>(p.groups), BR, kKc / 2) ||
      (p.meta_pairs && !MakeTensorMap2d(&tma_m, p.meta, p.rows, p.groups / 4, BR, 8)) ||  // words as 16-bit pairs
      (XROW && !MakeTensorMap2d(&tma_x, p.xt, p.tokens, static_cast<uint64_t>(p.k) * p.x_blocks, BT)) ||
      (parts.count > 1 && !MakeTensorMap2d(&tma_x1, parts.x[0], p.tokens, p.k, BT)) ||
      (parts.count > 2 && !MakeTensorMap2d(&tma_x2, parts.x[1], p.tokens, p.k, BT)) ||
      (!XROW && p.cols == nullptr && !MakeTensorMap2d(&tma_x, p.xt, p.k, p.tokens, 64)) ||
      (p.mul != nullptr &&  // [kEpiTokens tokens][BR features] boxes, unswizzled
       !MakeTensorMap2d(&tma_mul, p.mul, p.tokens, p.rows, XtWsLayout<BR, BT, STAGES>::kEpiTokens, BR, false)))
    return ffi::Error::Internal("jaxsparse_spmm_xt: cuTensorMapEncodeTiled failed for the warp-specialized tile");
  const int tiles = (p.tokens + BT - 1) / BT * (p.rows / BR);
  kernel<<<std::min(tiles, SmCount()), kWsThreads, smem, stream>>>(p, tma_a, tma_x, tma_m, tma_mul, tma_x1, tma_x2,
                                                                     parts.count, yp);
  return LastLaunchError("SpmmWgmmaXtWsKernel");
}

// Auto tile, from the H100 measurements in docs/kernel-notes.md (sessions 5, 6 and 9).  x [T, K] and 2:4 (no
// gathered rows): the warp-specialized TMA kernel.  V:2:M: 128 features where V allows, else 64; 128 tokens (two
// CTAs per SM, so one CTA's prologue and epilogue overlap the other's main loop) unless the condensed reduction is
// long (more than 8 stages of 64), where the 256-token tile's reuse of A pays (4096x1024 at 128:2:16: 0.119 ms
// against 0.129; 1024x4096: 0.167 against 0.162).
int AutoTile(const SpmmXtParams& p, bool can128, bool x_rows) {
  if (x_rows) return can128 ? kTileWs128x256 : kTileWs64x256;
  if (p.cols == nullptr) return can128 ? kTileWs128x256 : kTileWs64x256;
  if (!can128) return kTile64x128;  // 64:2:8 at 1024x4096: 0.328 ms against 0.375 with 64x256
  return 4 * p.groups > 8 * kKc ? kTile128x256 : kTile128x128;
}

template <typename T>
ffi::Error Dispatch(cudaStream_t stream, SpmmXtParams p, int tile, bool x_rows, const XtParts& parts,
                    const YParts& yp) {
  const bool can128 = p.rows % 128 == 0 && (p.cols == nullptr || p.v % 128 == 0);
  if (p.y_t) {  // act_mode 2: only the plain kernel's epilogue stores y^T
    if (x_rows || tile == kTileWs128x256 || tile == kTileWs64x256)
      return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: act_mode 2 (y^T) reads x^T on tile auto, 128x256, "
                                         "64x256, 128x128 or 64x128 (not the warp-specialized tiles, not x_rows)");
    if (tile == kTileAuto && p.cols == nullptr) tile = can128 ? kTile128x128 : kTile64x128;
  }
  if (tile == kTileAuto) tile = AutoTile(p, can128, x_rows);
  if ((tile == kTile128x256 || tile == kTile128x128 || tile == kTileWs128x256) && !can128)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: 128-feature tiles need R % 128 == 0 and V >= 128");
  if (x_rows) {  // x [T, K] as it is (M = 4): only the TMA kernel reads it
    if (tile == kTileWs128x256) return LaunchWs<T, 128, 256, 4, true, 256>(stream, p, parts, yp);
    if (tile == kTileWs64x256) return LaunchWs<T, 64, 256, 5, true>(stream, p, parts, yp);
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x [T, K] (x_rows 1) takes tile auto, ws128x256 or ws64x256");
  }
  switch (tile) {
    case kTile128x256:
      return LaunchTile<T, 128, 256, 4, 1>(stream, p, yp);
    case kTile64x256:
      return LaunchTile<T, 64, 256, 4, 1>(stream, p, yp);
    case kTile128x128:
      return LaunchTile<T, 128, 128, 4, 2>(stream, p, yp);
    case kTile64x128:
      return LaunchTile<T, 64, 128, 4, 2>(stream, p, yp);
    case kTileWs128x256:
      return LaunchWs<T, 128, 256, 4, false>(stream, p, {}, yp);
    case kTileWs64x256:
      return LaunchWs<T, 64, 256, 5, false>(stream, p, {}, yp);
    default:
      return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x^T takes tile 0 (auto) to 6, got " + std::to_string(tile));
  }
}

// act_mode's operands: mode 1 (y = act(z) [T, R]) and mode 2 (y = act(z)^T [R, T]) need an activation and a second
// output act'(z) [T, R] in y's dtype; mode 0 takes it empty.
ffi::Error CheckActMode(int32_t act_mode, int32_t activation, int64_t tokens, int64_t rows, const ffi::AnyBuffer& out,
                        const ffi::AnyBuffer& out2) {
  if (act_mode < 0 || act_mode > 2)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: act_mode must be 0, 1 (the activation and its derivative) "
                                       "or 2 (the same, the activation stored [R, T])");
  if (act_mode != 0 && activation == 0)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: act_mode 1 and 2 need an activation");
  const bool y_t = act_mode == 2;
  if (out.dimensions()[0] != (y_t ? rows : tokens) || out.dimensions()[1] != (y_t ? tokens : rows))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: the output must be " +
                                       std::string(y_t ? "[R, T] for act_mode 2" : "[T, R]") + ", got " +
                                       ShapeString(out));
  const bool derivative = out2.dimensions().size() == 2 && out2.dimensions()[0] == tokens &&
                          out2.dimensions()[1] == rows && out2.element_type() == out.element_type();
  if (act_mode != 0 ? !derivative : out2.element_count() != 0)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: the second output must be [T, R] in y's dtype for act_mode "
                                       "1 and 2, and empty otherwise, got " + ShapeString(out2));
  return ffi::Error::Success();
}

ffi::Error SpmmXtImpl(cudaStream_t stream, ffi::AnyBuffer xt, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                      ffi::Buffer<ffi::U32> metadata, ffi::AnyBuffer bias, ffi::Buffer<ffi::S32> x_chunks,
                      ffi::Buffer<ffi::S32> y_chunks, ffi::AnyBuffer mul, ffi::AnyBuffer x1, ffi::AnyBuffer x2,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out2,
                      ffi::Result<ffi::AnyBuffer> out3, int32_t v, int32_t m, int32_t activation, int32_t act_mode,
                      int32_t tile, int32_t x_rows, int32_t act_table, int32_t x_blocks, int32_t y_parts) {
  if (xt.dimensions().size() != 2 || values.dimensions().size() != 2 || out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x^T, values and the output must be 2-D");
  if (x_rows != 0 && x_rows != 1)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x_rows must be 0 (x^T [K, T]) or 1 (x [T, K])");
  if (x_rows && m != 4)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x [T, K] (x_rows 1) needs M = 4 (nothing to gather)");
  if (x_blocks < 1 || (x_blocks > 1 && !x_rows))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x_blocks must be >= 1, and above 1 needs x [T, K] (x_rows 1)");
  if (x_rows && Dim(xt, 1) % x_blocks)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x [T, x_blocks K] needs its width to be a multiple of "
                                       "x_blocks = " + std::to_string(x_blocks) + ", got " + ShapeString(xt));
  const int64_t k = Dim(xt, x_rows ? 1 : 0) / x_blocks, tokens = Dim(xt, x_rows ? 0 : 1), rows = Dim(values, 0);
  // x_parts: x1 and x2, when not empty, continue the reduction after x (XtParts).
  const int x_parts = 1 + (x1.element_count() != 0) + (x2.element_count() != 0);
  if (x_parts > 1) {
    const auto same = [&](const ffi::AnyBuffer& b) {
      return b.element_count() == 0 ||
             (b.dimensions().size() == 2 && Dim(b, 0) == Dim(xt, 0) && Dim(b, 1) == Dim(xt, 1) &&
              b.element_type() == xt.element_type());
    };
    if (!x_rows || x_blocks != 1 || x_chunks.element_count() != 0 || k % kKc || x1.element_count() == 0 ||
        !same(x1) || !same(x2) || (tile != kTileAuto && tile != kTileWs128x256 && tile != kTileWs64x256))
      return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x1 and x2 (the reduction's further operands) need x [T, K] "
                                         "(x_rows 1), x_blocks 1, no x_chunks, K % 64 == 0, a warp-specialized tile, "
                                         "x1 before x2, and each of x's shape and dtype, got x " + ShapeString(xt) +
                                         ", x1 " + ShapeString(x1) + ", x2 " + ShapeString(x2));
  }
  if (x_blocks > 1 && (rows % (128 * static_cast<int64_t>(x_blocks)) || k % kKc))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x_blocks = " + std::to_string(x_blocks) +
                                       " diagonal blocks need R % (128 x_blocks) == 0 and K % 64 == 0 (per block), "
                                       "got R = " + std::to_string(rows) + ", K = " + std::to_string(k));
  if (x_chunks.element_count() != 0 &&
      (!x_rows || k % kKc || static_cast<int64_t>(x_chunks.element_count()) != x_blocks * (k / kKc)))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x_chunks needs x [T, K] (x_rows 1), K % 64 == 0 per block "
                                       "and x_blocks * K/64 entries, got " + ShapeString(x_chunks) + " for K = " +
                                       std::to_string(k) + ", x_blocks = " + std::to_string(x_blocks));
  if (y_chunks.element_count() != 0 &&
      (!x_rows || act_mode != 0 || static_cast<int64_t>(y_chunks.element_count()) != rows / 64))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: y_chunks needs x [T, K] (x_rows 1), act_mode 0 and R/64 "
                                       "entries, got " + ShapeString(y_chunks) + " for R = " + std::to_string(rows));
  if (mul.element_count() != 0 &&
      (!x_rows || act_mode != 0 || activation != 0 || y_chunks.element_count() != 0 ||
       mul.dimensions().size() != 2 || Dim(mul, 0) != tokens || Dim(mul, 1) != rows ||
       mul.element_type() != xt.element_type() || (tile != kTileAuto && tile != kTileWs128x256 &&
                                                   tile != kTileWs64x256)))
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: mul needs x [T, K] (x_rows 1) on a warp-specialized tile, "
                                       "act_mode 0, no activation, no y_chunks, and mul [T, R] in x's dtype, got " +
                                       ShapeString(mul) + " for T = " + std::to_string(tokens) + ", R = " +
                                       std::to_string(rows));
  if (ffi::Error e = CheckSpec("jaxsparse_spmm_xt", v, m); e.failure()) return e;
  const int64_t groups = x_parts * k / m;
  if (k % m || Dim(values, 1) != 2 * groups || rows % 64)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: inconsistent shapes: x^T " + ShapeString(xt) + ", values " +
                                       ShapeString(values) + " (need values [R, 2K/M], R % 64 == 0)");
  if (y_parts < 1 || y_parts > 3)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: y_parts must be 1, 2 or 3, got " + std::to_string(y_parts));
  YParts yp;
  if (y_parts > 1) {  // the outputs y, y2[, y3], each [T, R / y_parts] in x's dtype (YParts)
    const int64_t part_rows = rows / y_parts;
    const auto part_ok = [&](const ffi::AnyBuffer& b) {
      return b.dimensions().size() == 2 && Dim(b, 0) == tokens && Dim(b, 1) == part_rows &&
             b.element_type() == xt.element_type();
    };
    if (act_mode != 0 || y_chunks.element_count() != 0 || mul.element_count() != 0 || x_parts > 1 || x_blocks != 1 ||
        rows % (128 * static_cast<int64_t>(y_parts)) || !part_ok(*out) || !part_ok(*out2) ||
        (y_parts == 3 ? !part_ok(*out3) : out3->element_count() != 0))
      return ffi::Error::InvalidArgument(
          "jaxsparse_spmm_xt: y_parts = " + std::to_string(y_parts) + " needs act_mode 0, no y_chunks, no mul, no x1 "
          "or x2, x_blocks 1, R % (128 y_parts) == 0, and the outputs y, y2" + (y_parts == 3 ? ", y3" : "") +
          " each [T, R / y_parts] in x's dtype (y3 empty otherwise), got R = " + std::to_string(rows) + ", y " +
          ShapeString(*out) + ", y2 " + ShapeString(*out2) + ", y3 " + ShapeString(*out3));
    yp.count = y_parts;
    yp.rows = static_cast<int>(part_rows);
    yp.y[0] = out->untyped_data();
    yp.y[1] = out2->untyped_data();
    yp.y[2] = y_parts == 3 ? out3->untyped_data() : nullptr;
  } else {
    if (out3->element_count() != 0)
      return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: the third output is for y_parts = 3 only; got " +
                                         ShapeString(*out3));
    if (ffi::Error e = CheckActMode(act_mode, activation, tokens, rows, *out, *out2); e.failure()) return e;
  }
  if (ffi::Error e = CheckSparseWeight("jaxsparse_spmm_xt", rows, groups, columns, metadata, v, m); e.failure())
    return e;
  if (!x_rows && tokens % 8) return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x^T needs T % 8 == 0");
  const auto dt = xt.element_type();
  if (values.element_type() != dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x^T, values and the output must share one dtype");
  if (ffi::Error e = CheckEpilogue("jaxsparse_spmm_xt", bias, rows, dt, activation); e.failure()) return e;
  const bool has_bias = bias.element_count() > 0;
  if (tokens == 0 || rows == 0) return ffi::Error::Success();
  if (tokens >= (int64_t(1) << 30) || k >= (int64_t(1) << 30) || rows >= (int64_t(1) << 30) ||
      (tokens + 63) / 64 > 65535)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: shape too large");

  SpmmXtParams p;
  p.xt = xt.untyped_data();
  p.values = values.untyped_data();
  p.meta = metadata.typed_data();
  p.cols = m > 4 ? columns.typed_data() : nullptr;
  p.bias = has_bias ? bias.untyped_data() : nullptr;
  p.y = out->untyped_data();
  p.tokens = static_cast<int>(tokens);
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);
  p.groups = static_cast<int>(groups);
  p.v = v;
  p.m = m;
  p.bias_f32 = has_bias && bias.element_type() == ffi::F32;
  p.activation = activation;
  p.y2 = act_mode != 0 ? out2->untyped_data() : nullptr;
  p.y_t = act_mode == 2;
  p.meta_pairs = 1;
  p.act_table = act_table != 0 && dt == ffi::BF16 && act_mode != 0 && (activation == 1 || activation == 2);
  p.x_blocks = x_blocks;
  p.x_chunks = x_chunks.element_count() != 0 ? x_chunks.typed_data() : nullptr;
  p.y_chunks = y_chunks.element_count() != 0 ? y_chunks.typed_data() : nullptr;
  p.mul = mul.element_count() != 0 ? mul.untyped_data() : nullptr;
  XtParts parts;
  parts.count = x_parts;
  parts.x[0] = x_parts > 1 ? x1.untyped_data() : nullptr;
  parts.x[1] = x_parts > 2 ? x2.untyped_data() : nullptr;
  if ((x_blocks > 1 || p.x_chunks != nullptr || p.y_chunks != nullptr) && tile != kTileAuto && tile != kTileWs128x256)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x_blocks > 1, x_chunks and y_chunks take tile auto or "
                                       "ws128x256");
  if (dt == ffi::BF16) return Dispatch<__nv_bfloat16>(stream, p, tile, x_rows == 1, parts, yp);
  if (dt == ffi::F16) return Dispatch<__half>(stream, p, tile, x_rows == 1, parts, yp);
  return ffi::Error::InvalidArgument("jaxsparse_spmm_xt: x^T must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSpmmXt, jaxsparse::SpmmXtImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // x^T [K, T], or x [T, K] (x_rows 1)
                                  .Arg<xla::ffi::AnyBuffer>()               // values [R, 2G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .Arg<xla::ffi::AnyBuffer>()               // bias [R] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // x_chunks [x_blocks, K/64] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // y_chunks [R/64] or [0]
                                  .Arg<xla::ffi::AnyBuffer>()               // mul [T, R] or [0]
                                  .Arg<xla::ffi::AnyBuffer>()               // x1 [T, K] or [0] (x_parts)
                                  .Arg<xla::ffi::AnyBuffer>()               // x2 [T, K] or [0] (x_parts)
                                  .Ret<xla::ffi::AnyBuffer>()               // y [T, R] ([R, T] for act_mode 2)
                                  .Ret<xla::ffi::AnyBuffer>()               // act'(z) [T, R] (act_mode 1, 2), y's
                                                                            // part 1 (y_parts > 1) or [0]
                                  .Ret<xla::ffi::AnyBuffer>()               // y's part 2 (y_parts 3) or [0]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m")
                                  .Attr<int32_t>("activation")
                                  .Attr<int32_t>("act_mode")
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("x_rows")  // 0 = x^T [K, T], 1 = x [T, K] (M = 4)
                                  .Attr<int32_t>("act_table")   // 1: act and act' from the bf16 table (act_table.cuh)
                                  .Attr<int32_t>("x_blocks")    // diagonal blocks of the weight (x_rows 1), 1 = none
                                  .Attr<int32_t>("y_parts"),    // outputs the stacked rows go to (YParts), 1 = y
                              JAXSPARSE_GRAPH_SAFE);

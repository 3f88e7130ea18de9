// Probe (session 15): what the row kernel's main loop costs when stripped down, with A from shared memory or from
// registers, on two tile shapes, and with the metadata in a stage-ordered layout; and whether a ping-pong of the
// consumer warpgroups hides the Y stores.  (docs/kernel-notes.md, session 15.)
//
// The warp-specialized row kernel (cuda/spmm_xt.cu, SpmmWgmmaXtWsKernel, ws128x256 on x [T, K]) spends 0.100 ms of
// its 0.174 in its main loop at 1024x4096 (16384 tokens, 2:4), and no way of overlapping its 0.056-ms epilogue has
// paid.  Its stages move 40 KB into shared memory and 72 KB out of it to the tensor cores per 2M products.
// StrippedKernel keeps only the main loop's skeleton: one producer thread issuing TMA (and a bulk copy of the
// metadata), the consumers' products, Y stored from registers.  Its variants:
//   * A from shared memory (SS) or from registers (RS: a constant A fragment, so only its timing means anything);
//   * tiles of 128 x 256 (the two warpgroups on the feature halves, m64n256) or 256 x 128 (each warpgroup two m64n128
//     feature blocks sharing one x tile: 20 % fewer operand bytes per product);
//   * the metadata a constant 2:4 pattern, or real random words laid out stage by stage, [R / 128][stages][128][2],
//     and built into operands as the extension does (META);
//   * ping-pong (PP): each consumer warpgroup owns whole 128 x 128 tiles (two m64n128 blocks), taking every other
//     tile of the CTA in turn with the other (named barriers 2 + w: "warpgroup w's turn"), so one warpgroup's Y
//     stores can overlap the other's main loop.
//   * staggered (session 17): cooperative tiles, warpgroup 1 started STAGES - 1 stages behind warpgroup 0, so that
//     each warpgroup's epilogue could run while the other still has products to issue;
//   * the epilogue's 8-token columns taken in batches of 4 or 8 (all packs, then all first shuffles, ...), and with
//     the GELU code compiled out (session 17).
// RS_PROBE_TRACE=1 also prints CTA 0's per-tile timeline of each warpgroup (products, epilogue, lag) in cycles.
// Every variant is also timed with no epilogue; with its stores sent to a corner of y that each CTA rewrites
// (L2-resident: the stores without Y's DRAM writes); with the producer holding a tile's loads until the stores of
// the tile before were performed; and "dry" (the epilogue's work without its stores).  Every SS variant computes
// real products and is checked byte for byte against the extension's ws128x256 kernel run on the same metadata
// (from a y poisoned with 0xff).
//   bash benchmarks/rs_probe.sh      # nvcc (sm_90a), runs it, writes benchmarks/results/<gpu>/rs_probe.json
//   RS_PROBE_ONLY=<text>             # runs only the variants whose name contains it
#include "../cuda/spmm_xt.cu"
#include "probe_problem.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace jaxsparse {
namespace {

using probe_problem::Launcher;
using probe_problem::MedianMs;

// Writes one warpgroup's 64 x NW accumulators (+ bias, optional GELU) to y [T, R] from registers.  The wgmma
// accumulator gives lane l (quad row q = l / 4 = 4a + b, column c = l % 4) features f0 + q and f0 + q + 8 (f0 = 16 x
// its warp) at tokens 2c and 2c + 1 of every 8-token column, while y holds features contiguously.  So the 4 lanes b =
// 0..3 of one (a, c) trade their values in two shuffles (lanes 8 apart: the 8-feature half; 4 apart: the token)
// until lane b holds features f0 + 8 (b / 2) + 4a + 0..3 at token 2c + b % 2, and one 8-byte store instruction of a
// warp writes 8 tokens x 32 contiguous bytes: whole 32-byte sectors, with no shared-memory round trip.  `r_base` is
// the block's first tile-local feature, `tok_base` its first token; tokens past p.tokens are skipped.  (Measured in
// session 15 at the same time as the extension's staged epilogue; the extension does not use it.)
// DRY: everything but the stores (a store only where the packed values hit a pattern that never occurs, so the
// compiler keeps the work that makes them).
// BATCH: how many of the 8-token columns go through each step together (all their packs, then all their first
// shuffles, ...), so that the shuffles' latencies overlap instead of chaining column after column (session 17: the
// epilogue without stores took ~3900 cycles a tile, about 3x its instruction count at one per cycle).
// GELU false: the activation's code is compiled out (only p.activation == 0 is then right).
template <typename T, int NW, bool DRY = false, int BATCH = 1, bool GELU = true>
__device__ __forceinline__ void StoreAccDirect(const float (&acc)[NW / 2], const SpmmXtParams& p, int row0, int r_base,
                                               int tok_base, int wq, int lane) {
  static_assert((NW / 8) % BATCH == 0, "whole batches of 8-token columns");
  const int q = lane >> 2, b = q & 3;
  const bool bh = b & 2, bt = b & 1;
  const float bias_lo = BiasAt<T>(p.bias, p.bias_f32, row0 + r_base + 16 * wq + q);
  const float bias_hi = BiasAt<T>(p.bias, p.bias_f32, row0 + r_base + 16 * wq + q + 8);
  const int tok = tok_base + 2 * (lane & 3) + (b & 1);
  const int64_t step = 8 * static_cast<int64_t>(p.rows);  // 8 tokens of y
  T* ptr = static_cast<T*>(p.y) + static_cast<int64_t>(tok) * p.rows + row0 + r_base + 16 * wq + 8 * (b >> 1) +
           4 * (lane >> 4);
  const uint32_t sel_mine = bt ? 0x7632 : 0x5410, sel_other = bt ? 0x5410 : 0x7632;
  const uint32_t sel_x = bh ? 0x7632 : 0x5410, sel_y = bh ? 0x5410 : 0x7632;
#pragma unroll
  for (int j0 = 0; j0 < NW / 8; j0 += BATCH) {
    uint32_t keep[BATCH], send[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int j = j0 + u;
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // e = 2 x (high 8 features) + token
        v[e] = acc[4 * j + e] + ((e & 2) ? bias_hi : bias_lo);
        if (GELU && p.activation == 1) v[e] = GeluTanh(v[e]);
      }
      const uint32_t lo = PackPair<T>(v[0], v[1]), hi = PackPair<T>(v[2], v[3]);  // (token 0, token 1)
      keep[u] = bh ? hi : lo;  // feature row b's word of this lane's half
      send[u] = bh ? lo : hi;  // and row b ^ 2's, for lane b ^ 2
    }
    uint32_t mine[BATCH], other[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const uint32_t got = __shfl_xor_sync(0xffffffffu, send[u], 8);
      // (row b, row b ^ 2) at this lane's token, and at the other one, for lane b ^ 1.
      mine[u] = __byte_perm(keep[u], got, sel_mine);
      other[u] = __byte_perm(keep[u], got, sel_other);
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int j = j0 + u;
      const uint32_t got2 = __shfl_xor_sync(0xffffffffu, other[u], 4);  // (row b ^ 1, row b ^ 3) at this lane's token
      const uint32_t x = bt ? got2 : mine[u], y = bt ? mine[u] : got2;
      const uint2 out = make_uint2(__byte_perm(x, y, sel_x),   // rows 0, 1
                                   __byte_perm(x, y, sel_y));  // rows 2, 3
      const bool store =
          DRY ? (out.x ^ out.y) == 0x7fffffffu - static_cast<uint32_t>(p.activation) : tok + 8 * j < p.tokens;
      if (store) *reinterpret_cast<uint2*>(ptr + j * step) = out;
    }
  }
}

__device__ __forceinline__ void NamedBarArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A 1-D bulk copy (size % 16 == 0, both addresses 16-byte aligned) into shared memory, completing `bytes` of the
// barrier's transaction count.  (A 2-D TMA box of the metadata rows [R, G/8], 32-bit words in 16-byte box rows,
// raised "illegal instruction" at the load on the H100: device calls 5-7.)
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// What StrippedKernel does with its finished tiles: nothing, store them to y, or store them into a corner of y that
// each CTA rewrites (BT tokens x BR features, about 8 MB over the grid: it stays in L2 and reaches DRAM at most once,
// so the stores cost the SMs and L2 what they cost, without Y's 128 MB of DRAM writes).
// kEpiStoreHeld: stores to y, but the producer loads nothing of a tile until the consumers' stores of the tile before
// were performed (a fence, then a barrier), so the stores never share the SM's path to L2 with the loads.
// kEpiDry: the epilogue's work without its stores.
// kEpiNone reads one accumulator per block (a compare that never stores): with no reader at all, ptxas dropped products
// whose results were dead (session 16: 2 wgmma instructions in the RS 256x128 loop where a stage needs 4, and times
// twice the tensor cores' peak), so session 15's no-epilogue times of the RS variants were not the main loop's.
// CTA 0's timeline, for RS_PROBE_TRACE: per consumer warpgroup and tile (up to kTraceTiles), clock64 at the tile's
// start, when its products are done and when its epilogue is done (written by the warpgroup's first thread).
constexpr int kTraceTiles = 64;
__device__ unsigned long long g_trace[2][kTraceTiles][3];
__device__ __forceinline__ void Trace(int cw, int i, int what, int tid) {
  if (blockIdx.x == 0 && (tid & 127) == 0 && i < kTraceTiles) g_trace[cw][i][what] = clock64();
}

enum StrippedEpilogue { kEpiNone = 0, kEpiStore = 1, kEpiSink = 2, kEpiStoreHeld = 3, kEpiDry = 4 };

template <int BR, int BT, bool RS, bool META>
struct StrippedLayout {
  static constexpr int kABytes = RS ? 0 : (BR / 64) * kAColBytes;  // A's stage: BR rows x 32 stored values
  static constexpr int kBBytes = BT * 128;                          // x's stage: BT tokens x 64 k
  static constexpr int kMBytes = META ? BR * 8 : 0;                 // the stage's metadata words [BR][2]
  static constexpr int kStageBytes = kABytes + kBBytes + kMBytes;
};

// How the two consumer warpgroups share the CTA's tiles: cooperatively (both on every tile, one 64-feature half each,
// in step), ping-pong (each warpgroup owns every other tile, m64n128 blocks), or staggered (cooperative, but warp
// group 1 starts its first tile only after warpgroup 0 has consumed STAGES - 1 stages of it; the ring is released
// per warp, so that warpgroup 0 was meant to stay ahead and each warpgroup's epilogue to run while the other still has
// products to issue.  Measured in session 17 with RS_PROBE_TRACE: the lag collapses to about 0 by the second tile,
// because the leader keeps only STAGES minus its lead of prefetch in the shared ring).
enum StrippedSchedule { kCoop = 0, kPingPong = 1, kStagger = 2 };

// EB: the epilogue's batch of 8-token columns (StoreAccDirect's BATCH); GELU false compiles the activation out.
template <int BR, int BT, int STAGES, bool RS, bool META, int SCHED, int EPI, int EB, bool GELU>
__global__ void __launch_bounds__(kWsThreads, 1)
    StrippedKernel(const SpmmXtParams p, const __grid_constant__ CUtensorMap tma_a,
                   const __grid_constant__ CUtensorMap tma_x) {
#ifdef JAXSPARSE_WGMMA
  using T = __nv_bfloat16;
  using L = StrippedLayout<BR, BT, RS, META>;
  constexpr bool PP = SCHED == kPingPong, STAG = SCHED == kStagger;
  constexpr int NB = PP ? BR / 64 : BR / 128, NW = BT;  // feature blocks per consumer warpgroup; tokens per wgmma
  static_assert(NB * NW / 2 == 128, "128 accumulators per thread");
  static_assert(L::kStageBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
  static_assert(!(RS && (META || PP)), "RS runs on the constant metadata, cooperatively");
  static_assert(!(SCHED != kCoop && EPI == kEpiStoreHeld), "held stores are for the cooperative tiles");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  const uint32_t smem_base = aligned.addr;
  const uint32_t full0 = smem_base + STAGES * L::kStageBytes, empty0 = full0 + 8 * STAGES;
  const uint32_t stored = empty0 + 8 * STAGES;  // kEpiStoreHeld: a tile's stores performed
  const uint32_t lead = stored + 8;             // kStagger: warpgroup 0 is STAGES - 1 stages ahead
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      MbarInit(full0 + 8 * s, 1);
      MbarInit(empty0 + 8 * s, PP ? 4 : 8);  // the warps that read the stage
    }
    MbarInit(stored, 8);
    MbarInit(lead, 1);
  }
  __syncthreads();
  const int num_kt = (4 * p.groups + kKc - 1) / kKc, nfb = p.rows / BR;
  const int ntiles = nfb * ((p.tokens + BT - 1) / BT);
  if (wg == 0) {  // ------------------------------------------------ producer: one thread
    SetMaxRegisters<40, false>();
    if (tid != 0) return;
    int it = 0, j = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++j) {
      const int row0 = (tile % nfb) * BR, tok0 = (tile / nfb) * BT;
      if (EPI == kEpiStoreHeld && j > 0) MbarWait(stored, (j - 1) & 1);  // tile j - 1's stores performed
      for (int kt = 0; kt < num_kt; ++kt, ++it) {
        const int s = it % STAGES;
        const uint32_t stage = smem_base + s * L::kStageBytes, full = full0 + 8 * s;
        if (it >= STAGES) MbarWait(empty0 + 8 * s, ((it / STAGES) & 1) ^ 1);
        MbarArriveExpectTx(full, L::kStageBytes);
        if (!RS) TmaLoad2d(stage, &tma_a, kt * (kKc / 2), row0, full);
        TmaLoad2d(stage + L::kABytes, &tma_x, kt * kKc, tok0, full);
        if (META)
          BulkLoad(stage + L::kABytes + L::kBBytes, p.meta + (static_cast<int64_t>(row0 / BR) * num_kt + kt) * 2 * BR,
                   L::kMBytes, full);
      }
    }
    return;
  }
  // ---------------------------------------------------------------- consumers
  SetMaxRegisters<232, true>();
  const int cw = wg - 1, wq = warp & 3, words = p.groups / 8;
  const unsigned char* smem = aligned.ptr;
  const uint32_t a_regs[4] = {0x3e803e80u, 0x3f003f00u, 0x3e803f00u, 0x3f003e80u};  // RS: finite bf16, constant
  auto block = [&](int b) { return PP ? b : cw * NB + b; };  // tile-local 64-feature block of this thread's b
  int i = PP ? cw : 0;  // the tile's place in the CTA's sequence
  const int first = blockIdx.x + (PP ? cw * gridDim.x : 0), stride = (PP ? 2 : 1) * gridDim.x;
  const int lead_kt = (num_kt < STAGES ? num_kt : STAGES) - 1;  // kStagger: the stage after which warpgroup 1 may start
  if (STAG && cw == 1 && first < ntiles) MbarWait(lead, 0);
  for (int tile = first; tile < ntiles; tile += stride, i += PP ? 2 : 1) {
    const int row0 = (tile % nfb) * BR, tok0 = (tile / nfb) * BT;
    Trace(cw, i, 0, tid);
    if (PP && i > 0) NamedBarSync(2 + cw, 256);  // the other warpgroup has issued the products of tile i - 1
    float acc[NB][NW / 2];
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int j = 0; j < NW / 2; ++j) acc[b][j] = 0.f;
    // META: operands by stage parity, as the extension keeps them (kSparseMetaRule); else the constant pattern.
    uint32_t e_even[NB][2], e_odd[NB][2];
#pragma unroll
    for (int b = 0; b < NB; ++b) e_even[b][0] = e_even[b][1] = e_odd[b][0] = e_odd[b][1] = 0x44444444u;
    auto fence_acc = [&] {
#pragma unroll
      for (int b = 0; b < NB; ++b) WgmmaFenceOperands(acc[b]);
    };
    const int it0 = i * num_kt;
    auto run_stage = [&](int kt, auto odd) {
      constexpr bool kOdd = decltype(odd)::value;
      uint32_t(&e)[NB][2] = kOdd ? e_odd : e_even;
      const int it = it0 + kt, s = it % STAGES;
      const uint32_t stage = smem_base + s * L::kStageBytes;
      MbarWait(full0 + 8 * s, (it / STAGES) & 1);
      if (META) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(smem + s * L::kStageBytes + L::kABytes + L::kBBytes);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          KeepMetaLive(e[b]);
          const int r = 64 * block(b) + 16 * wq + (lane >> 2);
#pragma unroll
          for (int j = 0; j < 2; ++j)
            e[b][j] = 2 * kt + j < words ? MetaWord(w[2 * r + j], w[2 * (r + 8) + j], lane & 3, 0) : 0x44444444u;
        }
      }
      fence_acc();
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kKc / 32; ++ks) {
        const uint64_t db = WgmmaDescSw128(stage + L::kABytes + ks * 64, 16, 1024);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
          if constexpr (RS) {
            WgmmaSpRs<NW, T, 0>::Run(acc[b], a_regs, db, e[b][ks]);
          } else {
            const uint64_t da = WgmmaDescSw64K(stage + block(b) * kAColBytes + ks * 32, 512);
            WgmmaSp<NW, T, 0>::Run(acc[b], da, db, e[b][ks]);
          }
        }
      }
      WgmmaCommit();
      WgmmaWait<1>();
      fence_acc();
      if (lane == 0 && kt > 0) MbarArrive(empty0 + 8 * ((it - 1) % STAGES));
      if (STAG && it == lead_kt && tid == 128) MbarArrive(lead);  // warpgroup 0's first tile
    };
    for (int kt = 0; kt < num_kt; kt += 2) {
      run_stage(kt, std::false_type{});
      if (kt + 1 < num_kt) run_stage(kt + 1, std::true_type{});
    }
    if (PP && tile + gridDim.x < ntiles) NamedBarArrive(2 + (cw ^ 1), 256);  // the other warpgroup's turn
    WgmmaWait<0>();
    fence_acc();
    if (lane == 0) MbarArrive(empty0 + 8 * ((it0 + num_kt - 1) % STAGES));
    Trace(cw, i, 1, tid);
    if (EPI == kEpiStore || EPI == kEpiStoreHeld)
#pragma unroll
      for (int b = 0; b < NB; ++b)
        StoreAccDirect<T, NW, false, EB, GELU>(acc[b], p, row0, 64 * block(b), tok0, wq, lane);
    if (EPI == kEpiStoreHeld) {
      asm volatile("fence.acq_rel.gpu;\n" ::: "memory");  // this thread's stores performed
      __syncwarp();
      if (lane == 0) MbarArrive(stored);
    }
    if (EPI == kEpiNone) {  // keep every product: each block's first accumulator is written by all its wgmmas
      bool hit = false;
#pragma unroll
      for (int b = 0; b < NB; ++b) hit |= acc[b][0] == -1.2345e30f;  // never true: no store, one compare a block
      if (hit) static_cast<float*>(p.y)[tid] = acc[0][1];
    }
    if (EPI == kEpiDry)
#pragma unroll
      for (int b = 0; b < NB; ++b)
        StoreAccDirect<T, NW, true, EB, GELU>(acc[b], p, row0, 64 * block(b), tok0, wq, lane);
    if (EPI == kEpiSink) {  // the same stores into this CTA's own BT x BR corner of y, again and again
      const int tok_sink = (blockIdx.x % (p.tokens / BT)) * BT;
#pragma unroll
      for (int b = 0; b < NB; ++b)
        StoreAccDirect<T, NW, false, EB, GELU>(acc[b], p, 0, 64 * block(b), tok_sink, wq, lane);
    }
    Trace(cw, i, 2, tid);
  }
#else
  __trap();
#endif
}

template <int BR, int BT, int STAGES, bool RS, bool META, int SCHED, int EPI, int EB, bool GELU>
ffi::Error LaunchStripped(cudaStream_t stream, const SpmmXtParams& p) {
  constexpr auto kernel = StrippedKernel<BR, BT, STAGES, RS, META, SCHED, EPI, EB, GELU>;
  constexpr int smem = STAGES * StrippedLayout<BR, BT, RS, META>::kStageBytes + 16 * STAGES + 16 + 1024;
  static_assert(smem <= 227 * 1024, "shared memory");
  if (ffi::Error e = RaiseSmemLimit<kernel>(smem, "cudaFuncSetAttribute(StrippedKernel)"); e.failure()) return e;
  CUtensorMap tma_a{}, tma_x{};
  if (!MakeTensorMap2d(&tma_a, p.values, p.rows, 2 * static_cast<uint64_t>(p.groups), BR, kKc / 2) ||
      !MakeTensorMap2d(&tma_x, p.xt, p.tokens, p.k, BT))
    return ffi::Error::Internal("cuTensorMapEncodeTiled failed");
  const int tiles = (p.tokens + BT - 1) / BT * (p.rows / BR);
  kernel<<<std::min(tiles, SmCount()), kWsThreads, smem, stream>>>(p, tma_a, tma_x);
  return LastLaunchError("StrippedKernel");
}

struct Variant {
  const char* name;
  int stages;
  bool rs, meta;
  Launcher full, no_epilogue, sink, held, dry;  // held: null for ping-pong
};
template <int BR, int BT, int STAGES, bool RS, bool META = false, int SCHED = kCoop, int EB = 1, bool GELU = true>
Variant Make(const char* name) {
  Launcher held = nullptr;
  if constexpr (SCHED == kCoop) held = LaunchStripped<BR, BT, STAGES, RS, META, kCoop, kEpiStoreHeld, EB, GELU>;
  return {name,
          STAGES,
          RS,
          META,
          LaunchStripped<BR, BT, STAGES, RS, META, SCHED, kEpiStore, EB, GELU>,
          LaunchStripped<BR, BT, STAGES, RS, META, SCHED, kEpiNone, EB, GELU>,
          LaunchStripped<BR, BT, STAGES, RS, META, SCHED, kEpiSink, EB, GELU>,
          held,
          LaunchStripped<BR, BT, STAGES, RS, META, SCHED, kEpiDry, EB, GELU>};
}

// RS_PROBE_TRACE: runs the variant's full and dry kernels once more each and prints CTA 0's median per-tile
// timeline to stderr (cycles): each warpgroup's products and epilogue, the tile period, and how far warpgroup 1's
// products end after warpgroup 0's (the lag a staggered schedule keeps).
void PrintTrace(const Variant& v, const SpmmXtParams& p, int k, int rows) {
  for (const Launcher launch : {v.full, v.dry}) {
    static unsigned long long zero[2][kTraceTiles][3];
    PROBE_CHECK(cudaMemcpyToSymbol(g_trace, zero, sizeof(zero)));
    probe_problem::LaunchOrExit(launch, p);
    PROBE_CHECK(cudaDeviceSynchronize());
    unsigned long long t[2][kTraceTiles][3];
    PROBE_CHECK(cudaMemcpyFromSymbol(t, g_trace, sizeof(t)));
    std::vector<double> prod[2], epi[2], period, lag;
    for (int i = 1; i + 1 < kTraceTiles; ++i) {
      if (t[0][i + 1][0] == 0 || t[1][i + 1][0] == 0) break;
      for (int w = 0; w < 2; ++w) {
        prod[w].push_back(static_cast<double>(t[w][i][1] - t[w][i][0]));
        epi[w].push_back(static_cast<double>(t[w][i][2] - t[w][i][1]));
      }
      period.push_back(static_cast<double>(t[0][i + 1][0] - t[0][i][0]));
      lag.push_back(static_cast<double>(t[1][i][1]) - static_cast<double>(t[0][i][1]));
    }
    auto med = [](std::vector<double> x) {
      if (x.empty()) return -1.0;
      std::sort(x.begin(), x.end());
      return x[x.size() / 2];
    };
    std::fprintf(stderr,
                 "TRACE %d x %d %s %d stages %s: tiles %zu, period %.0f, products %.0f / %.0f, epilogue %.0f / %.0f, "
                 "lag %.0f cycles\n",
                 k, rows, v.name, v.stages, launch == v.full ? "full" : "dry", period.size(), med(period), med(prod[0]),
                 med(prod[1]), med(epi[0]), med(epi[1]), med(lag));
  }
}

int Main() {
  const int tokens = 16384, reps = 50;
  const int shapes[][2] = {{1024, 4096}, {4096, 1024}};  // (K, R)
  cudaDeviceProp prop;
  PROBE_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(0);
  std::printf("{\"gpu\": \"%s\", \"sms\": %d, \"tokens\": %d, \"reps\": %d, \"spec\": \"2:4\", \"results\": [\n",
              prop.name, prop.multiProcessorCount, tokens, reps);
  const Variant variants[] = {Make<128, 256, 4, false>("ss128x256"),
                              Make<128, 256, 5, false>("ss128x256"),
                              Make<128, 256, 5, true>("rs128x256"),
                              Make<128, 256, 6, true>("rs128x256"),
                              Make<256, 128, 5, false>("ss256x128"),
                              Make<256, 128, 6, false>("ss256x128"),
                              Make<256, 128, 8, true>("rs256x128"),
                              Make<256, 128, 12, true>("rs256x128"),
                              Make<128, 256, 4, false, true>("meta-bulk coop128x256"),
                              Make<128, 256, 5, false, true>("meta-bulk coop128x256"),
                              Make<128, 128, 6, false, true, kPingPong>("meta-bulk pp128x128"),
                              Make<128, 128, 8, false, true, kPingPong>("meta-bulk pp128x128"),
                              Make<128, 256, 4, false, false, kStagger>("stagger ss128x256"),
                              Make<128, 256, 5, false, false, kStagger>("stagger ss128x256"),
                              Make<256, 128, 6, false, false, kStagger>("stagger ss256x128"),
                              Make<128, 256, 5, false, true, kStagger>("stagger meta-bulk coop128x256"),
                              Make<128, 256, 4, false, false, kCoop, 4>("batch4 ss128x256"),
                              Make<128, 256, 4, false, false, kCoop, 8>("batch8 ss128x256"),
                              Make<128, 256, 5, false, true, kCoop, 8>("batch8 meta-bulk coop128x256"),
                              Make<128, 256, 4, false, false, kCoop, 1, false>("nogelu batch1 ss128x256"),
                              Make<128, 256, 4, false, false, kCoop, 8, false>("nogelu batch8 ss128x256")};
  const char* only = std::getenv("RS_PROBE_ONLY");
  bool first = true;
  for (const auto& shape : shapes) {
    const int k = shape[0], rows = shape[1];
    probe_problem::RowProblem problem(tokens, k, rows, rng);
    // The constant pattern of the stripped kernels, and random words both as the extension reads them ([R, G/8])
    // and laid out stage by stage for the 128-feature tiles of the META variants.
    const std::vector<uint32_t> constant(problem.MetaWords(), 0x44444444u);
    const std::vector<uint32_t> random = probe_problem::Random24Metadata(problem.MetaWords(), rng);
    const int words = problem.groups / 8, stages = (4 * problem.groups + kKc - 1) / kKc;
    std::vector<uint32_t> staged(static_cast<size_t>(rows) * stages * 2, 0x44444444u);
    for (int r = 0; r < rows; ++r)
      for (int w = 0; w < words; ++w)
        staged[((static_cast<size_t>(r / 128) * stages + w / 2) * 128 + r % 128) * 2 + w % 2] =
            random[static_cast<size_t>(r) * words + w];
    const uint32_t *d_constant = problem.Device(constant), *d_random = problem.Device(random),
                   *d_staged = problem.Device(staged);
    // The extension's kernel: the reference outputs, and (on the random metadata) the time to beat.
    const Launcher ref_launch = [](cudaStream_t s, const SpmmXtParams& q) {
      return LaunchWs<__nv_bfloat16, 128, 256, 4, true, 256>(s, q);
    };
    std::vector<unsigned char> ref_constant, ref_random, got;
    problem.RunPoisoned(ref_launch, problem.Params(d_constant), ref_constant);
    problem.RunPoisoned(ref_launch, problem.Params(d_random), ref_random);
    long long ref_poisoned = 0;
    for (const auto* ref : {&ref_constant, &ref_random})
      for (size_t b = 0; b + 1 < ref->size(); b += 2) ref_poisoned += (*ref)[b] == 0xff && (*ref)[b + 1] == 0xff;
    std::printf("%s  {\"K\": %d, \"N\": %d, \"tile\": \"ws128x256 (extension)\", \"stages\": 4, \"rs\": false, "
                "\"full_ms\": %.5f, \"no_epilogue_ms\": null, \"l2_sink_ms\": null, \"held_ms\": null, "
                "\"dry_ms\": null, \"mismatches_vs_extension\": 0, \"poisoned\": %lld}",
                first ? "" : ",\n", k, rows, MedianMs(ref_launch, problem.Params(d_random), reps), ref_poisoned);
    first = false;
    for (const Variant& v : variants) {
      if (only != nullptr && std::strstr(v.name, only) == nullptr) continue;
      std::fprintf(stderr, "%d x %d: %s, %d stages\n", k, rows, v.name, v.stages);
      const SpmmXtParams p = problem.Params(v.meta ? d_staged : d_constant);
      long long mismatches = -1;  // RS runs on a constant A: not compared
      if (!v.rs) {
        problem.RunPoisoned(v.full, p, got);
        const std::vector<unsigned char>& want = v.meta ? ref_random : ref_constant;
        mismatches = 0;
        for (size_t b = 0; b < got.size(); ++b) mismatches += got[b] != want[b];
      }
      if (std::getenv("RS_PROBE_TRACE") != nullptr) PrintTrace(v, p, k, rows);
      const float full = MedianMs(v.full, p, reps), no_epi = MedianMs(v.no_epilogue, p, reps),
                  sink = MedianMs(v.sink, p, reps), held = v.held ? MedianMs(v.held, p, reps) : -1.f,
                  dry = MedianMs(v.dry, p, reps);
      std::printf(",\n  {\"K\": %d, \"N\": %d, \"tile\": \"%s\", \"stages\": %d, \"rs\": %s, \"full_ms\": %.5f, "
                  "\"no_epilogue_ms\": %.5f, \"l2_sink_ms\": %.5f, \"held_ms\": %.5f, \"dry_ms\": %.5f, "
                  "\"mismatches_vs_extension\": %lld}",
                  k, rows, v.name, v.stages, v.rs ? "true" : "false", full, no_epi, sink, held, dry, mismatches);
      std::fflush(stdout);
    }
  }
  std::printf("\n]}\n");
  return 0;
}

}  // namespace
}  // namespace jaxsparse

int main() { return jaxsparse::Main(); }

// Input gradient dX[T, K] = dY[T, R] @ W^T for a V:2:16 weight on Hopper (wgmma, sm_90a), reducing over each V
// block's kept columns only, with the CTA's rows of dY resident in shared memory: the "resident" dX
// (docs/kernel-notes.md, session 26).
//
// Math view.  Inside one V block b every group keeps the same 4 columns, so
//   P_b[c, t] = sum_{r in b} Wc[r, c] * dY[t, r]           (c = 4g + p: the block's condensed columns)
// is a dense product over V (Wc: the condensed weight, 2 of each 4 non-zero), and
//   dX[t, g*M + cols[b, g, p]] += P_b[4g + p, t].
// Per CTA: 64 tokens, all of dY's R <= 1024 columns for them loaded once by TMA (128 KB at R = 1024), then the
// output columns in chunks of 16 groups (256 columns).  Per chunk and block, one m64n64 product over the block's V
// rows: A = the 64 condensed columns of Wc^T, read straight from global memory into registers in the wgmma A
// fragment order (`format.resident_dx_fragments` builds that order in XLA), B = the resident dY (K-major), so no
// weight tile passes through shared memory.  The two warpgroups take alternate blocks and add their accumulators
// into a float32 [64 t][256 k] shared tile in block order, taking turns (any mask: columns kept by several blocks
// sum, columns kept by none stay 0; the same sums on every run); at the chunk's end the tile goes out as 16-byte
// rows of the input dtype and is cleared.  Each warpgroup keeps two accumulators, so its next block's product runs
// while it adds the last one (v6; docs/kernel-notes.md, session 27).  Work: 4/M of the dense product's MMAs; L2
// traffic per CTA: its dY rows once and Wc once.
#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"
#include "wgmma.cuh"

namespace jaxsparse {
namespace {

struct DxResidentParams {
  const uint4* frags;    // [G/16][R/V][4 warps][V/16][32 lanes] 16-byte A fragments (format.resident_dx_fragments)
  const uint8_t* cols;   // [R/V, G, 4]
  void* dx;              // [T, K]
  int tokens, k, rows, groups;
};

constexpr int kDrM = 16;                      // the one group width built
constexpr int kDrBT = 64;                     // tokens per CTA (the wgmma N)
constexpr int kDrGC = 16;                     // groups per chunk: 64 condensed columns (the wgmma M)
constexpr int kDrW = kDrGC * kDrM;            // output columns per chunk
constexpr int kDrThreads = 256;               // two warpgroups
constexpr int kDrMaxRows = 1024;              // dY's columns held per CTA
constexpr int kDrDyBox = kDrBT * 128;         // [64 t][64 r] of 16-bit values, 128-byte swizzled
constexpr int kDrStride = kDrW + 4;           // floats per row of the float32 tile
constexpr int kDrTileBytes = kDrBT * kDrStride * 4;
static_assert(kDrW == 256 && kDrThreads == 256, "the store pass gives each lane 8 of a row's 256 columns");

__host__ __device__ constexpr int DrTileOff(int rows) { return (rows / 64) * kDrDyBox; }
// The current chunk's columns bytes, [R/V][16 groups][4], at most 16 blocks (R <= 1024, V >= 64): 1 KB.
__host__ __device__ constexpr int DrColsOff(int rows) { return DrTileOff(rows) + kDrTileBytes; }
__host__ __device__ constexpr int DrBarOff(int rows) { return DrColsOff(rows) + 1024; }
constexpr int DrSmemBytes(int rows) { return DrBarOff(rows) + 8 + 1024; }

template <typename T, int V>
__global__ void __launch_bounds__(kDrThreads, 1)
    DxResidentKernel(const DxResidentParams p, const __grid_constant__ CUtensorMap tma_dy) {
#ifdef JAXSPARSE_WGMMA
  constexpr int KS = V / 16;  // k16 steps per block
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const AlignedSmem aligned = AlignSmem1024(smem_raw);
  const uint32_t smem_base = aligned.addr;
  float* tile = reinterpret_cast<float*>(aligned.ptr + DrTileOff(p.rows));
  const uint32_t bar = smem_base + DrBarOff(p.rows);
  uint32_t* cols_s = reinterpret_cast<uint32_t*>(aligned.ptr + DrColsOff(p.rows));

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2, wq = warp & 3;
  const int gid = lane >> 2, tig = lane & 3;
  const int tok0 = blockIdx.x * kDrBT;
  const int blocks = p.rows / V, chunks = p.groups / kDrGC;
  const int boxes = p.rows / 64;

  // A chunk's columns words (4 bytes: one group's 4 kept columns) for every block: word b * 16 + g, one per thread.
  const int col_words = (p.rows / V) * kDrGC;
  auto cols_word = [&](int j) -> uint32_t {
    return reinterpret_cast<const uint32_t*>(p.cols)[(tid / kDrGC) * p.groups + j * kDrGC + tid % kDrGC];
  };
  if (tid < col_words) cols_s[tid] = cols_word(0);
  uint32_t next_cols = tid < col_words && p.groups > kDrGC ? cols_word(1) : 0u;  // the next chunk's, in flight
  if (tid == 0) MbarInit(bar, 1);
  for (int i = tid; i < kDrBT * kDrStride / 4; i += kDrThreads) reinterpret_cast<float4*>(tile)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();
  if (tid == 0) {
    MbarArriveExpectTx(bar, boxes * kDrDyBox);
    for (int h = 0; h < boxes; ++h) TmaLoad2d(smem_base + h * kDrDyBox, &tma_dy, 64 * h, tok0, bar);
  }

  // This warpgroup's blocks are wg, wg + 2, ...; item n of its sequence is (chunk n / mine, block wg + 2 (n % mine)).
  const int mine = (blocks - wg + 1) / 2;
  const int items = mine * chunks;
  auto frag_ptr = [&](int n) {
    const int j = n / mine, b = wg + 2 * (n % mine);
    return p.frags + ((static_cast<int64_t>(j) * blocks + b) * 4 + wq) * 32 * KS + lane;
  };
  auto load = [&](int n, uint32_t (&dst)[KS][4]) {
    const uint4* f = frag_ptr(n);
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const uint4 v = __ldg(f + 32 * s);  // a warp's 32 lanes read 512 contiguous bytes
      dst[s][0] = v.x, dst[s][1] = v.y, dst[s][2] = v.z, dst[s][3] = v.w;
    }
  };
  // Two accumulators and two fragment buffers, taken alternately: item n + 1's product runs while item n's sums go
  // into the tile.  A buffer's fragments stay live (fenced) until the wgmma reading them has completed, since an RS
  // wgmma reads its registers asynchronously; only then is the buffer refilled, with item n + 2's.
  float acc_a[32], acc_b[32];
  uint32_t frag_a[KS][4], frag_b[KS][4];
  auto issue = [&](int n, float (&acc)[32], const uint32_t (&frag)[KS][4]) {
    const int b = wg + 2 * (n % mine);
#pragma unroll
    for (int q = 0; q < 32; ++q) acc[q] = 0.f;
    WgmmaFenceOperands(acc);
    WgmmaFence();
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int r16 = b * KS + s;  // the k16 step's first row of R, in units of 16
      const uint64_t db = WgmmaDescSw128(smem_base + (r16 / 4) * kDrDyBox + (r16 % 4) * 32, 16, 1024);
      WgmmaRs<64, T, 0>::Run(acc, frag[s], db);
    }
    WgmmaCommit();
  };
  // Store pass of chunk j: warp w writes rows w, w + 8, ...; lane l columns 8 l .. 8 l + 7 (one 512-byte row per
  // warp step); then the next chunk's columns words go in (no thread reads them between the two barriers).
  auto store_chunk = [&](int j) {
    __syncthreads();
    T* __restrict__ dx = static_cast<T*>(p.dx);
#pragma unroll
    for (int row = warp; row < kDrBT; row += kDrThreads / 32) {
      float4* src = reinterpret_cast<float4*>(tile + row * kDrStride + 8 * lane);
      const float4 lo = src[0], hi = src[1];
      src[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      src[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (tok0 + row < p.tokens) {
        uint4 out;
        out.x = PackPair<T>(lo.x, lo.y);
        out.y = PackPair<T>(lo.z, lo.w);
        out.z = PackPair<T>(hi.x, hi.y);
        out.w = PackPair<T>(hi.z, hi.w);
        *reinterpret_cast<uint4*>(dx + static_cast<int64_t>(tok0 + row) * p.k + j * kDrW + 8 * lane) = out;
      }
    }
    if (j + 1 < chunks && tid < col_words) {
      cols_s[tid] = next_cols;
      if (j + 2 < chunks) next_cols = cols_word(j + 2);
    }
    __syncthreads();
  };
  // Item n: product n + 1 issued (its fragments are in), then product n waited for, its buffer refilled with item
  // n + 2's fragments, and its sums added; the chunk's last item ends with the store pass.
  auto step = [&](int n, float (&acc)[32], uint32_t (&frag)[KS][4], float (&acc_next)[32],
                  uint32_t (&frag_next)[KS][4]) {
    const bool next = n + 1 < items;
    if (next) issue(n + 1, acc_next, frag_next);
    const int b = wg + 2 * (n % mine);
    // Accumulator register q: condensed column 16 wq + gid + 8 ((q / 2) % 2), token 8 (q / 4) + 2 tig + q % 2.
    int col[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 16 * wq + gid + 8 * h;
      col[h] = (c / 4) * kDrM + reinterpret_cast<const uint8_t*>(cols_s)[(b * kDrGC + c / 4) * 4 + c % 4];
    }
    if (next)
      WgmmaWait<1>();
    else
      WgmmaWait<0>();
    WgmmaFenceOperands(acc);
#pragma unroll
    for (int s = 0; s < KS; ++s) WgmmaFenceOperands(frag[s]);
    if (n + 2 < items) load(n + 2, frag);

    // The blocks' sums go into the tile in block order, one warpgroup at a time (named barrier 1: block b of
    // warpgroup 0 is in, warpgroup 1 may add b + 1; barrier 2 the other way): plain read-modify-writes, no atomics,
    // the same order on every run.  Within a block the kept columns are distinct, so no two lanes share an address.
    if (b > 0) NamedBarSync(wg == 0 ? 2 : 1, kDrThreads);
    // All 32 loads first, then the stores: a thread's 32 addresses are distinct (16 tokens x 2 columns), so the
    // loads need not wait for each other's stores (the compiler cannot prove that across run-time columns).
    float old[32];
#pragma unroll
    for (int q = 0; q < 32; ++q) old[q] = tile[(8 * (q / 4) + 2 * tig + q % 2) * kDrStride + col[(q / 2) % 2]];
#pragma unroll
    for (int q = 0; q < 32; ++q) tile[(8 * (q / 4) + 2 * tig + q % 2) * kDrStride + col[(q / 2) % 2]] = old[q] + acc[q];
    if (b + 1 < blocks) NamedBarArrive(wg == 0 ? 1 : 2, kDrThreads);
    if (n % mine == mine - 1) store_chunk(n / mine);
  };

  if (items > 0) load(0, frag_a);
  if (items > 1) load(1, frag_b);
  MbarWait(bar, 0);
  if (items > 0) {
    issue(0, acc_a, frag_a);
    for (int n = 0; n < items; n += 2) {
      step(n, acc_a, frag_a, acc_b, frag_b);
      if (n + 1 < items) step(n + 1, acc_b, frag_b, acc_a, frag_a);
    }
  } else {
    for (int j = 0; j < chunks; ++j) store_chunk(j);  // a warpgroup with no block (R = V) still takes the barriers
  }
#else
  __trap();  // launched only where the sm_90a image exists (see Sm90aImageLoaded)
#endif
}

// ---------------------------------------------------------------- host side

template <typename T, int V>
ffi::Error Launch(cudaStream_t stream, const DxResidentParams& p, const ffi::AnyBuffer& dy) {
  constexpr auto kernel = DxResidentKernel<T, V>;
  if (!Sm90aImageLoaded<kernel>())
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t_resident needs an sm_90a build on a Hopper GPU");
  const int smem = DrSmemBytes(p.rows);
  if (ffi::Error e = RaiseSmemLimit<kernel>(DrSmemBytes(kDrMaxRows), "cudaFuncSetAttribute(DxResidentKernel)");
      e.failure())
    return e;
  CUtensorMap tma_dy{};
  if (!MakeTensorMap2d(&tma_dy, dy.untyped_data(), p.tokens, p.rows, kDrBT))
    return ffi::Error::Internal("jaxsparse_spmm_t_resident: cuTensorMapEncodeTiled failed");
  dim3 grid((p.tokens + kDrBT - 1) / kDrBT);
  kernel<<<grid, kDrThreads, smem, stream>>>(p, tma_dy);
  return LastLaunchError("DxResidentKernel");
}

ffi::Error DxResidentImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer frags, ffi::AnyBuffer cols,
                          ffi::Result<ffi::AnyBuffer> out, int32_t v, int32_t m) {
  const std::string name = "jaxsparse_spmm_t_resident";
  if (dy.dimensions().size() != 2 || frags.dimensions().size() != 1 || cols.dimensions().size() != 3 ||
      out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument(name + ": dy and the output must be 2-D, frags 1-D, columns 3-D");
  if (m != kDrM || (v != 64 && v != 128))
    return ffi::Error::InvalidArgument(name + ": built for M = 16 and V in {64, 128}, got V = " + std::to_string(v) +
                                       ", M = " + std::to_string(m));
  const int64_t tokens = Dim(dy, 0), rows = Dim(dy, 1), k = out->dimensions()[1], groups = k / m;
  if (k % m || groups % kDrGC || rows % v || rows % 64 || rows > kDrMaxRows || rows == 0 ||
      Dim(frags, 0) != rows * 4 * groups || Dim(cols, 0) != rows / v || Dim(cols, 1) != groups || Dim(cols, 2) != 4 ||
      out->dimensions()[0] != tokens)
    return ffi::Error::InvalidArgument(name + ": inconsistent shapes (needs R % V == 0, 64 <= R <= 1024, K % 256 == 0): dy " +
                                       ShapeString(dy) + ", frags " + ShapeString(frags) + ", columns " +
                                       ShapeString(cols) + ", out " + ShapeString(*out) + " for V = " + std::to_string(v));
  const auto dt = dy.element_type();
  if (frags.element_type() != dt || out->element_type() != dt || cols.element_type() != ffi::U8)
    return ffi::Error::InvalidArgument(name + ": dy, frags and output must share one dtype; columns uint8");
  if (tokens == 0 || k == 0) return ffi::Error::Success();
  if (tokens >= (int64_t(1) << 30) || k >= (int64_t(1) << 30))
    return ffi::Error::InvalidArgument(name + ": shape too large");

  DxResidentParams p;
  p.frags = static_cast<const uint4*>(frags.untyped_data());
  p.cols = static_cast<const uint8_t*>(cols.untyped_data());
  p.dx = out->untyped_data();
  p.tokens = static_cast<int>(tokens);
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);
  p.groups = static_cast<int>(groups);
  if (dt == ffi::BF16)
    return v == 64 ? Launch<__nv_bfloat16, 64>(stream, p, dy) : Launch<__nv_bfloat16, 128>(stream, p, dy);
  if (dt == ffi::F16) return v == 64 ? Launch<__half, 64>(stream, p, dy) : Launch<__half, 128>(stream, p, dy);
  return ffi::Error::InvalidArgument(name + ": dy must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSpmmTResident, jaxsparse::DxResidentImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // dy [T, R]
                                  .Arg<xla::ffi::AnyBuffer>()  // frags [R * 4G] (format.resident_dx_fragments)
                                  .Arg<xla::ffi::AnyBuffer>()  // columns [R/V, G, 4] uint8
                                  .Ret<xla::ffi::AnyBuffer>()  // dx [T, K]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);

// Input gradient dX[T, K] = dY[T, R] @ W^T with W a compressed V:2:M SparseWeight (docs/format.md).
// Design notes: docs/kernel-notes.md ("Backward kernels").
//
// Math view: A = W^T [R, K].  Inside one V-row block b every group g keeps the same 4 columns, so
//   P_b[t, 4g + p] = sum_{r in b} dY[t, r] * Ac[r, 4g + p]        (Ac = the condensed A: 2 of 4 non-zero)
// is a dense product over the block's V rows, and dX[t, g*M + cols[b, g, p]] += P_b[t, 4g + p].
// Per CTA: BT = 64 tokens x GC groups (W = GC*M = 256 dense output columns), with the whole reduction over
// all R rows inside the CTA: P_b lives in mma.sync m16n8k16 accumulators (registers) for the V rows of
// one block, then each warp adds it into an fp32 shared-memory accumulator [BT][W] at the block's
// columns and restarts.  No global atomics, no dense W.  For M = 4 (V = 1) the column map is the
// identity and the accumulators run over all of R, with one scatter at the end.
//
// Work: 2*T*R*4G = 4/M of the dense product (half of it on the zeros of the 2:4 pattern: the 2:4
// sparsity lies along the output columns of this product, not along its reduction, so mma.sp cannot
// use it).  Scatter: one fp32 read-modify-write in shared memory per 2*V MMA flops.
//
// Pipeline per stage (RS = 32 rows of R): cp.async of the dY slab [BT][RS], the values [RS][2GC], the
// metadata words [RS][GC/8] and the block's column words [GC]; then an expansion pass writes
// Ac [RS][4GC] (2 values + 2 zeros per group, placed by the metadata), then ldmatrix (dY, row-major) and
// ldmatrix.trans (Ac) feed the MMAs.  Epilogue: the fp32 accumulator -> dY dtype -> 16-byte stores.
// Ownership: warp (wm, wn) owns tokens [wm*WM, +WM) and groups [wn*WN/4, +WN/4) of the shared
// accumulator for the whole kernel, so its scatters race with no other warp (a __syncwarp orders its
// own lanes between blocks), and within one block the 4 kept columns of a group are distinct.
#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"

namespace jaxsparse {
namespace {

struct SpmmTParams {
  const void* dy;        // [T, R]
  const void* values;    // [R, 2G]
  const uint8_t* cols;   // [R/V, G, 4] or null (M = 4)
  const uint32_t* meta;  // [R, G/8]
  void* dx;              // [T, K]
  int tokens, k, rows, groups, v;
};

constexpr int kStBT = 64;   // tokens per CTA
constexpr int kStRS = 32;   // rows of R per pipeline stage (two k16 mma steps); divides V = 64, 128
constexpr int kStW = 256;   // dense output columns per CTA
constexpr int kStThreads = 256;
constexpr int kStStages = 3;

template <int M>
struct SpmmTCfg;
template <>
struct SpmmTCfg<4> {
  static constexpr int WARPS_M = 2, WARPS_N = 4;  // warp tile 32 x 64
};
template <>
struct SpmmTCfg<8> {
  static constexpr int WARPS_M = 2, WARPS_N = 4;  // 32 x 32
};
template <>
struct SpmmTCfg<16> {
  static constexpr int WARPS_M = 4, WARPS_N = 2;  // 16 x 32
};
template <>
struct SpmmTCfg<32> {
  static constexpr int WARPS_M = 4, WARPS_N = 2;  // 16 x 16
};

template <int M>
struct SpmmTLayout {
  static constexpr int GC = kStW / M;             // groups per CTA (a multiple of 8)
  static constexpr int NC = 4 * GC;               // condensed columns per CTA
  static constexpr int kDyRowBytes = kStRS * 2 + 16;   // 80 B rows: conflict-free ldmatrix
  static constexpr int kValRowBytes = 4 * GC;          // 2 values per group
  static constexpr int kMetaRowWords = GC / 8;
  static constexpr int kDyOff = 0;
  static constexpr int kValOff = kDyOff + kStBT * kDyRowBytes;
  static constexpr int kMetaOff = kValOff + kStRS * kValRowBytes;
  static constexpr int kColOff = kMetaOff + kStRS * kMetaRowWords * 4;
  static constexpr int kStageBytes = kColOff + (M > 4 ? 4 * GC : 0);
  static constexpr int kAcRowBytes = (NC + 8) * 2;
  static constexpr int kAcOff = kStStages * kStageBytes;
  static constexpr int kAccRowFloats = kStW + 4;
  static constexpr int kAccOff = kAcOff + kStRS * kAcRowBytes;
  static constexpr int kSmemBytes = kAccOff + kStBT * kAccRowFloats * 4;
  static_assert(GC % 8 == 0, "whole metadata words per CTA");
  static_assert(kValOff % 16 == 0 && kMetaOff % 16 == 0 && kColOff % 16 == 0 && kStageBytes % 16 == 0 &&
                    kAcOff % 16 == 0 && kAccOff % 16 == 0,
                "16-byte alignment");
};

template <typename T, int M>
__global__ void __launch_bounds__(kStThreads) SpmmTKernel(const SpmmTParams p) {
  using C = SpmmTCfg<M>;
  using L = SpmmTLayout<M>;
  constexpr int GC = L::GC, NC = L::NC;
  constexpr int WM = kStBT / C::WARPS_M, WN = NC / C::WARPS_N;
  constexpr int MI = WM / 16, NI = WN / 8;
  static_assert(C::WARPS_M * C::WARPS_N * 32 == kStThreads, "8 warps");
  static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile");

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t smem_base = SmemAddr(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp % C::WARPS_M, warp_n = warp / C::WARPS_M;
  const int gid = lane >> 2, tig = lane & 3;

  const int tok0 = blockIdx.x * kStBT;
  const int g0 = blockIdx.y * GC;
  const int groups = p.groups;
  const int num_kt = p.rows / kStRS;
  const int64_t val_stride = 2 * static_cast<int64_t>(groups);
  const int meta_stride = groups / 8;
  const T* __restrict__ dy = static_cast<const T*>(p.dy);
  const T* __restrict__ values = static_cast<const T*>(p.values);
  float* acc_s = reinterpret_cast<float*>(smem + L::kAccOff);

  // ---- copy assignments (fixed; only the row offset moves)
  // dY slab: BT tokens x 4 chunks = 256 chunks, one per thread.
  static_assert(kStBT * (kStRS / 8) == kStThreads, "dy copy split");
  const int dy_t = tid / (kStRS / 8), dy_c = tid % (kStRS / 8);
  const bool dy_ok = tok0 + dy_t < p.tokens;
  const T* dy_src0 = dy + static_cast<int64_t>(dy_ok ? tok0 + dy_t : 0) * p.rows + dy_c * 8;
  const uint32_t dy_dst = L::kDyOff + dy_t * L::kDyRowBytes + dy_c * 16;
  // values: RS rows x GC/4 chunks (4 groups each).
  constexpr int kValCpr = GC / 4;
  constexpr int kValChunks = kStRS * kValCpr;
  constexpr int kValIters = (kValChunks + kStThreads - 1) / kStThreads;
  // metadata: RS rows x GC/8 words.
  constexpr int kMetaWords = kStRS * L::kMetaRowWords;
  constexpr int kMetaIters = (kMetaWords + kStThreads - 1) / kStThreads;

  auto load_stage = [&](int buf, int kt) {
    const uint32_t base = smem_base + buf * L::kStageBytes;
    const int r0 = kt * kStRS;
    CpAsync16(base + dy_dst, dy_src0 + r0, dy_ok ? 16 : 0);
#pragma unroll
    for (int it = 0; it < kValIters; ++it) {
      const int idx = tid + it * kStThreads;
      if (kValChunks % kStThreads == 0 || idx < kValChunks) {
        const int row = idx / kValCpr, c = idx % kValCpr;
        const bool ok = g0 + 4 * c < groups;
        CpAsync16(base + L::kValOff + row * L::kValRowBytes + c * 16,
                  ok ? values + (r0 + row) * val_stride + 2 * (g0 + 4 * c) : values, ok ? 16 : 0);
      }
    }
#pragma unroll
    for (int it = 0; it < kMetaIters; ++it) {
      const int idx = tid + it * kStThreads;
      if (kMetaWords % kStThreads == 0 || idx < kMetaWords) {
        const int row = idx / L::kMetaRowWords, c = idx % L::kMetaRowWords;
        const bool ok = g0 + 8 * c < groups;
        CpAsync4Zfill(base + L::kMetaOff + (row * L::kMetaRowWords + c) * 4,
                      ok ? p.meta + static_cast<int64_t>(r0 + row) * meta_stride + g0 / 8 + c : p.meta, ok ? 4 : 0);
      }
    }
    if constexpr (M > 4) {
      if (tid < GC / 4) {
        const bool ok = g0 + 4 * tid < groups;
        const int64_t blk = r0 / p.v;
        CpAsync16(base + L::kColOff + tid * 16, ok ? p.cols + (blk * groups + g0 + 4 * tid) * 4 : p.cols,
                  ok ? 16 : 0);
      }
    }
  };

  // Zero the shared accumulator (ordered before the first scatter by the loop's first barrier).
  for (int i = tid; i < kStBT * L::kAccRowFloats / 4; i += kStThreads)
    reinterpret_cast<float4*>(acc_s)[i] = make_float4(0.f, 0.f, 0.f, 0.f);

  float acc[MI][NI][4];
  ZeroAccumulators(acc);

#pragma unroll
  for (int s = 0; s < kStStages - 1; ++s) {
    if (s < num_kt) load_stage(s, s);
    CpAsyncCommit();
  }

  // ldmatrix lane addresses.  A = dY (16 tokens x 16 rows of R), row-major [t][r], non-transposed:
  // matrices (t 0-7, r 0-7), (t 8-15, r 0-7), (t 0-7, r 8-15), (t 8-15, r 8-15).
  const int a_t = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_r = (lane >> 4) * 8;
  // B = Ac (16 rows of R x 16 condensed columns) from Ac [r][q], transposed: matrices (r 0-7, q 0-7),
  // (r 8-15, q 0-7), (r 0-7, q 8-15), (r 8-15, q 8-15) -> b0/b1 of n-tile 2j, then of n-tile 2j+1.
  const int b_r = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int b_q = (lane >> 4) * 8;
  constexpr int kExpItems = kStRS * GC;
  static_assert(kExpItems % kStThreads == 0, "expansion split");

  for (int kt = 0; kt < num_kt; ++kt) {
    CpAsyncWait<kStStages - 2>();
    __syncthreads();  // stage kt landed; every warp is done with stage kt-1 and with Ac
    {
      const int next = kt + kStStages - 1;
      if (next < num_kt) load_stage(next % kStStages, next);
      CpAsyncCommit();
    }
    const unsigned char* sb = smem + (kt % kStStages) * L::kStageBytes;
    const uint32_t base = smem_base + (kt % kStStages) * L::kStageBytes;

    // Expansion: Ac[row][4gl + p] = the value whose metadata position is p, else 0.
#pragma unroll
    for (int it = 0; it < kExpItems / kStThreads; ++it) {
      const int idx = tid + it * kStThreads;
      const int row = idx / GC, gl = idx % GC;
      const uint32_t vals = *reinterpret_cast<const uint32_t*>(sb + L::kValOff + row * L::kValRowBytes + gl * 4);
      const uint32_t word =
          reinterpret_cast<const uint32_t*>(sb + L::kMetaOff)[row * L::kMetaRowWords + (gl >> 3)];
      const uint32_t nib = (word >> (4 * (gl & 7))) & 0xFu;
      const uint32_t p0 = nib & 3u, p1 = nib >> 2;
      const uint32_t v0 = vals & 0xFFFFu, v1 = vals >> 16;
      uint32_t e[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)  // the second value wins a (malformed) repeated position, as in decompress
        e[q] = p1 == static_cast<uint32_t>(q) ? v1 : (p0 == static_cast<uint32_t>(q) ? v0 : 0u);
      *reinterpret_cast<uint2*>(smem + L::kAcOff + row * L::kAcRowBytes + gl * 8) =
          make_uint2(e[0] | (e[1] << 16), e[2] | (e[3] << 16));
    }
    __syncthreads();

#pragma unroll
    for (int ks = 0; ks < kStRS / 16; ++ks) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int t = warp_m * WM + mi * 16 + a_t;
        LdMatrixX4(a[mi], base + L::kDyOff + t * L::kDyRowBytes + (ks * 16 + a_r) * 2);
      }
      uint32_t b[NI][2];
#pragma unroll
      for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t f[4];
        const int q = warp_n * WN + nj * 16 + b_q;
        LdMatrixX4Trans(f, smem_base + L::kAcOff + (ks * 16 + b_r) * L::kAcRowBytes + q * 2);
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

    // End of a V block (M > 4) or of all rows (M = 4): add P_b into the shared accumulator.
    const bool block_end = (M == 4) ? (kt == num_kt - 1) : (((kt + 1) * kStRS) % p.v == 0);
    if (block_end) {
      const uint32_t* cw = reinterpret_cast<const uint32_t*>(sb + L::kColOff);
      __syncwarp();  // this warp's lanes finished the previous block's read-modify-writes
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int q = warp_n * WN + ni * 8 + 2 * tig;  // condensed columns q, q+1: same group
        const int gl = q >> 2, pos = q & 3;
        int c0 = pos, c1 = pos + 1;
        if constexpr (M > 4) {
          const uint32_t w = cw[gl];
          c0 = (w >> (8 * pos)) & 0xFF;
          c1 = (w >> (8 * pos + 8)) & 0xFF;
        }
        const int col0 = gl * M + c0, col1 = gl * M + c1;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float* rowp = acc_s + (warp_m * WM + mi * 16 + gid + h * 8) * L::kAccRowFloats;
            rowp[col0] += acc[mi][ni][2 * h];
            rowp[col1] += acc[mi][ni][2 * h + 1];
            acc[mi][ni][2 * h] = 0.f;
            acc[mi][ni][2 * h + 1] = 0.f;
          }
      }
    }
  }

  // ---------------------------------------------------------------- epilogue
  CpAsyncWait<0>();
  __syncthreads();
  T* __restrict__ dx = static_cast<T*>(p.dx);
  constexpr int kChunks = kStW / 8;
  for (int i = tid; i < kStBT * kChunks; i += kStThreads) {
    const int t = i / kChunks, c = i % kChunks;
    const int tok = tok0 + t;
    const int col = g0 * M + c * 8;
    if (tok >= p.tokens || col >= p.k) continue;
    const float4 lo = *reinterpret_cast<const float4*>(acc_s + t * L::kAccRowFloats + c * 8);
    const float4 hi = *reinterpret_cast<const float4*>(acc_s + t * L::kAccRowFloats + c * 8 + 4);
    const uint4 out = make_uint4(PackPair<T>(lo.x, lo.y), PackPair<T>(lo.z, lo.w), PackPair<T>(hi.x, hi.y),
                                 PackPair<T>(hi.z, hi.w));
    *reinterpret_cast<uint4*>(dx + static_cast<int64_t>(tok) * p.k + col) = out;
  }
}

// ---------------------------------------------------------------- host side

template <typename T, int M>
ffi::Error Launch(cudaStream_t stream, const SpmmTParams& p) {
  constexpr int kSmem = SpmmTLayout<M>::kSmemBytes;
  constexpr auto kernel = SpmmTKernel<T, M>;
  if (ffi::Error e = RaiseSmemLimit<kernel>(kSmem, "cudaFuncSetAttribute(SpmmTKernel)"); e.failure()) return e;
  constexpr int GC = SpmmTLayout<M>::GC;
  dim3 grid((p.tokens + kStBT - 1) / kStBT, (p.groups + GC - 1) / GC);
  kernel<<<grid, kStThreads, kSmem, stream>>>(p);
  return LastLaunchError("SpmmTKernel");
}

template <typename T>
ffi::Error Dispatch(cudaStream_t stream, const SpmmTParams& p, int m) {
  return DispatchGroupWidth("jaxsparse_spmm_t", m, [&](auto width) { return Launch<T, decltype(width)::value>(stream, p); });
}

ffi::Error SpmmTImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                     ffi::Buffer<ffi::U32> metadata, ffi::Result<ffi::AnyBuffer> out, int32_t v, int32_t m) {
  if (dy.dimensions().size() != 2 || values.dimensions().size() != 2 || metadata.dimensions().size() != 2 ||
      out->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t: dy, values, metadata and output must be 2-D");
  const int64_t tokens = Dim(dy, 0), rows = Dim(dy, 1), groups = Dim(values, 1) / 2, k = out->dimensions()[1];
  if (ffi::Error e = CheckSparseWeight("jaxsparse_spmm_t", rows, groups, columns, metadata, v, m); e.failure()) return e;
  if (Dim(values, 0) != rows || k != groups * m || out->dimensions()[0] != tokens || rows % 64)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t: inconsistent shapes: dy " + ShapeString(dy) +
                                       ", values " + ShapeString(values) + ", metadata " + ShapeString(metadata) +
                                       ", out " + ShapeString(*out));
  const auto dt = dy.element_type();
  if (values.element_type() != dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t: dy, values and output must share one dtype");
  if (tokens == 0 || k == 0) return ffi::Error::Success();
  if (tokens >= (int64_t(1) << 30) || k >= (int64_t(1) << 30) || rows >= (int64_t(1) << 30) ||
      (groups + 7) / 8 > 65535)
    return ffi::Error::InvalidArgument("jaxsparse_spmm_t: shape too large");

  SpmmTParams p;
  p.dy = dy.untyped_data();
  p.values = values.untyped_data();
  p.cols = m > 4 ? columns.typed_data() : nullptr;
  p.meta = metadata.typed_data();
  p.dx = out->untyped_data();
  p.tokens = static_cast<int>(tokens);
  p.k = static_cast<int>(k);
  p.rows = static_cast<int>(rows);  // 0 rows: the kernel writes zeros
  p.groups = static_cast<int>(groups);
  p.v = v;
  if (dt == ffi::BF16) return Dispatch<__nv_bfloat16>(stream, p, m);
  if (dt == ffi::F16) return Dispatch<__half>(stream, p, m);
  return ffi::Error::InvalidArgument("jaxsparse_spmm_t: dy must be bfloat16 or float16");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseSpmmT, jaxsparse::SpmmTImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()               // dy [T, R]
                                  .Arg<xla::ffi::AnyBuffer>()               // values [R, 2G]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()    // columns [R/V, G, 4] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()   // metadata [R, G/8]
                                  .Ret<xla::ffi::AnyBuffer>()               // dx [T, K]
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);

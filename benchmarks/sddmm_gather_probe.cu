// Probe of the SDDMM design in docs/kernel-notes.md, session 11 ("The SDDMM design to build next"): the condensed
// V:2:8 weight gradient from x rows [T, K], with one x tile shared by 4 V blocks and wgmma's A operand gathered
// from registers.  Written in session 11, first run in session 12: correct, and 0.68x of cuBLAS's dense dW;
// shared-memory bandwidth bounds it (docs/kernel-notes.md, session 12).  It is its own program (not part of the
// extension or of CI).
//
//   bash benchmarks/sddmm_gather_probe.sh      # nvcc (sm_90a, cuBLAS), runs it, prints one JSON document
//
// What it computes (the values layout of docs/format.md, V = 64, M = 8):
//   out[r, 2g + j] = sum_t x[t, 8g + cols[r / 64, g, p_j]] * dy[t, r],  p_j = bits 2j .. 2j+1 of meta nibble (r, g)
// CTA tile: 4 V blocks (256 rows r) x 32 groups (256 real columns of x, 128 kept per V block) x a token range
// (grid.z splits the tokens; float32 partial planes, then a reduce kernel).  Per 64-token stage, thread 0 issues
// TMA for the x tile [64 t][256 k] and the dy tile [64 t][256 r] (8 boxes of 64 x 64, 128-byte swizzle), 3
// stages deep.  All 256 threads then transpose the x tile into xT [256 k][64 t] (tokens permuted inside each
// 16-token step so that a thread's A fragment of one row is one 64-bit load; 16-byte chunks XOR-swizzled by
// f(k) = (k ^ k >> 2) & 7 so that both the transpose's stores and the gathers spread over the banks).  Each
// warpgroup owns 64 of a V block's 128 kept columns and runs, per V block and k16 step, one
// wgmma.m64n64k16 with A = its gathered xT rows (registers) and B = the V block's dy box (MN-major, shared).
// Epilogue: each accumulator (kept column m, row r) is stored where the row's metadata names it, else dropped.
//
// v0 simplifications (to measure before optimizing): one xT buffer and two barriers per stage, so the
// transpose and the products of one CTA do not overlap; the wgmma group is waited for at the end of each stage.
#if !defined(PROBE_NO_CUBLAS) && __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define PROBE_CUBLAS 1
#endif
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "probe_timing.cuh"
#include "wgmma.cuh"

namespace probe {

constexpr int kM = 8, kV = 64;
constexpr int kBT = 64;                 // tokens per stage
constexpr int kVB = 4;                  // V blocks per CTA
constexpr int kBR = kVB * kV;           // 256 rows r per CTA
constexpr int kGC = 32;                 // groups per CTA
constexpr int kBK = kGC * kM;           // 256 real x columns per CTA
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kBox = kBT * 64 * 2;      // one 64 x 64 box of 16-bit values: 8 KB
constexpr int kXBytes = 4 * kBox, kDyBytes = 4 * kBox;
constexpr int kStageBytes = kXBytes + kDyBytes;  // 64 KB
constexpr int kXtOff = kStages * kStageBytes;    // xT [256 k][64 t]: 128 bytes per k row
constexpr int kXtBytes = kBK * kBT * 2;
constexpr int kBarOff = kXtOff + kXtBytes;
constexpr int kSmem = kBarOff + 64 + 1024;       // + barriers + alignment slack

struct Params {
  const uint8_t* cols;   // [R/64, G, 4]
  const uint32_t* meta;  // [R, G/8]
  float* partial;        // [S, R, 2G]
  int tokens, k, rows, groups, kt_per_split;
};

// 16-byte chunk position of chunk j of xT row k.
__device__ __forceinline__ int XtChunk(int k, int j) { return j ^ ((k ^ (k >> 2)) & 7); }
// Inside each 16-token step of an xT row, token t sits at slot 4 ((t % 8) / 2) + 2 (t / 8) + t % 2: a thread's
// 4 tokens 2c, 2c+1, 2c+8, 2c+9 are the adjacent slots 4c .. 4c+3 (the transpose pass writes that order).

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// kMode: 0 the whole kernel; 1 without the transpose pass (xT holds whatever it holds: timing only); 2 without the
// gathers and products (timing only).  Modes 1 and 2 split the time of one stage between its two halves.
template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) GatherSddmmKernel(const Params p, const __grid_constant__ CUtensorMap tx,
                                                                  const __grid_constant__ CUtensorMap tdy) {
#ifdef JAXSPARSE_WGMMA
  using namespace jaxsparse;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = SmemAddr(smem);
  const uint32_t bar0 = base + kBarOff;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int r0 = blockIdx.x * kBR, g0 = blockIdx.y * kGC, k0 = g0 * kM;
  const int all_kt = (p.tokens + kBT - 1) / kBT;
  const int kt_begin = blockIdx.z * p.kt_per_split;
  const int num_kt = max(min(all_kt - kt_begin, p.kt_per_split), 0);

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) MbarInit(bar0 + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int i) {  // stage i of this CTA's range into slot i % kStages
    const int s = i % kStages, t = (kt_begin + i) * kBT;
    const uint32_t slot = base + s * kStageBytes, bar = bar0 + 8 * s;
    MbarArriveExpectTx(bar, kStageBytes);
    for (int b = 0; b < 4; ++b) TmaLoad2d(slot + b * kBox, &tx, k0 + 64 * b, t, bar);
    for (int b = 0; b < 4; ++b) TmaLoad2d(slot + kXBytes + b * kBox, &tdy, r0 + 64 * b, t, bar);
  };
  if (tid == 0)
    for (int i = 0; i < kStages - 1 && i < num_kt; ++i) issue(i);

  // Each thread's gather rows: kept column m (0..127 of a V block) of its two A rows per k16 step.
  const int m_lo = 64 * wg + 16 * (warp & 3) + (lane >> 2), m_hi = m_lo + 8;
  const int c = lane & 3;
  float acc[kVB][32];
#pragma unroll
  for (int b = 0; b < kVB; ++b)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[b][i] = 0.f;
  // xT row (real column, 0..255) of kept column m of V block b.
  auto xt_row = [&](int b, int m) {
    const int g = m >> 2;
    return g * kM + p.cols[(static_cast<int64_t>((r0 >> 6) + b) * p.groups + g0 + g) * 4 + (m & 3)];
  };
  int rows_lo[kVB], rows_hi[kVB];
#pragma unroll
  for (int b = 0; b < kVB; ++b) rows_lo[b] = xt_row(b, m_lo), rows_hi[b] = xt_row(b, m_hi);

  unsigned char* xt = smem + kXtOff;
  for (int i = 0; i < num_kt; ++i) {
    const int s = i % kStages;
    MbarWait(bar0 + 8 * s, (i / kStages) & 1);
    __syncthreads();  // every warp is done reading xT of stage i - 1
    if (kMode != 1) {
      // Transpose: warp w takes 4-column chunk q = 32 (w % 2) + lane of x and 16-token step w / 2.
      const int q = 32 * (warp & 1) + lane, step = warp >> 1;
      const unsigned char* xs = smem + s * kStageBytes + (q >> 4) * kBox;  // box of columns 64 (q / 16) ..
      const int kk = (q & 15) * 4;                                          // first column inside the box
      uint2 v[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const int tt = 16 * step + t;
        v[t] = *reinterpret_cast<const uint2*>(xs + tt * 128 + ((((kk >> 3) ^ (tt & 7))) << 4) + (kk & 7) * 2);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * q + j;  // xT row
        uint32_t w[8];            // token pairs in slot order: (0,1) (8,9) (2,3) (10,11) ...
#pragma unroll
        for (int cc = 0; cc < 4; ++cc)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int t = 8 * hi + 2 * cc;
            const uint32_t a = (j < 2) ? v[t].x : v[t].y, b = (j < 2) ? v[t + 1].x : v[t + 1].y;
            w[2 * cc + hi] = __byte_perm(a, b, (j & 1) ? 0x7632 : 0x5410);
          }
        unsigned char* row = xt + k * 128;
        *reinterpret_cast<uint4*>(row + (XtChunk(k, 2 * step) << 4)) = make_uint4(w[0], w[1], w[2], w[3]);
        *reinterpret_cast<uint4*>(row + (XtChunk(k, 2 * step + 1) << 4)) = make_uint4(w[4], w[5], w[6], w[7]);
      }
    }
    __syncthreads();  // xT of stage i is complete; slot (i - 1) % kStages is free
    if (tid == 0 && i + kStages - 1 < num_kt) issue(i + kStages - 1);
    if (kMode == 2) continue;
    // A fragments of all 16 products first (the registers a wgmma reads must be written before the fence).
    uint32_t a[kVB][4][4];
#pragma unroll
    for (int b = 0; b < kVB; ++b)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        // Token slots 4c .. 4c+3 of step ks: chunk 2 ks + c / 2, byte 8 (c % 2).
        const uint2 lo = *reinterpret_cast<const uint2*>(xt + rows_lo[b] * 128 + (XtChunk(rows_lo[b], 2 * ks + (c >> 1)) << 4) + (c & 1) * 8);
        const uint2 hi = *reinterpret_cast<const uint2*>(xt + rows_hi[b] * 128 + (XtChunk(rows_hi[b], 2 * ks + (c >> 1)) << 4) + (c & 1) * 8);
        a[b][ks][0] = lo.x, a[b][ks][1] = hi.x, a[b][ks][2] = lo.y, a[b][ks][3] = hi.y;
      }
    WgmmaFence();
#pragma unroll
    for (int b = 0; b < kVB; ++b)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint32_t dy_box = base + s * kStageBytes + kXBytes + b * kBox + ks * 2048;
        WgmmaRs<64, __nv_bfloat16, 1>::Run(acc[b], a[b][ks], WgmmaDescSw128(dy_box, 8192, 1024));
      }
    WgmmaCommit();
    WgmmaWait<0>();
#pragma unroll
    for (int b = 0; b < kVB; ++b) WgmmaFenceOperands(acc[b]);
  }

  // Epilogue: accumulator i of V block b is (kept column m, row r) with m = 64 wg + 16 (warp % 4) +
  // (lane / 4) + 8 ((i / 2) % 2) and r = 8 (i / 4) + 2 (lane % 4) + i % 2.
  const int64_t plane = static_cast<int64_t>(p.rows) * 2 * p.groups;
  float* out = p.partial + blockIdx.z * plane;
#pragma unroll
  for (int b = 0; b < kVB; ++b)
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int m = 64 * wg + 16 * (warp & 3) + (lane >> 2) + 8 * ((i >> 1) & 1);
      const int row = r0 + 64 * b + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      const int g = g0 + (m >> 2);
      const uint32_t nib = (p.meta[static_cast<int64_t>(row) * (p.groups / 8) + g / 8] >> (4 * (g % 8))) & 0xFu;
      const int pos = m & 3;
      if (pos == static_cast<int>(nib & 3u)) out[static_cast<int64_t>(row) * 2 * p.groups + 2 * g] = acc[b][i];
      if (pos == static_cast<int>(nib >> 2)) out[static_cast<int64_t>(row) * 2 * p.groups + 2 * g + 1] = acc[b][i];
    }
#endif
}

__global__ void ReduceKernel(const float* partial, float* out, int64_t n, int splits) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int z = 0; z < splits; ++z) s += partial[z * n + i];
    out[i] = s;
  }
}

// One shape: returns false when the check fails.
bool RunShape(int tokens, int k, int rows, int splits, bool first) {
  const int groups = k / kM;
  std::mt19937 rng(1234 + k + rows);
  std::normal_distribution<float> nd;
  std::vector<__nv_bfloat16> hx(static_cast<size_t>(tokens) * k), hdy(static_cast<size_t>(tokens) * rows);
  for (auto& e : hx) e = __float2bfloat16(nd(rng));
  for (auto& e : hdy) e = __float2bfloat16(nd(rng));
  std::vector<uint8_t> hcols(static_cast<size_t>(rows / kV) * groups * 4);
  for (size_t i = 0; i < hcols.size() / 4; ++i) {
    int pick[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    std::shuffle(pick, pick + 8, rng);
    std::sort(pick, pick + 4);
    for (int j = 0; j < 4; ++j) hcols[4 * i + j] = static_cast<uint8_t>(pick[j]);
  }
  std::vector<uint32_t> hmeta(static_cast<size_t>(rows) * groups / 8, 0);
  const int pairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      const int* pr = pairs[rng() % 6];
      hmeta[static_cast<size_t>(r) * (groups / 8) + g / 8] |= static_cast<uint32_t>(pr[0] | (pr[1] << 2)) << (4 * (g % 8));
    }

  __nv_bfloat16 *dx, *ddy;
  uint8_t* dcols;
  uint32_t* dmeta;
  float *dpart, *dout;
  const int64_t n = static_cast<int64_t>(rows) * 2 * groups;
  PROBE_CHECK(cudaMalloc(&dx, hx.size() * 2));
  PROBE_CHECK(cudaMalloc(&ddy, hdy.size() * 2));
  PROBE_CHECK(cudaMalloc(&dcols, hcols.size()));
  PROBE_CHECK(cudaMalloc(&dmeta, hmeta.size() * 4));
  PROBE_CHECK(cudaMalloc(&dpart, splits * n * 4));
  PROBE_CHECK(cudaMalloc(&dout, n * 4));
  PROBE_CHECK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(ddy, hdy.data(), hdy.size() * 2, cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(dcols, hcols.data(), hcols.size(), cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(dmeta, hmeta.data(), hmeta.size() * 4, cudaMemcpyHostToDevice));

  CUtensorMap tx{}, tdy{};
  if (!jaxsparse::MakeTensorMap2d(&tx, dx, tokens, k, kBT) || !jaxsparse::MakeTensorMap2d(&tdy, ddy, tokens, rows, kBT)) {
    std::fprintf(stderr, "tensor map failed\n");
    std::exit(1);
  }
  Params p{dcols, dmeta, dpart, tokens, k, rows, groups, 0};
  const int all_kt = (tokens + kBT - 1) / kBT;
  p.kt_per_split = (all_kt + splits - 1) / splits;
  PROBE_CHECK(cudaFuncSetAttribute(GatherSddmmKernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  PROBE_CHECK(cudaFuncSetAttribute(GatherSddmmKernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  PROBE_CHECK(cudaFuncSetAttribute(GatherSddmmKernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const dim3 grid(rows / kBR, groups / kGC, splits);
  auto reduce = [&]() { ReduceKernel<<<4 * 132, 256>>>(dpart, dout, n, splits); };
  auto launch = [&]() {
    GatherSddmmKernel<0><<<grid, kThreads, kSmem>>>(p, tx, tdy);
    reduce();
  };
  // Poisoned outputs: NaN everywhere, so an entry the kernel never writes fails the check.
  PROBE_CHECK(cudaMemset(dpart, 0xFF, splits * n * 4));
  PROBE_CHECK(cudaMemset(dout, 0xFF, n * 4));
  launch();
  PROBE_CHECK(cudaGetLastError());
  PROBE_CHECK(cudaDeviceSynchronize());
  std::vector<float> hout(n);
  PROBE_CHECK(cudaMemcpy(hout.data(), dout, n * 4, cudaMemcpyDeviceToHost));
  // Check 4096 random entries against a float64 reference; NaN never passes.
  double err2 = 0, ref2 = 0;
  int nan = 0, shown = 0;
  for (int s = 0; s < 4096; ++s) {
    const int r = rng() % rows, g = rng() % groups, j = rng() % 2;
    const uint32_t nib = (hmeta[static_cast<size_t>(r) * (groups / 8) + g / 8] >> (4 * (g % 8))) & 0xFu;
    const int pos = j ? (nib >> 2) : (nib & 3);
    const int col = g * kM + hcols[(static_cast<size_t>(r / kV) * groups + g) * 4 + pos];
    double ref = 0;
    for (int t = 0; t < tokens; ++t)
      ref += double(__bfloat162float(hx[static_cast<size_t>(t) * k + col])) * __bfloat162float(hdy[static_cast<size_t>(t) * rows + r]);
    const double got = hout[static_cast<size_t>(r) * 2 * groups + 2 * g + j];
    if (!std::isfinite(got)) ++nan;
    if (!(std::fabs(got - ref) <= 1e-3 * (std::fabs(ref) + 1.0)) && shown < 6) {
      // Diagnose: which real column of the group (if any) the kernel's value belongs to.
      int match = -1;
      for (int cc = 0; cc < kM && match < 0; ++cc) {
        double alt = 0;
        for (int t = 0; t < tokens; ++t)
          alt += double(__bfloat162float(hx[static_cast<size_t>(t) * k + g * kM + cc])) *
                 __bfloat162float(hdy[static_cast<size_t>(t) * rows + r]);
        if (std::fabs(alt - got) <= 1e-3 * (std::fabs(alt) + 1.0)) match = cc;
      }
      std::fprintf(stderr, "K=%d R=%d mismatch r=%d g=%d j=%d col=%d ref=%.4f got=%.4f (got is column %d of the group)\n",
                   k, rows, r, g, j, col - g * kM, ref, got, match);
      ++shown;
    }
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
  }
  const double rel = std::sqrt(err2 / ref2);
  const bool ok = nan == 0 && rel < 1e-3;  // float32 accumulation of exact bf16 products

  // Timing: the kernel + its reduce, and cuBLAS's dense dW = x^T dy (bf16 in, float32 accumulation, bf16 out)
  // in the same process; median of 50 back-to-back launches after 10 warm-up launches, CUDA events.
  auto time_it = [&](auto fn) { return probe_timing::MedianEventMs(fn, fn, 50); };
  const float ms = time_it(launch);
  const float kernel_ms = time_it([&]() { GatherSddmmKernel<0><<<grid, kThreads, kSmem>>>(p, tx, tdy); });
  const float no_transpose_ms = time_it([&]() { GatherSddmmKernel<1><<<grid, kThreads, kSmem>>>(p, tx, tdy); });
  const float no_products_ms = time_it([&]() { GatherSddmmKernel<2><<<grid, kThreads, kSmem>>>(p, tx, tdy); });
  const float reduce_ms = time_it(reduce);
  float dense_ms = -1.f;  // printed as null when the build has no cuBLAS
#ifdef PROBE_CUBLAS
  cublasHandle_t h;
  cublasCreate(&h);
  __nv_bfloat16* ddw;
  PROBE_CHECK(cudaMalloc(&ddw, static_cast<size_t>(k) * rows * 2));
  const float one = 1.f, zero = 0.f;
  // Column-major view: dW^T [rows x k] = dy^T [rows x T] * x [T x k]; dy (row-major [T, rows]) is dy^T col-major.
  auto dense = [&]() {
    return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, rows, k, tokens, &one, ddy, CUDA_R_16BF, rows, dx, CUDA_R_16BF, k,
                        &zero, ddw, CUDA_R_16BF, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  if (dense() != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasGemmEx failed\n");
    std::exit(1);
  }
  dense_ms = time_it(dense);
  cublasDestroy(h);
  cudaFree(ddw);
#endif
  PROBE_CHECK(cudaGetLastError());
  // Floor of the condensed product: x and dy read once, the values written once (float32 here).
  const double bytes = 2.0 * tokens * (k + rows) + 4.0 * n;
  std::printf("%s{\"T\": %d, \"K\": %d, \"R\": %d, \"spec\": \"64:2:8\", \"splits\": %d, \"rel_err\": %.3e, "
              "\"nan\": %d, \"ok\": %s, \"ms\": %.4f, \"kernel_ms\": %.4f, \"no_transpose_ms\": %.4f, "
              "\"no_products_ms\": %.4f, \"reduce_ms\": %.4f, \"dense_dw_cublas_ms\": %.4f, "
              "\"floor_ms_at_3.35TBps\": %.4f}",
              first ? "" : ",\n", tokens, k, rows, splits, rel, nan, ok ? "true" : "false", ms, kernel_ms,
              no_transpose_ms, no_products_ms, reduce_ms, dense_ms,
              bytes / 3.35e12 * 1e3);
  cudaFree(dx), cudaFree(ddy), cudaFree(dcols), cudaFree(dmeta), cudaFree(dpart), cudaFree(dout);
  return ok;
}

}  // namespace probe

int main() {
  std::printf("{\"probe\": \"sddmm_gather\", \"results\": [\n");
  bool ok = probe::RunShape(16384, 1024, 4096, 2, true);
  ok = probe::RunShape(16384, 4096, 1024, 2, false) && ok;
  ok = probe::RunShape(16384, 1024, 1024, 8, false) && ok;
  ok = probe::RunShape(1000, 1024, 1024, 1, false) && ok;  // a token tail (1000 % 64 != 0)
  std::printf("\n]}\n");
  return ok ? 0 : 1;
}

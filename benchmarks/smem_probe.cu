// Probe: does shared-memory bandwidth cap the sparse tensor cores on an H100?  (docs/kernel-notes.md, session 12.)
//
// One CTA per SM.  Two consumer warpgroups issue wgmma back to back from shared memory -- dense m64n256k16 or
// sparse m64n256k32 (wgmma.sp, A 2:4-compressed) -- over the same 64-deep K tile: per iteration and warpgroup
// 64 x 256 x 64 dense-equivalent multiply-adds, reading 40 KB (dense: A 8 KB + B 32 KB) or 36 KB (sparse: A 4 KB
// compressed + B 32 KB) of operands.  Four more warps can stream 16-byte shared-memory loads (conflict-free) while
// the consumers run ("noise").  Rates are per SM and per cycle (clock64), so they do not depend on the clock:
//   * MAC/clk: dense-equivalent multiply-adds per cycle (the H100's dense bf16 peak is ~2048, sparse ~4096);
//   * operand B/clk: the bytes of A and B the wgmma instructions name, per cycle;
//   * noise B/clk: the bytes the noise warps loaded per cycle while the consumers ran.
// The operands hold finite bf16 values; nothing is checked (timing only).
//   bash benchmarks/smem_probe.sh      # nvcc (sm_90a), runs it, prints the JSON and a table
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_timing.cuh"
#include "wgmma.cuh"

namespace probe {

constexpr int kN = 256;
constexpr int kAOff = 0;                   // dense A: 64 rows x 64 k, K-major, 128-byte swizzle: 8 KB
constexpr int kBOff = 8192;                // B: 64 k x 256 n, MN-major, 128-byte swizzle, 4 columns of 8 KB
constexpr int kBCol = 64 * 128;            // LBO: one 64-wide column of atoms, 64 k rows
constexpr int kNoiseOff = kBOff + 4 * kBCol;  // 32 KB streamed by the noise warps
constexpr int kNoiseBytes = 32768;
constexpr int kFlagOff = kNoiseOff + kNoiseBytes;
constexpr int kSmem = kFlagOff + 16 + 1024;
constexpr int kThreads = 384;              // warps 0-7: two consumer warpgroups; warps 8-11: noise

struct Out {
  unsigned long long mma_cycles, noise_cycles, noise_loads;
  float sink;
};

// kSparse: 0 dense (SS), 1 sparse with A from shared memory (SS), 2 sparse with A from registers (RS).
// kWgs: how many of the two consumer warpgroups issue products (1: warps 4-7 leave at once, so one warpgroup's
// products run alone, as in a staggered schedule while the other warpgroup is in its epilogue).
template <int kSparse, bool kMma, bool kNoise, int kWgs = 2>
__global__ void __launch_bounds__(kThreads, 1) RateKernel(int iters, int noise_only_loads, Out* out) {
#ifdef JAXSPARSE_WGMMA
  using namespace jaxsparse;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x, warp = tid >> 5;
  // Finite bf16 values everywhere (exponent near 0): 0x3Fxx / 0x3Exx patterns from a hash of the word index.
  for (int i = tid; i < kFlagOff / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(smem)[i] = ((i * 2654435761u) & 0x007F007Fu) | 0x3E803E80u;
  volatile int* done = reinterpret_cast<volatile int*>(smem + kFlagOff);
  if (tid == 0) *done = 0;
  FenceProxyAsyncShared();
  __syncthreads();

  if (warp < 8) {
    if (!kMma || warp >= 4 * kWgs) return;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const uint64_t b0 = WgmmaDescSw128(base + kBOff, kBCol, 1024);
    const uint32_t meta = 0x44444444u;  // every group keeps its elements 0 and 1
    uint32_t a_regs[2][4];                // RS form: two k32 steps of A fragments (finite bf16 values)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j) a_regs[ks][j] = (((tid + 7 * j + 3 * ks) * 2654435761u) & 0x007F007Fu) | 0x3E803E80u;
    const unsigned long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
      WgmmaFenceOperands(acc);
      WgmmaFence();
      if (kSparse == 2) {
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) WgmmaSpRs<kN, __nv_bfloat16, 1>::Run(acc, a_regs[ks], b0 + ((4096 * ks) >> 4), meta);
      } else if (kSparse == 1) {
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)  // two k32 steps: A rows of 32 stored values, 64-byte swizzle (4 KB)
          WgmmaSp<kN, __nv_bfloat16, 1>::Run(acc, WgmmaDescSw64K(base + kAOff + 32 * ks, 512), b0 + ((4096 * ks) >> 4), meta);
      } else {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)  // four k16 steps: 32 bytes along A's 128-byte rows, 2 KB down B
          Wgmma<kN, __nv_bfloat16, 1, 0>::Run(acc, WgmmaDescSw128(base + kAOff + 32 * ks, 16, 1024), b0 + ((2048 * ks) >> 4));
      }
      WgmmaCommit();
      WgmmaWait<1>();
      WgmmaFenceOperands(acc);
    }
    WgmmaWait<0>();
    WgmmaFenceOperands(acc);
    const unsigned long long t1 = clock64();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) s += acc[i];
    if (tid == 0) {
      out[blockIdx.x].mma_cycles = t1 - t0;
      out[blockIdx.x].sink = s;
      *done = 1;
    }
    return;
  }
  if (!kNoise) return;
  // Noise: each warp reads consecutive 512-byte lines (16 bytes per lane) of the 32 KB region, round and round.
  const int lane = tid & 31, nw = warp - 8;
  const uint4* src = reinterpret_cast<const uint4*>(smem + kNoiseOff);
  uint4 x = make_uint4(0, 0, 0, 0);
  unsigned long long loads = 0;
  const unsigned long long t0 = clock64();
  for (int j = nw;; j += 64) {
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const uint4 v = src[((j + 4 * u) % 64) * 32 + lane];
      x.x ^= v.x, x.y ^= v.y, x.z ^= v.z, x.w ^= v.w;
    }
    loads += 16;
    if (kMma ? *done != 0 : loads >= static_cast<unsigned long long>(noise_only_loads)) break;
  }
  const unsigned long long t1 = clock64();
  if (lane == 0 && nw == 0) {
    out[blockIdx.x].noise_cycles = t1 - t0;
    out[blockIdx.x].noise_loads = loads * 4;  // warp-wide 512-byte loads of the 4 noise warps (warp 8's count)
    if ((x.x ^ x.y ^ x.z ^ x.w) == 0x12345678u) out[blockIdx.x].sink += 1.f;
  }
#endif
}

template <int kSparse, bool kMma, bool kNoise, int kWgs = 2>
void Run(const char* name, int sms, int iters, bool first) {
  auto kernel = RateKernel<kSparse, kMma, kNoise, kWgs>;
  PROBE_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  Out* d_out;
  PROBE_CHECK(cudaMalloc(&d_out, sms * sizeof(Out)));
  PROBE_CHECK(cudaMemset(d_out, 0, sms * sizeof(Out)));
  const int noise_only = 16 * 4096;
  auto launch = [&]() { kernel<<<sms, kThreads, kSmem>>>(iters, noise_only, d_out); };
  const float ms = probe_timing::MedianEventMs(launch, launch, 20);
  PROBE_CHECK(cudaGetLastError());
  std::vector<Out> h(sms);
  PROBE_CHECK(cudaMemcpy(h.data(), d_out, sms * sizeof(Out), cudaMemcpyDeviceToHost));
  std::vector<double> mac, opb, nb;
  double cyc = 0;
  for (const Out& o : h) {
    if (kMma) {
      const double per_iter_macs = kWgs * 64.0 * kN * 64;  // every issuing warpgroup
      mac.push_back(per_iter_macs * iters / o.mma_cycles);
      // Operand bytes per iteration and warpgroup: A (shared only: 8 KB dense, 4 KB sparse SS) + B 32 KB.
      opb.push_back(kWgs * (kSparse == 2 ? 32768.0 : kSparse == 1 ? 36864.0 : 40960.0) * iters / o.mma_cycles);
      cyc += static_cast<double>(o.mma_cycles) / sms;
    }
    if (kNoise) {
      const double c = kMma ? static_cast<double>(o.mma_cycles) : static_cast<double>(o.noise_cycles);
      nb.push_back(512.0 * o.noise_loads / c);
      if (!kMma) cyc += static_cast<double>(o.noise_cycles) / sms;
    }
  }
  auto med = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%s{\"mode\": \"%s\", \"ms\": %.4f, \"mean_cycles\": %.0f, \"clock_GHz\": %.3f, \"mac_per_clk_per_sm\": %.1f, "
              "\"operand_bytes_per_clk_per_sm\": %.1f, \"noise_bytes_per_clk_per_sm\": %.1f}",
              first ? "" : ",\n", name, ms, cyc, cyc / (ms * 1e6), med(mac), med(opb), med(nb));
  cudaFree(d_out);
}

}  // namespace probe

int main() {
  int sms = 0;
  PROBE_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int iters = 4096;
  std::printf("{\"probe\": \"smem_rate\", \"sms\": %d, \"iters\": %d, \"results\": [\n", sms, iters);
  probe::Run<0, true, false>("dense wgmma m64n256k16", sms, iters, true);
  probe::Run<1, true, false>("sparse wgmma.sp m64n256k32", sms, iters, false);
  probe::Run<2, true, false>("sparse RS (A in registers)", sms, iters, false);
  probe::Run<0, false, true>("noise loads alone", sms, iters, false);
  probe::Run<0, true, true>("dense + noise", sms, iters, false);
  probe::Run<1, true, true>("sparse + noise", sms, iters, false);
  probe::Run<2, true, true>("sparse RS + noise", sms, iters, false);
  probe::Run<0, true, false, 1>("dense, one warpgroup", sms, iters, false);
  probe::Run<1, true, false, 1>("sparse, one warpgroup", sms, iters, false);
  probe::Run<1, true, true, 1>("sparse, one warpgroup + noise", sms, iters, false);
  std::printf("\n]}\n");
  return 0;
}

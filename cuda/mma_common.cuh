// Device helpers shared by the tensor-core kernels (spmm.cu, spmm_xt.cu, sddmm.cu, spmm_t.cu): cp.async, ldmatrix,
// dense and sparse mma.sync, dtype conversions, the forward epilogue (bias, GELU, staged stores), and the SM
// count.  Everything here is inline PTX of
// sm_80-level instructions, valid on sm_80 and sm_90a.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jaxsparse {

// Clears an MMA accumulator tile held in registers (all indices compile-time: unrolled).
template <int MI, int NI>
__device__ __forceinline__ void ZeroAccumulators(float (&acc)[MI][NI][4]) {
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory `raw` rounded up to a 1024-byte boundary (a 128-byte swizzle atom; launches ask
// for 1024 bytes more than they use): its generic pointer and its shared-window address.
struct AlignedSmem {
  unsigned char* ptr;
  uint32_t addr;
};
__device__ __forceinline__ AlignedSmem AlignSmem1024(unsigned char* raw) {
  const uint32_t raw_addr = SmemAddr(raw);
  const uint32_t pad = ((raw_addr + 1023u) & ~1023u) - raw_addr;
  return {raw + pad, raw_addr + pad};
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (token tails).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// 4-byte async copy; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void CpAsync4Zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Transposing variant: lane i receives, of each 8x8 matrix stored row-major at the 8 row addresses,
// the elements (row 2*(i%4), column i/4) and (row 2*(i%4)+1, column i/4).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Sparse m16n8k32 (2:4 along k of A, ordered metadata, sparsity selector 0), fp32 accumulation.
template <typename T>
struct MmaSp;

template <>
struct MmaSp<__nv_bfloat16> {
  __device__ __forceinline__ static void Run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                             uint32_t e) {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  }
};

template <>
struct MmaSp<__half> {
  __device__ __forceinline__ static void Run(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[4],
                                             uint32_t e) {
    asm volatile(
        "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, 0x0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(e));
  }
};

// Dense m16n8k16, fp32 accumulation.  Fragments (gid = lane / 4, tig = lane % 4):
//   a0 (row gid, k 2tig..+1), a1 (row gid+8, k 2tig..), a2 (row gid, k 2tig+8..), a3 (row gid+8, k 2tig+8..);
//   b0 (k 2tig..+1, col gid), b1 (k 2tig+8.., col gid);
//   d0, d1 (row gid, cols 2tig, 2tig+1), d2, d3 (row gid+8, same cols).
template <typename T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma<__half> {
  __device__ __forceinline__ static void Run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// The per-thread metadata operand of mma.sp m16n8k32 and, per warp, of wgmma.sp m64nNk32 (16-bit types,
// sparsity selector 0) from the two stored row words of rows gid and gid + 8 (stored word = 8 groups of one row, group j in bits 4j..4j+3).
//   mode 0: thread 4*gid + 0 holds groups 0-3 of row gid (bits 0-15) and of row gid+8 (bits 16-31),
//           thread 4*gid + 1 holds groups 4-7 of the two rows likewise;
//   mode 1: thread 4*gid + 0 holds row gid whole, thread 4*gid + 1 row gid + 8 whole.
// Threads 2 and 3 of a quad mirror 0 and 1 (they are not read with selector 0).
__device__ __forceinline__ uint32_t MetaWord(uint32_t w_lo_row, uint32_t w_hi_row, int tig, int mode) {
  if (mode == 0) return (tig & 1) ? __byte_perm(w_lo_row, w_hi_row, 0x7632) : __byte_perm(w_lo_row, w_hi_row, 0x5410);
  return (tig & 1) ? w_hi_row : w_lo_row;
}

__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
// GELU, tanh approximation (the same function as jax.nn.gelu(approximate=True)): 0.5 x (1 + tanh(u)),
// u = k0 (x + k1 x^3).
constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;
__device__ __forceinline__ float GeluTanhU(float x) { return kGeluK0 * (x + kGeluK1 * x * x * x); }
__device__ __forceinline__ float GeluTanh(float x) { return 0.5f * x * (1.f + tanhf(GeluTanhU(x))); }

// Phi(x), the standard normal CDF: the exact GELU is x Phi(x).
__device__ __forceinline__ float NormalCdf(float x) { return 0.5f * (1.f + erff(x * 0.7071067811865476f)); }

// The epilogue activations, by the handlers' `activation` attribute (jaxsparse/reference.py ACTIVATIONS names them):
// 0 none, 1 gelu (tanh approximation), 2 gelu_erf (exact: x Phi(x)), 3 relu.
__device__ __forceinline__ float Activate(int act, float x) {
  switch (act) {
    case 1: return GeluTanh(x);
    case 2: return x * NormalCdf(x);
    case 3: return x > 0.f ? x : 0.f;
    default: return x;
  }
}

// act(x) and its derivative act'(x) together (the tanh and the CDF computed once for both).
__device__ __forceinline__ void ActivateWithGrad(int act, float x, float& f, float& df) {
  switch (act) {
    case 1: {
      const float th = tanhf(GeluTanhU(x));
      f = 0.5f * x * (1.f + th);
      df = 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * kGeluK0 * (1.f + 3.f * kGeluK1 * x * x);
      return;
    }
    case 2: {  // Phi(x) + x phi(x)
      const float cdf = NormalCdf(x);
      f = x * cdf;
      df = cdf + x * 0.3989422804014327f * __expf(-0.5f * x * x);
      return;
    }
    case 3:
      f = x > 0.f ? x : 0.f;
      df = x > 0.f ? 1.f : 0.f;
      return;
    default:
      f = x;
      df = 1.f;
  }
}

// The bias of output feature `row` as float: 0 without a bias, else read in the input dtype T or float32.
template <typename T>
__device__ __forceinline__ float BiasAt(const void* bias, int bias_f32, int row) {
  if (bias == nullptr) return 0.f;
  return bias_f32 ? static_cast<const float*>(bias)[row] : ToFloat(static_cast<const T*>(bias)[row]);
}

// What a staged tile's store does besides copying it to y (StoreStagedTile): with `y2`, write act(tile) to y and
// act'(tile) to y2 (the tile holds a pre-activation).
struct StagedExtra {
  void* y2 = nullptr;
  int activation = 0;
};

// Writes an output tile staged in shared memory as [BT tokens][BR features] (token rows `row_bytes` apart)
// to y [tokens, rows] at (tok0, row0) with 16-byte stores (and `extra`'s stores at the same places); tokens past
// `tokens` are skipped.  Called by the THREADS threads numbered `thread` = 0..THREADS-1 after the
// barrier that follows the staging.
template <typename T, int BT, int BR, int THREADS>
__device__ __forceinline__ void StoreStagedTile(const unsigned char* tile, int row_bytes, T* __restrict__ y, int tokens,
                                                int rows, int tok0, int row0, int thread,
                                                const StagedExtra& extra = StagedExtra{}) {
  constexpr int kChunks = BR / 8;  // 16-byte chunks per token row of the tile
  constexpr int kTotal = BT * kChunks;
  auto at = [&](int i) { return static_cast<int64_t>(tok0 + i / kChunks) * rows + row0 + (i % kChunks) * 8; };
  auto staged = [&](int i) { return *reinterpret_cast<const uint4*>(tile + (i / kChunks) * row_bytes + (i % kChunks) * 16); };
  for (int i = thread; i < kTotal; i += THREADS) {
    if (tok0 + i / kChunks < tokens) {
      uint4 v4 = staged(i);
      if (extra.y2 != nullptr) {
        uint4 d4;
        T* h = reinterpret_cast<T*>(&v4);
        T* d = reinterpret_cast<T*>(&d4);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float f, df;
          ActivateWithGrad(extra.activation, ToFloat(h[j]), f, df);
          h[j] = FromFloat<T>(f);
          d[j] = FromFloat<T>(df);
        }
        *reinterpret_cast<uint4*>(static_cast<T*>(extra.y2) + at(i)) = d4;
      }
      *reinterpret_cast<uint4*>(y + at(i)) = v4;
    }
  }
}

// Two floats as one 32-bit word of two 16-bit values (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  const T a = FromFloat<T>(lo), b = FromFloat<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&a)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&b)) << 16);
}

// Multiprocessors of the current device (132 when it cannot be read).
inline int SmCount() {
  static int count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 132;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
    return n;
  }();
  return count;
}

}  // namespace jaxsparse

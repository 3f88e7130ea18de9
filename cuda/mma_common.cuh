// Device helpers shared by the tensor-core kernels (spmm.cu, spmm_xt.cu, sddmm.cu, spmm_t.cu): cp.async, ldmatrix,
// dense and sparse mma.sync, dtype conversions, the forward epilogue (bias, GELU, staged stores), and the SM
// count.  Everything here is inline PTX of
// sm_80-level instructions, valid on sm_80 and sm_90a.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
// a * b as a 64-bit product of two 32-bit ints: one mul.wide.s32, where a product of two sign-extended int64s can
// compile to a full 64-bit multiply.
__device__ __forceinline__ int64_t MulWide(int a, int b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
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

// The activation table of the bf16 feed-forward epilogues (cuda/act_table.cuh builds it and says why): entry i holds
// act(z) | act'(z) << 16 as bf16 codes for the bf16 code z = ActTableCode(i): 2^-4 <= z < 4 (768 codes), then
// -16 < z <= -2^-4 (1024 codes).
constexpr uint32_t kActTableLo = 0x3D80u;   // |z| = 2^-4
constexpr uint32_t kActTablePos = 0x300u;   // positive codes up to z = 4 (0x4080)
constexpr uint32_t kActTableNeg = 0x400u;   // negative codes down to z = -16 (0xC180)
constexpr int kActTableEntries = static_cast<int>(kActTablePos + kActTableNeg);
constexpr int kActTableBytes = 4 * kActTableEntries;
__host__ __device__ constexpr uint32_t ActTableCode(int i) {
  return i < static_cast<int>(kActTablePos) ? kActTableLo + i : 0x8000u | (kActTableLo + (i - kActTablePos));
}

// act(z) | act'(z) << 16 (bf16 codes) for the bf16 code `code` of z, activation 1 (GELU, tanh) or 2 (GELU, erf),
// from `table` (that activation's, in shared memory) where z is in it; elsewhere: |z| < 2^-4 by Taylor polynomials
// in float32 (through z^4 for act, z^3 for act'), z >= 4 gives (z, 1), z <= -16 (-0, 0), NaN and infinities (NaN,
// NaN).  Each of these is the correctly rounded bf16 of the exact function on its whole range (cuda/act_table.cuh).
// Branch-free: the table is read at index 0 where it is not used.
__device__ __forceinline__ uint32_t ActGradBf16(const uint32_t* table, uint32_t code, int activation) {
  const uint32_t mag = code & 0x7FFFu;
  const bool neg = (code & 0x8000u) != 0;
  const uint32_t off = mag - kActTableLo;  // wraps below the table
  const bool in = off < (neg ? kActTableNeg : kActTablePos);
  const uint32_t word = table[in ? off + (neg ? kActTablePos : 0u) : 0u];
  const float z = __uint_as_float(code << 16), z2 = z * z;
  // act(z) = z/2 + z^2/sqrt(2 pi) + c4 z^4, act'(z) = 1/2 + 2 z/sqrt(2 pi) + c3 z^3 (c4 = -1/(6 sqrt(2 pi)) for the
  // erf GELU; (k0 k1 - k0^3/3)/2 for the tanh one, k0 = sqrt(2/pi), k1 = 0.044715; c3 = 4 c4)
  const float c4 = activation == 1 ? -0.06681995f : -0.06649038f;
  const float f = z * (0.5f + z * (0.39894228f + c4 * z2));
  const float df = 0.5f + z * (0.79788456f + 4.f * c4 * z2);
  const __nv_bfloat162 pair = __floats2bfloat162_rn(f, df);  // .x (low half) = f
  uint32_t other = mag < kActTableLo ? *reinterpret_cast<const uint32_t*>(&pair)
                                     : (neg ? 0x00008000u : (code | 0x3F800000u));
  other = mag >= 0x7F80u ? 0x7FC07FC0u : other;
  return in ? word : other;
}

// What a staged tile's store does besides copying it to y (StoreStagedTile): with `y2`, write act(tile) to y and
// act'(tile) to y2 (the tile holds a pre-activation); with `table` (bf16 only), act and act' come from ActGradBf16.
struct StagedExtra {
  void* y2 = nullptr;
  int activation = 0;
  const uint32_t* table = nullptr;
  // Without y2 only: the tile's features go to y's columns by 64-wide chunks, feature f to column
  // y_chunks[f / 64] * 64 + f % 64 (a diagonal-block weight's input gradient, whose stacked rows are the layer's input
  // features by chunk); null = column f.  Entries outside [0, rows / 64) are clamped (a bad table never writes
  // outside y).
  const int32_t* y_chunks = nullptr;
  // Without y2 and y_chunks only: each stored value is multiplied by the value at the same place of a [BT tokens][BR
  // features] tile of T in shared memory (token rows `mul_row_bytes` apart), in float32 and rounded to T: the
  // backward's dz = dh * act'(z), with act'(z) brought in by the producer's TMA (SpmmWgmmaXtWsKernel); null = none.
  const unsigned char* mul = nullptr;
  int mul_row_bytes = 0;
};

// v4 (8 values of T) times m4 (8 values of T), each product in float32 rounded to T (jaxsparse.ops._times).
template <typename T>
__device__ __forceinline__ void MulChunk(uint4& v4, const uint4& m4) {
  T* h = reinterpret_cast<T*>(&v4);
  const T* m = reinterpret_cast<const T*>(&m4);
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] = FromFloat<T>(ToFloat(h[j]) * ToFloat(m[j]));
}

// act and act' of the 8 bf16 pre-activations in `v4`, from the table: act into v4, act' into d4.
__device__ __forceinline__ void ActGradChunkTable(uint4& v4, uint4& d4, const uint32_t* table, int activation) {
  uint32_t* h = reinterpret_cast<uint32_t*>(&v4);
  uint32_t* d = reinterpret_cast<uint32_t*>(&d4);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = ActGradBf16(table, h[j] & 0xFFFFu, activation);
    const uint32_t hi = ActGradBf16(table, h[j] >> 16, activation);
    h[j] = __byte_perm(lo, hi, 0x5410);  // the two act(z)
    d[j] = __byte_perm(lo, hi, 0x7632);  // the two act'(z)
  }
}

// act and act' of the 8 pre-activations in `v4` (of type T), computed in float32: act into v4, act' into d4.
template <typename T>
__device__ __forceinline__ void ActGradChunkFormula(uint4& v4, uint4& d4, int activation) {
  T* h = reinterpret_cast<T*>(&v4);
  T* d = reinterpret_cast<T*>(&d4);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float f, df;
    ActivateWithGrad(activation, ToFloat(h[j]), f, df);
    h[j] = FromFloat<T>(f);
    d[j] = FromFloat<T>(df);
  }
}

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
  if (extra.y2 == nullptr && extra.y_chunks != nullptr) {
    static_assert(THREADS % kChunks == 0, "each thread stores one column range of the tile");
    // A thread's stores all fall in the tile's column range (thread % kChunks): one table read a tile.
    const int f = row0 + (thread % kChunks) * 8;
    const int col = min(max(__ldg(extra.y_chunks + f / 64), 0), rows / 64 - 1) * 64 + f % 64;
    for (int i = thread; i < kTotal; i += THREADS) {
      if (tok0 + i / kChunks < tokens)
        *reinterpret_cast<uint4*>(y + static_cast<int64_t>(tok0 + i / kChunks) * rows + col) = staged(i);
    }
    return;
  }
  // One loop per kind of extra work, chosen once: a branch inside the loop body keeps the compiler from overlapping
  // one chunk's math with the next (session 30: act_mode 2's staging ran 2.2x slower with the table test inside it).
  // `transform(v4, d4, i)` turns chunk i's staged values into y's (and, with_y2, y2's in d4).
  auto store_all = [&](auto with_y2, auto transform) {
    for (int i = thread; i < kTotal; i += THREADS) {
      if (tok0 + i / kChunks < tokens) {
        uint4 v4 = staged(i), d4;
        transform(v4, d4, i);
        if constexpr (decltype(with_y2)::value) *reinterpret_cast<uint4*>(static_cast<T*>(extra.y2) + at(i)) = d4;
        *reinterpret_cast<uint4*>(y + at(i)) = v4;
      }
    }
  };
  if (extra.mul != nullptr) {  // (no y2: the handler allows mul with act_mode 0 only)
    store_all(std::false_type{}, [&](uint4& v4, uint4&, int i) {
      MulChunk<T>(v4, *reinterpret_cast<const uint4*>(extra.mul + (i / kChunks) * extra.mul_row_bytes + (i % kChunks) * 16));
    });
    return;
  }
  if (extra.y2 == nullptr) {
    store_all(std::false_type{}, [](uint4&, uint4&, int) {});
    return;
  }
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if (extra.table != nullptr) {
      store_all(std::true_type{},
                [&](uint4& v4, uint4& d4, int) { ActGradChunkTable(v4, d4, extra.table, extra.activation); });
      return;
    }
  }
  store_all(std::true_type{}, [&](uint4& v4, uint4& d4, int) { ActGradChunkFormula<T>(v4, d4, extra.activation); });
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

// Hopper warpgroup MMA (wgmma, sm_90a only): shared-memory matrix descriptors, the dense m64nNk16 and the
// sparse m64nNk32 (wgmma.sp, A 2:4-compressed) products with float32 accumulators that jaxsparse uses, the
// mbarrier and TMA helpers of the warp-specialized pipelines.  Everything here compiles to nothing outside an sm_90a device pass
// (JAXSPARSE_WGMMA is defined only there); callers guard their kernel bodies with the same macro.
//
// Layout facts used (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout" and "Matrix
// Descriptor"; checked on an H200 with a bit-exact m64n128k16 test before this file was written):
// * descriptor: bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
//   62-63 swizzle (1 = 128 B); base offset 0 when every 1024-byte swizzle atom is 1024-byte aligned.
// * K-major, 128-byte swizzle, 16-bit elements: row r (an M/N index) holds 64 k in 128 bytes, its 16-byte
//   chunk j stored at chunk j ^ (r % 8); SBO = 1024 (next 8 rows), LBO unused; element (r, k) at
//   r * 128 + (((k / 8) ^ (r % 8)) << 4) + (k % 8) * 2.
// * MN-major, 128-byte swizzle, 16-bit elements: an atom is 8 k-rows of 128 bytes (64 M/N elements), the
//   16-byte chunk j of row k stored at chunk j ^ (k % 8); SBO = bytes to the next 8 k-rows (1024 when the
//   atoms of one 64-wide column are stacked), LBO = bytes to the next 64-wide M/N column of atoms.
//   Element (mn, k) of a column-of-atoms block: k * 128 + (((mn % 64) / 8) ^ (k % 8)) * 16 + (mn % 8) * 2
//   plus (mn / 64) * LBO.  Advancing K by 16 adds 2 * SBO to the start address.
// * wgmma.sp (16-bit types): A's shared-memory tile is the compressed [64 x 16] matrix per k32 step, laid out
//   as a dense K-major operand (here 64-byte swizzled rows of 32 stored values: two k32 steps per row); the
//   metadata operand is one 32-bit register per thread, warp w describing rows 16w .. 16w + 15 exactly as
//   mma.sp.m16n8k32 does (CUTLASS's SM90 sparse GMMA ELayout_64x32 says the same).
// * accumulators of m64nNk16 and m64nNk32 (f32): thread t of the warpgroup, register i < N/2 holds
//   row 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2 * (t % 4) + i % 2.
// * shared memory written by ordinary stores or cp.async must be followed by fence.proxy.async.shared::cta
//   in the writing thread before the barrier that precedes the wgmma reading it.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXSPARSE_WGMMA 1
#endif

namespace jaxsparse {

// Descriptor of a 128-byte-swizzled operand (MN- or K-major) starting at shared address `addr` (its atoms
// 1024-byte aligned; a k step may move `addr` inside a row).
__device__ __forceinline__ uint64_t WgmmaDescSw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Descriptor of a K-major 64-byte-swizzled operand (rows of 32 16-bit values, 8-row atoms of 512 bytes
// 512-byte aligned, SBO = 512 when the rows are packed; LBO unused): the compressed A of wgmma.sp, where one
// k32 step reads 16 stored values (32 bytes) of each row.
__device__ __forceinline__ uint64_t WgmmaDescSw64K(uint32_t addr, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (2ull << 62);
}

// Byte offset of element (r, k) of a K-major 64-byte-swizzled block of rows of 32 k (512-byte-aligned base):
// the 16-byte chunk j of row r stored at chunk j ^ ((r / 2) % 4), as TMA's 64-byte swizzle writes it.
__host__ __device__ constexpr uint32_t Sw64KOffset(int r, int k) {
  return static_cast<uint32_t>(r) * 64 + ((static_cast<uint32_t>(k / 8) ^ (static_cast<uint32_t>(r / 2) % 4)) << 4) +
         static_cast<uint32_t>(k % 8) * 2;
}

// Byte offset of element (r, k) of a K-major 128-byte-swizzled block of rows of 64 k (1024-byte-aligned base).
__host__ __device__ constexpr uint32_t Sw128KOffset(int r, int k) {
  return static_cast<uint32_t>(r) * 128 + ((static_cast<uint32_t>(k / 8) ^ static_cast<uint32_t>(r % 8)) << 4) +
         static_cast<uint32_t>(k % 8) * 2;
}

// Byte offset of element (mn, k) in an MN-major 128-byte-swizzled block of 64-wide M/N columns, each
// column `col_bytes` long (LBO), relative to a 1024-byte-aligned base.
__host__ __device__ constexpr uint32_t Sw128MnOffset(int mn, int k, uint32_t col_bytes) {
  return static_cast<uint32_t>(mn / 64) * col_bytes + static_cast<uint32_t>(k) * 128 +
         ((static_cast<uint32_t>((mn % 64) / 8) ^ static_cast<uint32_t>(k % 8)) << 4) + static_cast<uint32_t>(mn % 8) * 2;
}

// Whether an sm_90a-only kernel's sm_90a image is what this device would run (an sm_80-only build, or
// another GPU, does not).
// Asked once per device (one process may drive GPUs of different kinds); a benign race: every thread computes the
// same value.
template <auto Kernel>
bool Sm90aImageLoaded() {
  static std::atomic<int> ok[kMaxCachedDevices] = {};  // 0 unknown, 1 yes, 2 no
  const int device = std::max(CurrentDeviceSlot(), 0);   // unreadable: the first slot's answer
  int known = ok[device].load(std::memory_order_relaxed);
  if (known == 0) {
    cudaFuncAttributes attr;
    known = cudaFuncGetAttributes(&attr, Kernel) == cudaSuccess && attr.binaryVersion == 90 ? 1 : 2;
    cudaGetLastError();
    ok[device].store(known, std::memory_order_relaxed);
  }
  return known == 1;
}

// A TMA map over a row-major [rows, cols] matrix of 16-bit values (cols contiguous, cols % 8 == 0, base
// 16-byte aligned): boxes of `box_rows` rows x `box_cols` columns, landing swizzled with the row length:
// 64 columns (128 bytes) as Sw128KOffset lays them out (row r at r * 128, 16-byte chunk j at j ^ (r % 8)) when
// the destination is 1024-byte aligned, 32 columns (64 bytes) as Sw64KOffset (512-byte aligned), 8 columns
// (16 bytes) unswizzled, row r at r * 16; out-of-bounds elements arrive as zeros.  With `swizzled` false, any
// multiple of 8 columns up to 256 lands unswizzled, row r at r * box_cols * 2 (tiles read by plain shared-memory
// loads).  False when the driver cannot make one.
inline bool MakeTensorMap2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols, uint32_t box_rows,
                            uint32_t box_cols = 64, bool swizzled = true) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};  // bytes from one row to the next
  if (swizzled ? box_cols != 64 && box_cols != 32 && box_cols != 8 : box_cols % 8 != 0 || box_cols > 256) return false;
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzled && box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B
                : swizzled && box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                             : CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The warp-specialized kernels of 384 threads: one producer warpgroup, two consumer warpgroups (SpmmWgmmaXtWsKernel,
// and the tma engine's SddmmWgmmaXrWsKernel). Registers per thread once the roles are known (setmaxnreg, 128 x
// producer + 256 x consumer <= 168 x 384): the producer gives back what the consumers' 128 accumulators (and the
// SpMM's metadata pipeline) need. Launched at 168 (384 threads, one CTA per SM), the SpMM's 128x256 consumers spilled 28
// bytes once the metadata was fetched two stages ahead. A producer that gathers x^T rows by cp.async (x^T, M > 4)
// needs more than one that only issues TMA (XROW: x rows, or any TMA-only producer).
constexpr int kWsThreads = 384;
template <bool XROW>
struct WsRegs {
  static constexpr int kProducer = XROW ? 40 : 56;
  static constexpr int kConsumer = XROW ? 232 : 224;
  // setmaxnreg.inc waits until registers are free, so the roles must fit in what the launch allocated (168 per
  // thread), not in the register file: producer 48 / consumer 232 deadlocked every launch (session 10, call 5).
  static constexpr int kLaunchRegs = 65536 / kWsThreads / 8 * 8;
  static_assert(128 * kProducer + 256 * kConsumer <= kWsThreads * kLaunchRegs, "registers the launch allocated");
};

#ifdef JAXSPARSE_WGMMA
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void FenceProxyAsyncShared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// stmatrix (sm_90): four 8x8 tiles of 16-bit values from a warp's registers into shared memory, transposed.  Register
// j of lane l holds row l / 4, columns 2 (l % 4) and + 1 (low half first) of tile j, the layout of an MMA
// accumulator fragment; tile j's column c is stored as the 16 bytes at the address lane 8 j + c gives.
__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// mbarrier (shared::cta) and named barriers, for the warp-specialized pipelines.
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier once every cp.async this thread issued before has landed (counts as one of the
// barrier's expected arrivals).
__device__ __forceinline__ void CpAsyncMbarArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on the barrier and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// TMA: the box of the 2-D tensor map at element coordinates (c0 innermost, c1) into shared memory at `dst`,
// completing `bytes` of the barrier's transaction count (out-of-bounds elements are written as zeros).
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* tensor_map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// setmaxnreg: this warpgroup's registers per thread become N (raised with INC, else lowered); every warp of
// the warpgroup executes it.
template <int N, bool INC>
__device__ __forceinline__ void SetMaxRegisters() {
  if (INC)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void NamedBarSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on named barrier `id` without waiting (the producer side of a bar.sync by other threads).
__device__ __forceinline__ void NamedBarArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Keeps the compiler from moving accumulator accesses across an in-flight wgmma.
template <int K>
__device__ __forceinline__ void WgmmaFenceOperands(float (&d)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for the register A operand of an RS wgmma: its registers stay untouched until this point.
template <int K>
__device__ __forceinline__ void WgmmaFenceOperands(uint32_t (&a)[K]) {
#pragma unroll
  for (int i = 0; i < K; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Accumulator operands of the m64n8 (4 floats per thread), m64n64 (32), m64n128 (64) and m64n256 (128) products.
#define JAXSPARSE_ACC_REGS_4 "{%0,%1,%2,%3}"
#define JAXSPARSE_ACC_OPS_4(d) "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3])
#define JAXSPARSE_ACC_REGS_32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define JAXSPARSE_ACC_OPS_32(d) "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),"+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31])
#define JAXSPARSE_ACC_REGS_128 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define JAXSPARSE_ACC_OPS_128(d) "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),"+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31]),"+f"(d[32]),"+f"(d[33]),"+f"(d[34]),"+f"(d[35]),"+f"(d[36]),"+f"(d[37]),"+f"(d[38]),"+f"(d[39]),"+f"(d[40]),"+f"(d[41]),"+f"(d[42]),"+f"(d[43]),"+f"(d[44]),"+f"(d[45]),"+f"(d[46]),"+f"(d[47]),"+f"(d[48]),"+f"(d[49]),"+f"(d[50]),"+f"(d[51]),"+f"(d[52]),"+f"(d[53]),"+f"(d[54]),"+f"(d[55]),"+f"(d[56]),"+f"(d[57]),"+f"(d[58]),"+f"(d[59]),"+f"(d[60]),"+f"(d[61]),"+f"(d[62]),"+f"(d[63]),"+f"(d[64]),"+f"(d[65]),"+f"(d[66]),"+f"(d[67]),"+f"(d[68]),"+f"(d[69]),"+f"(d[70]),"+f"(d[71]),"+f"(d[72]),"+f"(d[73]),"+f"(d[74]),"+f"(d[75]),"+f"(d[76]),"+f"(d[77]),"+f"(d[78]),"+f"(d[79]),"+f"(d[80]),"+f"(d[81]),"+f"(d[82]),"+f"(d[83]),"+f"(d[84]),"+f"(d[85]),"+f"(d[86]),"+f"(d[87]),"+f"(d[88]),"+f"(d[89]),"+f"(d[90]),"+f"(d[91]),"+f"(d[92]),"+f"(d[93]),"+f"(d[94]),"+f"(d[95]),"+f"(d[96]),"+f"(d[97]),"+f"(d[98]),"+f"(d[99]),"+f"(d[100]),"+f"(d[101]),"+f"(d[102]),"+f"(d[103]),"+f"(d[104]),"+f"(d[105]),"+f"(d[106]),"+f"(d[107]),"+f"(d[108]),"+f"(d[109]),"+f"(d[110]),"+f"(d[111]),"+f"(d[112]),"+f"(d[113]),"+f"(d[114]),"+f"(d[115]),"+f"(d[116]),"+f"(d[117]),"+f"(d[118]),"+f"(d[119]),"+f"(d[120]),"+f"(d[121]),"+f"(d[122]),"+f"(d[123]),"+f"(d[124]),"+f"(d[125]),"+f"(d[126]),"+f"(d[127])
#define JAXSPARSE_ACC_REGS_64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define JAXSPARSE_ACC_OPS_64(d) "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),"+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),"+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),"+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31]),"+f"(d[32]),"+f"(d[33]),"+f"(d[34]),"+f"(d[35]),"+f"(d[36]),"+f"(d[37]),"+f"(d[38]),"+f"(d[39]),"+f"(d[40]),"+f"(d[41]),"+f"(d[42]),"+f"(d[43]),"+f"(d[44]),"+f"(d[45]),"+f"(d[46]),"+f"(d[47]),"+f"(d[48]),"+f"(d[49]),"+f"(d[50]),"+f"(d[51]),"+f"(d[52]),"+f"(d[53]),"+f"(d[54]),"+f"(d[55]),"+f"(d[56]),"+f"(d[57]),"+f"(d[58]),"+f"(d[59]),"+f"(d[60]),"+f"(d[61]),"+f"(d[62]),"+f"(d[63])

// D[64 x N] += A[64 x 16] * B[16 x N] from shared memory, scale-d = 1. Each operand MN-major (TRANS = 1) or
// K-major (TRANS = 0: 128-byte-swizzled rows of 64 k, SBO = 1024 per 8 rows, a k16 step advances the start
// address by 32 bytes inside the row); A defaults to MN-major.
template <int N, typename T, int TRANS_B = 1, int TRANS_A = 1>
struct Wgmma;

// D[64 x N] += A[64 x 32] * B[32 x N] with A 2:4-sparse (wgmma.sp): A's shared-memory tile holds the 16
// stored values per row (the compressed [64 x 16] matrix, laid out as a dense K-major operand), and `e` is
// this thread's metadata word in the layout of mma.sp.m16n8k32 (MetaWord mode 0; warp w of the warpgroup
// describes rows 16w .. 16w + 15), sparsity selector 0.  A is K-major (trans-a = 0).
template <int N, typename T, int TRANS_B = 1>
struct WgmmaSp;

// The RS forms of the two: A in registers (this thread's fragment, 4 words: the dense [64 x 16] or the compressed
// [64 x 16] tile of its warp's 16 rows in the mma.m16n8k16 / mma.sp.m16n8k32 A layout), B from shared memory.
// Only the benchmarks' probes use them so far (benchmarks/smem_probe.cu, benchmarks/sddmm_gather_probe.cu).
template <int N, typename T, int TRANS_B = 1>
struct WgmmaRs;
template <int N, typename T, int TRANS_B = 1>
struct WgmmaSpRs;

// NR = N / 2 accumulators; S0 .. S4 are the asm operand numbers NR .. NR + 4 as strings, R5 .. R7 the numbers
// NR + 5 .. NR + 7.  Dense operands: a, b, scale-d, trans-b, trans-a; sparse: a, b, e, scale-d, trans-b; RS dense:
// a0 .. a3, b, scale-d, trans-b; RS sparse: a0 .. a3, b, e, scale-d, trans-b.
#define JAXSPARSE_DEFINE_WGMMA(N, NR, CT, PT, S0, S1, S2, S3, S4, R5, R6, R7)                                \
  template <int TRANS_B, int TRANS_A>                                                                          \
  struct Wgmma<N, CT, TRANS_B, TRANS_A> {                                                                      \
    __device__ __forceinline__ static void Run(float (&d)[NR], uint64_t a_desc, uint64_t b_desc) {             \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
                   "k16.f32." PT "." PT " " JAXSPARSE_ACC_REGS_##NR ", %" S0 ", %" S1 ", p, 1, 1, %" S4 ", %" S3 \
                   ";\n}\n"                                                                                     \
                   : JAXSPARSE_ACC_OPS_##NR(d)                                                                  \
                   : "l"(a_desc), "l"(b_desc), "r"(1), "n"(TRANS_B), "n"(TRANS_A));                             \
    }                                                                                                          \
  };                                                                                                           \
  template <int TRANS_B>                                                                                       \
  struct WgmmaSp<N, CT, TRANS_B> {                                                                             \
    __device__ __forceinline__ static void Run(float (&d)[NR], uint64_t a_desc, uint64_t b_desc, uint32_t e) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S3 ", 0;\nwgmma.mma_async.sp.sync.aligned.m64n" #N    \
                   "k32.f32." PT "." PT " " JAXSPARSE_ACC_REGS_##NR ", %" S0 ", %" S1 ", %" S2 ", 0, p, 1, 1, 0, %" \
                   S4 ";\n}\n"                                                                                  \
                   : JAXSPARSE_ACC_OPS_##NR(d)                                                                  \
                   : "l"(a_desc), "l"(b_desc), "r"(e), "r"(1), "n"(TRANS_B));                                   \
    }                                                                                                          \
  };                                                                                                           \
  template <int TRANS_B>                                                                                       \
  struct WgmmaRs<N, CT, TRANS_B> {                                                                             \
    __device__ __forceinline__ static void Run(float (&d)[NR], const uint32_t (&a)[4], uint64_t b_desc) {      \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" R6 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N       \
                   "k16.f32." PT "." PT " " JAXSPARSE_ACC_REGS_##NR ", {%" S0 ", %" S1 ", %" S2 ", %" S3 "}, %" S4 \
                   ", p, 1, 1, %" R5 ";\n}\n"                                                                   \
                   : JAXSPARSE_ACC_OPS_##NR(d)                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "n"(TRANS_B), "r"(1));             \
    }                                                                                                          \
  };                                                                                                           \
  template <int TRANS_B>                                                                                       \
  struct WgmmaSpRs<N, CT, TRANS_B> {                                                                           \
    __device__ __forceinline__ static void Run(float (&d)[NR], const uint32_t (&a)[4], uint64_t b_desc,        \
                                               uint32_t e) {                                                   \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" R6 ", 0;\nwgmma.mma_async.sp.sync.aligned.m64n" #N    \
                   "k32.f32." PT "." PT " " JAXSPARSE_ACC_REGS_##NR ", {%" S0 ", %" S1 ", %" S2 ", %" S3 "}, %" S4 \
                   ", %" R5 ", 0, p, 1, 1, %" R7 ";\n}\n"                                                        \
                   : JAXSPARSE_ACC_OPS_##NR(d)                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(e), "r"(1), "n"(TRANS_B));     \
    }                                                                                                          \
  };

JAXSPARSE_DEFINE_WGMMA(256, 128, __nv_bfloat16, "bf16", "128", "129", "130", "131", "132", "133", "134", "135")
JAXSPARSE_DEFINE_WGMMA(256, 128, __half, "f16", "128", "129", "130", "131", "132", "133", "134", "135")
JAXSPARSE_DEFINE_WGMMA(128, 64, __nv_bfloat16, "bf16", "64", "65", "66", "67", "68", "69", "70", "71")
JAXSPARSE_DEFINE_WGMMA(128, 64, __half, "f16", "64", "65", "66", "67", "68", "69", "70", "71")
JAXSPARSE_DEFINE_WGMMA(64, 32, __nv_bfloat16, "bf16", "32", "33", "34", "35", "36", "37", "38", "39")
JAXSPARSE_DEFINE_WGMMA(64, 32, __half, "f16", "32", "33", "34", "35", "36", "37", "38", "39")
JAXSPARSE_DEFINE_WGMMA(8, 4, __nv_bfloat16, "bf16", "4", "5", "6", "7", "8", "9", "10", "11")
JAXSPARSE_DEFINE_WGMMA(8, 4, __half, "f16", "4", "5", "6", "7", "8", "9", "10", "11")
#undef JAXSPARSE_DEFINE_WGMMA
#undef JAXSPARSE_ACC_REGS_4
#undef JAXSPARSE_ACC_OPS_4
#undef JAXSPARSE_ACC_REGS_32
#undef JAXSPARSE_ACC_OPS_32
#undef JAXSPARSE_ACC_REGS_64
#undef JAXSPARSE_ACC_OPS_64
#undef JAXSPARSE_ACC_REGS_128
#undef JAXSPARSE_ACC_OPS_128
#endif  // JAXSPARSE_WGMMA

}  // namespace jaxsparse

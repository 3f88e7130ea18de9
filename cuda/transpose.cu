// x [T, K] -> x^T [K, T] for 16-bit activations: the column-major operand of the SDDMM's x^T engine
// (cuda/sddmm.cu), made by this kernel instead of an XLA layout change.  Measured on the H100 (docs/
// kernel-notes.md, session 4): asking XLA for a column-major x made it fuse the transposes into the
// producers of the BERT step's activations, 148.8 ms of transposes per step against 5.1, although each is a
// plain copy of 32-128 MB; a dedicated copy kernel moves those bytes at memory speed.
//
// 64 x 64 tiles through shared memory; 16-byte loads of token rows and 16-byte stores of k rows; T % 8 == 0 and
// K % 8 == 0 (16-byte chunks never straddle the end).  The tile's 16-byte chunks are XOR-swizzled by token group
// (chunk j of token row r sits at chunk j ^ (r / 8)), so that a warp can store 4 whole 128-byte lines of x^T
// (4 k rows x 8 chunks of 8 tokens) while its 16-bit shared reads stay free of bank conflicts.  Session 4's
// version stored one 16-byte chunk into each of 32 k rows per warp instruction and moved 1.9 TB/s
// (docs/kernel-notes.md, session 11).
#include "common.cuh"
#include "handlers.h"
#include "mma_common.cuh"

namespace jaxsparse {
namespace {

constexpr int kTile = 64;

// Element (r, kk) of the 64 x 64 tile: row r, 16-byte chunk (kk / 8) ^ (r / 8), position kk % 8 in it.
__device__ __forceinline__ int SwizzledIndex(int r, int kk) { return r * kTile + (((kk >> 3) ^ (r >> 3)) << 3) + (kk & 7); }

__global__ void __launch_bounds__(256) TransposeKernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ xt,
                                                       int tokens, int k) {
  __shared__ __align__(16) uint16_t tile[kTile * kTile];
  const int t0 = blockIdx.x * kTile, k0 = blockIdx.y * kTile;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Load: 64 token rows x 8 chunks of 8 k; thread takes chunk tid % 8 of rows tid / 8 and tid / 8 + 32 (a warp
  // writes 4 whole tile rows: 4 shared wavefronts, the fewest for 512 bytes).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = tid / 8 + 32 * h, c = tid % 8;
    const int t = t0 + r, kk = k0 + c * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (t < tokens && kk < k) v = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * k + kk);
    *reinterpret_cast<uint4*>(&tile[SwizzledIndex(r, c * 8)]) = v;
  }
  __syncthreads();
  // Store: lane = 8 * (k row in the warp's 4) + token chunk; warp w takes k rows 4w .. 4w + 3 and 32 + 4w ..
  // 32 + 4w + 3.  For each of the 8 tokens of a chunk the warp reads 8 token rows x 4 adjacent k: the swizzle
  // spreads the 8 rows over 8 distinct 16-byte bank groups.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int kr = 4 * warp + (lane >> 3) + 32 * h, c = lane & 7;
    const int kk = k0 + kr, t = t0 + c * 8;
    if (kk >= k || t >= tokens) continue;
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      w[j] = static_cast<uint32_t>(tile[SwizzledIndex(c * 8 + 2 * j, kr)]) |
             (static_cast<uint32_t>(tile[SwizzledIndex(c * 8 + 2 * j + 1, kr)]) << 16);
    *reinterpret_cast<uint4*>(xt + static_cast<int64_t>(kk) * tokens + t) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

ffi::Error TransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> xt) {
  if (x.dimensions().size() != 2 || xt->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_transpose: x and the output must be 2-D");
  const int64_t tokens = Dim(x, 0), k = Dim(x, 1);
  if (xt->dimensions()[0] != k || xt->dimensions()[1] != tokens)
    return ffi::Error::InvalidArgument("jaxsparse_transpose: the output must be [K, T] for x " + ShapeString(x));
  if (x.element_type() != xt->element_type() || (x.element_type() != ffi::BF16 && x.element_type() != ffi::F16))
    return ffi::Error::InvalidArgument("jaxsparse_transpose: x and the output must share a 16-bit float dtype");
  if (tokens % 8 || k % 8)
    return ffi::Error::InvalidArgument("jaxsparse_transpose: needs T % 8 == 0 and K % 8 == 0");
  if (tokens == 0 || k == 0) return ffi::Error::Success();
  if ((k + kTile - 1) / kTile > 65535 || tokens >= (int64_t(1) << 31) / 2)
    return ffi::Error::InvalidArgument("jaxsparse_transpose: shape too large");
  const dim3 grid(static_cast<unsigned>((tokens + kTile - 1) / kTile), static_cast<unsigned>((k + kTile - 1) / kTile));
  TransposeKernel<<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(x.untyped_data()),
                                            static_cast<uint16_t*>(xt->untyped_data()), static_cast<int>(tokens),
                                            static_cast<int>(k));
  return LastLaunchError("TransposeKernel");
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseTranspose, jaxsparse::TransposeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()    // x [T, K]
                                  .Ret<xla::ffi::AnyBuffer>(),  // x^T [K, T]
                              JAXSPARSE_GRAPH_SAFE);

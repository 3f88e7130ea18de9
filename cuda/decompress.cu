// Decompresses a V:2:M SparseWeight into the dense Flax kernel [K, R] (layout: docs/format.md).
// Not on the hot path; it is the first handler through the FFI plumbing and a debugging aid.
#include "common.cuh"
#include "handlers.h"

namespace jaxsparse {
namespace {

// One thread per (row r, group g): writes the M entries of column r of the [K, R] output in group g.
// Threads of a warp take consecutive rows, so every store is coalesced.
template <typename T>
__global__ void DecompressKernel(const T* __restrict__ values, const uint8_t* __restrict__ columns,
                                 const uint32_t* __restrict__ metadata, T* __restrict__ out, int rows,
                                 int groups, int v, int m) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  const int g = blockIdx.y;
  if (r >= rows) return;
  const uint32_t word = metadata[static_cast<int64_t>(r) * (groups / 8) + g / 8];
  const uint32_t nibble = (word >> (4 * (g % 8))) & 0xF;
  int c0 = nibble & 3, c1 = nibble >> 2;
  if (columns != nullptr) {
    const uint8_t* cols = columns + (static_cast<int64_t>(r / v) * groups + g) * 4;
    c0 = cols[c0];
    c1 = cols[c1];
  }
  const T v0 = values[static_cast<int64_t>(r) * 2 * groups + 2 * g];
  const T v1 = values[static_cast<int64_t>(r) * 2 * groups + 2 * g + 1];
  for (int c = 0; c < m; ++c) {
    T x{};
    if (c == c0) x = v0;
    if (c == c1) x = v1;
    out[static_cast<int64_t>(g * m + c) * rows + r] = x;
  }
}

template <typename T>
ffi::Error Launch(cudaStream_t stream, const ffi::AnyBuffer& values, const uint8_t* columns,
                  const uint32_t* metadata, ffi::AnyBuffer* out, int rows, int groups, int v, int m) {
  if (rows == 0 || groups == 0) return ffi::Error::Success();
  const int threads = 256;
  dim3 grid((rows + threads - 1) / threads, groups);
  DecompressKernel<T><<<grid, threads, 0, stream>>>(reinterpret_cast<const T*>(values.untyped_data()), columns,
                                                     metadata, reinterpret_cast<T*>(out->untyped_data()), rows,
                                                     groups, v, m);
  return LastLaunchError("DecompressKernel");
}

ffi::Error DecompressImpl(cudaStream_t stream, ffi::AnyBuffer values, ffi::Buffer<ffi::U8> columns,
                          ffi::Buffer<ffi::U32> metadata, ffi::Result<ffi::AnyBuffer> out, int32_t v,
                          int32_t m) {
  if (values.dimensions().size() != 2 || out->dimensions().size() != 2 || metadata.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("jaxsparse_decompress: values, metadata and output must be 2-D");
  const int64_t rows = Dim(values, 0), groups = Dim(values, 1) / 2, k = out->dimensions()[0];
  if (m < 4 || v < 1 || groups % 8 || k != groups * m || out->dimensions()[1] != rows ||
      metadata.dimensions()[0] != rows || metadata.dimensions()[1] != groups / 8 || rows % v)
    return ffi::Error::InvalidArgument("jaxsparse_decompress: inconsistent shapes: values " + ShapeString(values) +
                                       ", metadata " + ShapeString(metadata) + ", out " + ShapeString(*out));
  const bool has_columns = m > 4;
  if (has_columns && columns.element_count() != static_cast<size_t>(rows / v * groups * 4))
    return ffi::Error::InvalidArgument("jaxsparse_decompress: columns must be [R/V, G, 4], got " +
                                       ShapeString(columns));
  if (values.element_type() != out->element_type())
    return ffi::Error::InvalidArgument("jaxsparse_decompress: output dtype must equal the values dtype");
  const uint8_t* cols = has_columns ? columns.typed_data() : nullptr;
  switch (ffi::ByteWidth(values.element_type())) {
    case 2:
      return Launch<uint16_t>(stream, values, cols, metadata.typed_data(), &(*out), rows, groups, v, m);
    case 4:
      return Launch<uint32_t>(stream, values, cols, metadata.typed_data(), &(*out), rows, groups, v, m);
    default:
      return ffi::Error::InvalidArgument("jaxsparse_decompress: values must be a 2- or 4-byte float type");
  }
}

}  // namespace
}  // namespace jaxsparse

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxsparseDecompress, jaxsparse::DecompressImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("v")
                                  .Attr<int32_t>("m"),
                              JAXSPARSE_GRAPH_SAFE);

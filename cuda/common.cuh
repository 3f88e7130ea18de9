// Shared helpers for the jaxsparse XLA FFI handlers: error plumbing and dtype names.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxsparse {

namespace ffi = xla::ffi;

// Turns a failed CUDA call into an ffi::Error that names the call; handlers never abort the process.
inline ffi::Error CudaError(cudaError_t status, const char* what) {
  return ffi::Error::Internal(std::string("jaxsparse: ") + what + ": " + cudaGetErrorName(status) + ": " +
                              cudaGetErrorString(status));
}

// Checks the launch that was just enqueued (configuration errors surface here, not at sync).
inline ffi::Error LastLaunchError(const char* kernel) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return CudaError(status, kernel);
  return ffi::Error::Success();
}

inline int64_t Dim(const ffi::AnyBuffer& b, int i) { return b.dimensions()[i]; }

template <typename B>
inline std::string ShapeString(const B& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Calls launch(std::integral_constant<int, M>{}) for the group widths M the kernels are built for
// (4, 8, 16, 32); any other M is an InvalidArgument naming the target.
template <typename Launch>
inline ffi::Error DispatchGroupWidth(const char* target, int m, Launch&& launch) {
  switch (m) {
    case 4:
      return launch(std::integral_constant<int, 4>{});
    case 8:
      return launch(std::integral_constant<int, 8>{});
    case 16:
      return launch(std::integral_constant<int, 16>{});
    case 32:
      return launch(std::integral_constant<int, 32>{});
    default:
      return ffi::Error::InvalidArgument(std::string(target) + ": M must be 4, 8, 16 or 32, got " + std::to_string(m));
  }
}

}  // namespace jaxsparse

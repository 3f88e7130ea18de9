// Shared helpers for the jaxsparse XLA FFI handlers: error plumbing and dtype names.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

// Traits of the handlers that only enqueue kernels on XLA's stream (no scratch memory, no host synchronization):
// XLA may then record them into its command buffers (CUDA graphs) with the fusions around them.
#define JAXSPARSE_GRAPH_SAFE \
  { xla::ffi::Traits::kCmdBufferCompatible }

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

// Per-device caches of host-side facts (a process may drive several GPUs): the current device's ordinal as an index
// into arrays of kMaxCachedDevices entries, or -1 when it cannot be read or lies past them.
constexpr int kMaxCachedDevices = 64;
inline int CurrentDeviceSlot() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxCachedDevices) {
    cudaGetLastError();
    return -1;
  }
  return device;
}

// Sets a kernel's dynamic shared-memory limit once per instantiation and device: cudaFuncSetAttribute applies to
// the current device only, and one process may drive several GPUs (XLA runs each device's program on its own
// thread, with that device current). Set only on the first device, a launch on another asks for more shared memory
// than its default limit and fails there while the others wait in their first collective (session 35: a
// single-process data-parallel step on two GPUs hung). Concurrent first calls on one device both set it: idempotent.
template <auto Kernel>
ffi::Error RaiseSmemLimit(int bytes, const char* name) {
  static std::atomic<bool> done[kMaxCachedDevices] = {};
  const int device = CurrentDeviceSlot();  // -1: set it every call
  if (device < 0 || !done[device].load(std::memory_order_acquire)) {
    cudaError_t st = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (st != cudaSuccess) return CudaError(st, name);
    if (device >= 0) done[device].store(true, std::memory_order_release);
  }
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

// The forward epilogue's operands: a bias (empty, or [rows] in the input dtype `dt` or float32) and the
// activation attribute (0 none, 1 gelu (tanh), 2 gelu_erf, 3 relu: mma_common.cuh Activate).
inline ffi::Error CheckEpilogue(const char* target, const ffi::AnyBuffer& bias, int64_t rows, ffi::DataType dt,
                                int32_t activation) {
  const std::string name(target);
  if (bias.element_count() > 0 && (bias.element_count() != static_cast<size_t>(rows) ||
                                   (bias.element_type() != dt && bias.element_type() != ffi::F32)))
    return ffi::Error::InvalidArgument(name + ": bias must be [R] in the input dtype or float32");
  if (activation < 0 || activation > 3)
    return ffi::Error::InvalidArgument(name + ": activation must be 0 (none), 1 (gelu), 2 (gelu_erf) or 3 (relu)");
  return ffi::Error::Success();
}

// The kernels' pattern rules alone: M in {4, 8, 16, 32}; V = 1 for M = 4, else 64 or 128.
inline ffi::Error CheckSpec(const char* target, int v, int m) {
  const std::string name(target);
  if (m != 4 && m != 8 && m != 16 && m != 32)
    return ffi::Error::InvalidArgument(name + ": M must be 4, 8, 16 or 32, got " + std::to_string(m));
  if (m == 4 ? v != 1 : (v != 64 && v != 128))
    return ffi::Error::InvalidArgument(name + ": V must be 1 for M = 4 and 64 or 128 for M > 4");
  return ffi::Error::Success();
}

// The compressed weight's operands against the MMA kernels' V:2:M rules (docs/format.md): M in
// {4, 8, 16, 32}; V = 1 for M = 4, else 64 or 128; R % V == 0; G % 8 == 0; metadata [R, G/8]; columns
// [R/V, G, 4] when M > 4. Returns InvalidArgument naming the target, or Success.
inline ffi::Error CheckSparseWeight(const char* target, int64_t rows, int64_t groups,
                                    const ffi::Buffer<ffi::U8>& columns, const ffi::Buffer<ffi::U32>& metadata,
                                    int v, int m) {
  if (ffi::Error e = CheckSpec(target, v, m); e.failure()) return e;
  const std::string name(target);
  if (groups % 8 || rows % v || metadata.dimensions().size() != 2 || metadata.dimensions()[0] != rows ||
      metadata.dimensions()[1] != groups / 8)
    return ffi::Error::InvalidArgument(name + ": inconsistent shapes: metadata " + ShapeString(metadata) + " for R = " +
                                       std::to_string(rows) + ", G = " + std::to_string(groups) + ", V = " +
                                       std::to_string(v));
  if (m > 4 && columns.element_count() != static_cast<size_t>(rows / v * groups * 4))
    return ffi::Error::InvalidArgument(name + ": columns must be [R/V, G, 4], got " + ShapeString(columns));
  return ffi::Error::Success();
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

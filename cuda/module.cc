// The nanobind module: hands XLA FFI handler capsules to Python, which registers them with
// jax.ffi.register_ffi_target (see jaxsparse/ffi/__init__.py).
#include <nanobind/nanobind.h>

#include "handlers.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxsparse_cuda, m) {
  m.doc() = "jaxsparse CUDA kernels as XLA FFI handlers";
  m.def("registrations", []() {
    nb::dict d;
    d["jaxsparse_as_2_4"] = Capsule(JaxsparseAs24);
    d["jaxsparse_decompress"] = Capsule(JaxsparseDecompress);
    d["jaxsparse_spmm"] = Capsule(JaxsparseSpmm);
    d["jaxsparse_spmm_xt"] = Capsule(JaxsparseSpmmXt);
    d["jaxsparse_sddmm"] = Capsule(JaxsparseSddmm);
    d["jaxsparse_spmm_t"] = Capsule(JaxsparseSpmmT);
    d["jaxsparse_spmm_t_condensed"] = Capsule(JaxsparseSpmmTCondensed);
    d["jaxsparse_spmm_t_resident"] = Capsule(JaxsparseSpmmTResident);
    d["jaxsparse_transpose"] = Capsule(JaxsparseTranspose);
    d["jaxsparse_transpose_2_4"] = Capsule(JaxsparseTranspose24);
    return d;
  });
}

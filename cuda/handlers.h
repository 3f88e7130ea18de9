// Every XLA FFI handler symbol the extension exports; module.cc registers them by name.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseAs24);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseDecompress);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSpmm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSpmmXt);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSddmm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSpmmT);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSpmmTCondensed);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseSpmmTResident);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseTranspose);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxsparseTranspose24);

"""``jax.ffi.ffi_call`` wrappers, one per CUDA target. Callers validate shapes first (``jaxsparse.ops``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse.ffi import register
from jaxsparse.format import SparseWeight

# vmap of any call runs the kernel once per batch element: a correct, if slow, batching rule.
_VMAP = "sequential"


def _columns_operand(sw: SparseWeight) -> jax.Array:
    """The columns array, or an empty placeholder for M = 4 (the kernels ignore it then)."""
    return sw.columns if sw.columns is not None else jnp.zeros((0,), jnp.uint8)


def decompress(sw: SparseWeight) -> jax.Array:
    """Dense ``[K, R]`` kernel of ``sw`` by the CUDA handler ``jaxsparse_decompress``."""
    register()
    call = jax.ffi.ffi_call(
        "jaxsparse_decompress", jax.ShapeDtypeStruct(sw.shape, sw.values.dtype), vmap_method=_VMAP
    )
    return call(sw.values, _columns_operand(sw), sw.metadata, v=np.int32(sw.spec.v), m=np.int32(sw.spec.m))

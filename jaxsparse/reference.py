"""Pure-JAX reference of every kernel: the CPU path, the test oracle and the definition.

All products accumulate in float32 and return the input dtype unless said otherwise. Activations are
``[T, K]`` (callers flatten leading dimensions); weights are ``SparseWeight`` with dense shape ``[K, R]``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxsparse.format import SparseWeight, chunk_columns, compress_like, decompress, transpose_2_4

__all__ = ["ACTIVATIONS", "activation_with_derivative", "spmm", "sddmm", "spmm_t", "bias_grad", "spmm_blocks",
           "sddmm_blocks"]

# Epilogue activations the kernels fuse; "gelu" is the tanh approximation, "gelu_erf" the exact GELU.
ACTIVATIONS = {
    None: lambda y: y,
    "gelu": lambda y: jax.nn.gelu(y, approximate=True),
    "gelu_erf": lambda y: jax.nn.gelu(y, approximate=False),
    "relu": jax.nn.relu,
}


def activation_with_derivative(activation: str, z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(act(z), act'(z))`` elementwise (the activation's JVP along ones, in float32), in ``z``'s dtype."""
    z32 = z.astype(jnp.float32)
    f, df = jax.jvp(ACTIVATIONS[activation], (z32,), (jnp.ones_like(z32),))
    return f.astype(z.dtype), df.astype(z.dtype)


def spmm(x: jax.Array, sw: SparseWeight, bias: Optional[jax.Array] = None, activation: Optional[str] = None) -> jax.Array:
    """Forward product ``act(x @ W + bias)``: ``[T, K] -> [T, R]``."""
    y = jnp.dot(x, decompress(sw).astype(x.dtype), preferred_element_type=jnp.float32)
    return _epilogue(y, bias, activation, x.dtype)


def spmm_sum(xs, sws) -> jax.Array:
    """``sum_i xs[i] @ W_i`` accumulated in float32 and rounded once to ``xs[0]``'s dtype: ``[T, K_i] -> [T, R]``."""
    y = sum(jnp.dot(x, decompress(sw).astype(x.dtype), preferred_element_type=jnp.float32) for x, sw in zip(xs, sws))
    return y.astype(xs[0].dtype)


def spmm_t_sum(dys, sws) -> jax.Array:
    """``sum_i dys[i] @ W_i^T`` over the ``W_i^T`` 2:4 views (:func:`jaxsparse.format.transpose_2_4`: NaN where a mask
    is not transposable), as :func:`spmm_sum`: ``[T, R] -> [T, K]``."""
    return spmm_sum(dys, tuple(transpose_2_4(sw) for sw in sws))


def _epilogue(y: jax.Array, bias: Optional[jax.Array], activation: Optional[str], dtype) -> jax.Array:
    """``act(y + bias)`` of a float32 product ``y``, in ``dtype``."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return ACTIVATIONS[activation](y).astype(dtype)


def sddmm(x: jax.Array, dy: jax.Array, sw: SparseWeight, out_dtype=None) -> jax.Array:
    """Weight gradient ``x^T dy`` sampled at ``sw``'s kept positions, in the layout of ``sw.values``."""
    dense = jnp.dot(x.T, dy, preferred_element_type=jnp.float32)  # [K, R]
    return compress_like(dense, sw).astype(out_dtype or sw.values.dtype)


def sddmm_stacked(x: jax.Array, dys, sws, x_layout: str = "row", with_bias_grad: bool = False) -> tuple:
    """:func:`sddmm` of one input ``x`` (``x^T [K, T]`` where ``x_layout`` is ``"col"``) with each ``dys[i]`` at
    ``sws[i]``, one result a layer: ``dvalues``, or with ``with_bias_grad`` the pair ``(dvalues, dy summed over tokens in
    float32)``, as :func:`jaxsparse.ffi.calls.sddmm_stacked` returns them."""
    x = x.T if x_layout == "col" else x
    return tuple((sddmm(x, dy, sw), bias_grad(dy, jnp.float32)) if with_bias_grad else sddmm(x, dy, sw)
                 for dy, sw in zip(dys, sws))


def spmm_t(dy: jax.Array, sw: SparseWeight) -> jax.Array:
    """Input gradient ``dy @ W^T``: ``[T, R] -> [T, K]``."""
    return jnp.dot(dy, decompress(sw).astype(dy.dtype).T, preferred_element_type=jnp.float32).astype(dy.dtype)


def spmm_blocks(x: jax.Array, sw: SparseWeight, blocks: int, bias: Optional[jax.Array] = None,
                activation: Optional[str] = None, x_chunks: Optional[jax.Array] = None,
                y_chunks: Optional[jax.Array] = None) -> jax.Array:
    """Forward product of a weight of ``blocks`` diagonal blocks stacked as ``sw`` (Flax shape ``(K, R)``; output
    feature ``r`` reads x's columns ``(r // (R / blocks)) K + [0, K)``): ``[T, blocks K] -> [T, R]``. With
    ``x_chunks`` (a table ``[blocks, K/64]``, ``jaxsparse.format.diagonal_chunks``) block ``b`` reads x's 64-column
    chunks ``x_chunks[b]`` instead; with ``y_chunks`` (``[R/64]``) output feature ``f`` goes to column
    ``y_chunks[f // 64] * 64 + f % 64``."""
    k, r = sw.shape
    if x_chunks is not None:
        x = x[:, chunk_columns(x_chunks)]
    if y_chunks is not None:
        y = spmm_blocks(x, sw, blocks, bias, activation)
        return jnp.zeros_like(y).at[:, chunk_columns(y_chunks)].set(y)
    w = decompress(sw).astype(x.dtype).reshape(k, blocks, r // blocks)
    y = jnp.einsum("tbk,kbr->tbr", x.reshape(-1, blocks, k), w, preferred_element_type=jnp.float32).reshape(-1, r)
    return _epilogue(y, bias, activation, x.dtype)


def sddmm_blocks(x: jax.Array, dy: jax.Array, sw: SparseWeight, blocks: int, out_dtype=None,
                 x_chunks: Optional[jax.Array] = None) -> jax.Array:
    """Weight gradient of :func:`spmm_blocks`: each block's ``x^T dy`` sampled at its kept positions, in the layout
    of ``sw.values`` (``x_chunks`` as there)."""
    k, r = sw.shape
    if x_chunks is not None:
        x = x[:, chunk_columns(x_chunks)]
    t = x.shape[0]
    dense = jnp.einsum("tbk,tbr->kbr", x.reshape(t, blocks, k), dy.reshape(t, blocks, r // blocks),
                       preferred_element_type=jnp.float32).reshape(k, r)
    return compress_like(dense, sw).astype(out_dtype or sw.values.dtype)


def bias_grad(dy: jax.Array, dtype) -> jax.Array:
    """Bias gradient: ``dy`` summed over tokens."""
    return dy.sum(axis=0, dtype=jnp.float32).astype(dtype)

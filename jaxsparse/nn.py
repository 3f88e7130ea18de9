"""``NMDense``: a drop-in ``flax.linen.Dense`` whose kernel is V:N:M sparse.

A layer runs in one of two modes, chosen by its ``compressed`` attribute:

* **master mode** (``compressed=False``, the default). ``params`` hold the dense ``kernel [K, R]``.
  The mask is *not* a parameter: it is read from the ``"sparsity"`` collection (variable ``mask``,
  bool ``[K, R]``) when the caller passes one, and the layer computes the masked product
  ``x @ (kernel * mask)``. Without a mask (nothing passed yet) it is exactly ``nn.Dense``. The layer
  never creates the mask itself; :mod:`jaxsparse.pruning` owns it (one source of truth: the
  optimizer state) and :func:`jaxsparse.pruning.model_variables` hands it to the model.
* **compressed mode** (``compressed=True``; needs an N = 2 ``sparsity`` spec). ``params`` hold
  ``values [R, 2K/M]`` -- the compressed non-zeros are the trainable parameter -- and the
  ``"sparsity"`` collection holds the fixed pattern (``metadata`` and, for ``M > 4``, ``columns``).
  The forward is :func:`jaxsparse.ops.sparse_linear`, whose gradient is written straight into the
  values layout, so no dense gradient and no dense optimizer state exist for the layer.
  :func:`compress_variables` and :func:`compress_tree` convert a master-mode model (and its optimizer
  moments) once the final mask is reached.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.linen import dtypes

from jaxsparse import format as fmt
from jaxsparse import ops

__all__ = ["NMDense", "SPARSITY", "INPUT_STATS", "compress_variables", "compress_tree", "sparse_weight"]

SPARSITY = "sparsity"
"""Name of the variable collection that carries masks (master mode) or the fixed pattern (compressed)."""

INPUT_STATS = "input_stats"
"""Collection in which a master-mode layer sums its input features' squares (``sq``, ``[K]``) when the
caller makes it mutable: the activation-weighted pruning score of :func:`jaxsparse.pruning.gmp_prune`."""

Array = jax.Array
Initializer = Callable[..., Array]


class NMDense(nn.Module):
    """A linear layer ``y = x @ W + b`` whose ``[K, R]`` kernel follows a V:N:M pattern.

    Attributes:
      features: output features ``R``.
      use_bias: add a bias.
      dtype: computation dtype (inferred from inputs and params when None).
      param_dtype: parameter dtype.
      precision: ``lax.Precision`` of the masked-dense product (master mode only).
      kernel_init: initializer of the dense kernel (in compressed mode: of the kernel that is pruned
        by magnitude and compressed to give the initial values).
      bias_init: initializer of the bias.
      sparsity: the final pattern (``"2:4"``, ``"64:2:8"``, ...) or None for a plain dense layer.
      compressed: train the compressed values of an N = 2 ``sparsity`` pattern (see module doc).
      return_operands: in compressed mode, ``__call__`` returns the layer's ``(SparseWeight, bias)`` in the
        computation dtype instead of the product, for a caller that fuses it with its neighbour
        (:func:`jaxsparse.ops.sparse_mlp`); ``x`` then only gives ``K`` and the dtype (an array or a
        ``jax.ShapeDtypeStruct``). The parameters are those of the plain layer.
      diagonal_blocks: in compressed mode, above 1 the kernel is that many diagonal 2:4 blocks
        (``jaxsparse.ops.diagonal_linear``; the density of a V:2:M ``sparsity`` with ``M = 4 diagonal_blocks``,
        ``ValueError`` otherwise): ``values [R, K / (2 diagonal_blocks)]`` and ``metadata
        [R, K / (32 diagonal_blocks)]`` are the stacked blocks', the input features in the relabelled order
        ``jaxsparse.pruning.to_compressed`` gives. Master mode ignores it (the mask says).
      diagonal_chunks: with ``diagonal_blocks > 1``, the blocks read x through a chunk table (the ``"sparsity"``
        entry ``chunks``, int32 ``[blocks, K / (64 blocks)]``, ``jaxsparse.format.diagonal_chunks``) instead of
        relabelled inputs; ``return_operands`` then returns ``(SparseWeight, bias, chunks)``.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Initializer = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros_init()
    sparsity: str | None = None
    compressed: bool = False
    return_operands: bool = False
    diagonal_blocks: int = 1
    diagonal_chunks: bool = False

    @property
    def spec(self) -> fmt.VNM | None:
        """The parsed ``sparsity`` pattern (None for a dense layer)."""
        return None if self.sparsity is None else fmt.VNM.parse(self.sparsity)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """Apply the layer to ``x [..., K]``; returns ``[..., features]``."""
        if x.ndim < 1:
            raise ValueError(f"{self.name}: x needs a feature axis, got shape {x.shape}")
        if self.features < 1:
            raise ValueError(f"{self.name}: features must be >= 1, got {self.features}")
        if self.diagonal_blocks < 1:
            raise ValueError(f"{self.name}: diagonal_blocks must be >= 1, got {self.diagonal_blocks}")
        k, r = x.shape[-1], self.features
        spec = self.spec
        if self.diagonal_chunks and self.diagonal_blocks < 2:
            raise ValueError(f"{self.name}: diagonal_chunks needs diagonal_blocks > 1, got {self.diagonal_blocks}")
        if spec is not None and self.compressed and self.diagonal_blocks > 1:
            if fmt.diagonal_blocks(spec) != self.diagonal_blocks:  # (raises for a spec without diagonal blocks)
                raise ValueError(f"{self.name}: {spec} stands for M / 4 = {fmt.diagonal_blocks(spec)} diagonal "
                                 f"2:4 blocks, got diagonal_blocks={self.diagonal_blocks}")
            fmt.check_diagonal_shape((k, r), self.diagonal_blocks, transposable=True,
                                     chunk=fmt.DIAGONAL_CHUNK if self.diagonal_chunks else 1)
        elif spec is not None:
            fmt.validate_shape((k, r), spec, compressed=self.compressed)
        bias = self.param("bias", self.bias_init, (r,), self.param_dtype) if self.use_bias else None
        if self.return_operands and not self.compressed:
            raise ValueError(f"{self.name}: return_operands needs compressed=True (a master-mode layer has no "
                             "compressed operands)")
        if self.compressed:
            if spec is None:
                raise ValueError("NMDense(compressed=True) needs a sparsity spec with N = 2, got None")
            sw, bias = self._compressed_operands(x, bias, spec)
            chunks = None
            if self.diagonal_chunks:
                g = self.diagonal_blocks
                chunks = self.variable(SPARSITY, "chunks", lambda: jnp.arange(
                    k // fmt.DIAGONAL_CHUNK, dtype=jnp.int32).reshape(g, -1)).value
            if self.return_operands:
                return (sw, bias, chunks) if self.diagonal_chunks else (sw, bias)
            if self.diagonal_blocks > 1:
                return ops.diagonal_linear(x.astype(sw.values.dtype), sw, self.diagonal_blocks, bias, chunks=chunks)
            return ops.sparse_linear(x.astype(sw.values.dtype), sw, bias)

        kernel = self.param("kernel", self.kernel_init, (k, r), self.param_dtype)
        if spec is not None and not self.is_initializing() and self.is_mutable_collection(INPUT_STATS):
            sq = jnp.sum(jnp.square(jax.lax.stop_gradient(x).astype(jnp.float32)).reshape(-1, k), axis=0)
            self.sow(INPUT_STATS, "sq", sq, init_fn=lambda: jnp.zeros((k,), jnp.float32), reduce_fn=jnp.add)
        x, kernel, bias = dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        if self.has_variable(SPARSITY, "mask"):
            mask = self.get_variable(SPARSITY, "mask")
            if mask.shape != kernel.shape:
                raise ValueError(f"{self.name}: mask shape {mask.shape} must equal the kernel shape {kernel.shape}")
            if self.precision is None:
                return ops.masked_linear(x, kernel, mask, bias)
            kernel = jnp.where(mask, kernel, jnp.zeros((), kernel.dtype))
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        return y if bias is None else y + bias

    def _compressed_operands(self, x: Array, bias: Array | None, spec: fmt.VNM) -> tuple[fmt.SparseWeight, Array | None]:
        k, r = x.shape[-1], self.features
        if self.diagonal_blocks > 1:  # the stacked blocks: a 2:4 weight (K / blocks, R), transposable masks
            k, spec = k // self.diagonal_blocks, fmt.VNM.parse("2:4")
        if self.is_initializing() and not self.has_variable("params", "values"):
            w = self.kernel_init(self.make_rng("params"), (k, r), self.param_dtype)
            init = fmt.compress(w, fmt.select_mask(w, spec, transposable=self.diagonal_blocks > 1), spec)
            values = self.param("values", lambda _: init.values)
            metadata = self.variable(SPARSITY, "metadata", lambda: init.metadata).value
            columns = self.variable(SPARSITY, "columns", lambda: init.columns).value if spec.m > 4 else None
        else:
            values = self.get_variable("params", "values")
            metadata = self.get_variable(SPARSITY, "metadata")
            columns = self.get_variable(SPARSITY, "columns") if spec.m > 4 else None
            if values is None or metadata is None or (spec.m > 4 and columns is None):
                raise ValueError(f"{self.name}: compressed mode needs params/values and {SPARSITY}/metadata"
                                 f"{' and columns' if spec.m > 4 else ''} (see jaxsparse.nn.compress_variables)")
        dtype = self.dtype or jnp.result_type(x.dtype, values.dtype)
        sw = fmt.SparseWeight(values.astype(dtype), columns, metadata, (k, r), spec)
        return sw, None if bias is None else bias.astype(dtype)


def sparse_weight(values: Array, pattern: Mapping[str, Array], shape: tuple[int, int], spec) -> fmt.SparseWeight:
    """Rebuild the ``SparseWeight`` of a compressed layer from its ``values`` and ``"sparsity"`` entries."""
    return fmt.SparseWeight(values, pattern.get("columns"), pattern["metadata"], tuple(shape), fmt.VNM.parse(spec))


def _module_paths(masks: Mapping) -> dict[tuple, Array]:
    """``{module_path: mask}`` from a ``"sparsity"`` collection (entries named ``mask``)."""
    flat = traverse_util.flatten_dict(dict(masks))
    return {p[:-1]: m for p, m in flat.items() if p[-1] == "mask"}


def compress_tree(tree: Mapping, masks: Mapping, spec) -> dict:
    """Replace every masked ``kernel`` of a params-shaped ``tree`` by its compressed values.

    Use it on the params and on any params-shaped optimizer moment (Adam ``mu``/``nu``): the kept
    positions depend only on the mask, so the moments land in the same layout as the values.

    Args:
      tree: a params tree (``{..., module: {"kernel": [K, R], ...}}``).
      masks: a ``"sparsity"`` collection (``{..., module: {"mask": bool [K, R]}}``).
      spec: the N = 2 pattern every mask obeys.

    Returns:
      The tree with ``module/kernel`` replaced by ``module/values`` (``[R, 2K/M]``) where a mask exists.
    """
    spec = fmt.VNM.parse(spec)
    paths = _module_paths(masks)
    flat = traverse_util.flatten_dict(dict(tree))
    out = {}
    for path, leaf in flat.items():
        if path[-1] == "kernel" and path[:-1] in paths:
            out[path[:-1] + ("values",)] = fmt.compress(leaf, paths[path[:-1]], spec).values
        else:
            out[path] = leaf
    missing = set(paths) - {p[:-1] for p in flat if p[-1] == "kernel"}
    if missing:
        raise ValueError(f"masks for modules without a kernel in the tree: {sorted(missing)[:3]}")
    return traverse_util.unflatten_dict(out)


def compress_variables(params: Mapping, masks: Mapping, spec) -> tuple[dict, dict]:
    """Convert master-mode ``params`` + masks into compressed-mode ``(params, sparsity)`` collections.

    The masks must obey ``spec`` (N = 2; checked, ``ValueError`` otherwise). Pruned weights are dropped;
    the returned ``sparsity`` collection holds ``metadata`` (and ``columns`` for ``M > 4``) per layer, to
    be used with the same model built with ``compressed=True``.
    """
    spec = fmt.VNM.parse(spec)
    flat = traverse_util.flatten_dict(dict(params))
    pattern = {}
    for path, mask in _module_paths(masks).items():
        if path + ("kernel",) not in flat:
            raise ValueError(f"mask for {'/'.join(path)} has no kernel in params")
        sw = fmt.compress(flat[path + ("kernel",)], mask, spec)
        pattern[path + ("metadata",)] = sw.metadata
        if sw.columns is not None:
            pattern[path + ("columns",)] = sw.columns
    return compress_tree(params, masks, spec), traverse_util.unflatten_dict(pattern)

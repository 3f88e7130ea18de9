"""``NMLinear``: the Flax NNX form of :class:`jaxsparse.nn.NMDense` (a drop-in ``nnx.Linear`` with a V:N:M kernel).

The two modes are those of ``NMDense``:

* **master mode** (after construction): the parameter is the dense ``kernel [K, R]`` (an ``nnx.Param``). The mask
  is state, not a parameter: a :class:`Mask` variable, ``None`` until :func:`set_masks` hands the layer one. Without
  a mask the layer is exactly ``nnx.Linear``; with one it computes ``x @ (kernel * mask)``. The mask's one source of
  truth is :func:`jaxsparse.pruning.gmp_prune`'s optimizer state, as for the linen layer: after each update, pass
  ``pruning.masks_of(optimizer.opt_state)`` to :func:`set_masks`.
* **compressed mode** (after :meth:`NMLinear.compress`, for an ``N = 2`` pattern): the parameter is the compressed
  ``values [R, 2K/M]`` and the fixed pattern (``metadata``, and ``columns`` for ``M > 4``) is :class:`Mask` state.
  The forward is :func:`jaxsparse.ops.sparse_linear`, whose gradient is written straight into the values layout:
  no dense gradient and no dense optimizer state exist for the layer. :func:`compress_model` compresses every
  masked layer and makes the new optimizer, carrying Adam's moments (and the step count) over into the values layout.

``gmp_prune`` works on ``nnx.state(model, nnx.Param)`` as on a linen params tree (its filters read the same path
names: ``.../kernel``); give it a ``filter_fn`` that selects your model's layers (the default selects kernels under a
module whose name contains ``encoder``)::

    model = MyModel(rngs=nnx.Rngs(0))                    # built with jaxsparse.nnx.NMLinear layers
    tx = optax.chain(optax.adamw(1e-3), pruning.gmp_prune("64:2:8", 0, 1000, filter_fn=...))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ...                                                  # each step: grads = nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    set_masks(model, pruning.masks_of(optimizer.opt_state))
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxsparse import format as fmt
from jaxsparse import ops, pruning

__all__ = ["Mask", "NMLinear", "compress_model", "set_masks"]

Array = jax.Array


class Mask(nnx.Variable):
    """A sparse layer's mask (master mode) or fixed pattern (compressed mode): model state that is not a parameter,
    so ``nnx.grad`` and ``nnx.Optimizer(..., wrt=nnx.Param)`` leave it alone."""


class NMLinear(nnx.Module):
    """A linear layer ``y = x @ W + b`` whose ``[K, R]`` kernel follows a V:N:M pattern (``nnx.Linear``'s arguments
    plus ``sparsity``).

    Args:
      in_features: input features ``K``.
      out_features: output features ``R``.
      sparsity: the final pattern (``"2:4"``, ``"64:2:8"``, ...) or None for a plain dense layer. Checked against
        the shape at construction (``ValueError`` naming the constraint).
      use_bias: add a bias.
      dtype: computation dtype (inferred from the input and the params when None).
      param_dtype: parameter dtype.
      kernel_init, bias_init: initializers of the dense kernel and the bias.
      rngs: the ``nnx.Rngs`` that initialise the parameters.
    """

    def __init__(self, in_features: int, out_features: int, *, sparsity: str | None = None, use_bias: bool = True,
                 dtype: Any = None, param_dtype: Any = jnp.float32,
                 kernel_init: Callable[..., Array] = nnx.initializers.lecun_normal(),
                 bias_init: Callable[..., Array] = nnx.initializers.zeros_init(), rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.sparsity = sparsity
        if sparsity is not None:
            fmt.validate_shape((in_features, out_features), fmt.VNM.parse(sparsity))
        self.dtype, self.param_dtype = dtype, param_dtype
        self.kernel: nnx.Param | None = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.data(nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None)
        # Data attributes that start empty (nnx.data: an attribute first set to None would be static).
        self.mask: Mask | None = nnx.data(None)
        self.values: nnx.Param | None = nnx.data(None)
        self.metadata: Mask | None = nnx.data(None)
        self.columns: Mask | None = nnx.data(None)

    @property
    def compressed(self) -> bool:
        """Whether the layer trains its compressed values (after :meth:`compress`)."""
        return self.values is not None

    def __call__(self, x: Array) -> Array:
        """Apply the layer to ``x [..., K]``; returns ``[..., R]``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NMLinear: x's last dimension must be in_features {self.in_features}, got {x.shape}")
        bias = None if self.bias is None else self.bias.get_value()
        if self.compressed:
            spec = fmt.VNM.parse(self.sparsity)
            values = self.values.get_value()
            dtype = self.dtype or jnp.result_type(x.dtype, values.dtype)
            sw = fmt.SparseWeight(values.astype(dtype), None if self.columns is None else self.columns.get_value(),
                                  self.metadata.get_value(), (self.in_features, self.out_features), spec)
            return ops.sparse_linear(x.astype(dtype), sw, None if bias is None else bias.astype(dtype))
        kernel = self.kernel.get_value()
        dtype = self.dtype or jnp.result_type(x.dtype, kernel.dtype)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        bias = None if bias is None else bias.astype(dtype)
        if self.mask is not None:
            return ops.masked_linear(x, kernel, self.mask.get_value(), bias)
        y = jnp.dot(x, kernel)
        return y if bias is None else y + bias

    def set_mask(self, mask: Array | None) -> None:
        """Set (or, with None, clear) the master-mode mask: bool ``[K, R]`` obeying the layer's pattern or one of
        its ladder's stages (not checked here: :func:`jaxsparse.pruning.gmp_prune` chooses it)."""
        if self.compressed:
            raise ValueError("NMLinear.set_mask: the layer is compressed; its pattern is fixed")
        if mask is not None and tuple(mask.shape) != (self.in_features, self.out_features):
            raise ValueError(f"NMLinear.set_mask: mask shape {tuple(mask.shape)} must equal the kernel shape "
                             f"{(self.in_features, self.out_features)}")
        self.mask = None if mask is None else Mask(jnp.asarray(mask, bool))

    def compress(self) -> None:
        """Switch to compressed mode: ``values`` (the kept weights under the current mask) become the parameter,
        ``metadata`` / ``columns`` the fixed pattern, and the dense kernel and the mask go. Needs a mask that
        obeys the layer's ``N = 2`` pattern (``jaxsparse.format.compress`` raises ``ValueError`` otherwise, e.g. for
        an earlier ladder stage's mask); make the optimizer afterwards."""
        if self.compressed:
            raise ValueError("NMLinear.compress: the layer is already compressed")
        if self.sparsity is None or self.mask is None:
            raise ValueError("NMLinear.compress needs a sparsity pattern and a mask (set_masks / set_mask first)")
        sw = fmt.compress(self.kernel.get_value(), self.mask.get_value(), self.sparsity)
        self.values = nnx.Param(sw.values)
        self.metadata = Mask(sw.metadata)
        self.columns = None if sw.columns is None else Mask(sw.columns)
        self.kernel, self.mask = None, None


def set_masks(model: nnx.Module, masks: Any) -> int:
    """Hand a params-shaped mask tree (``jaxsparse.pruning.masks_of(optimizer.opt_state)``: a mask at each pruned
    ``.../kernel``, None elsewhere) to the model's :class:`NMLinear` layers. Returns how many layers got one; a mask
    whose path names no master-mode ``NMLinear`` raises ``ValueError``."""
    by_path = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(masks, is_leaf=lambda x: x is None)[0]:
        names = pruning._path_names(path)
        if leaf is not None:
            if not names or names[-1] != "kernel":
                raise ValueError(f"set_masks: a mask at {'/'.join(names)}, not at a layer's kernel")
            by_path[names[:-1]] = leaf
    layers = {tuple(str(p) for p in path): m for path, m in nnx.iter_graph(model) if isinstance(m, NMLinear)}
    for path, mask in by_path.items():
        layer = layers.get(path)
        if layer is None or layer.compressed:
            raise ValueError(f"set_masks: no master-mode NMLinear at {'/'.join(path)}")
        layer.set_mask(mask)
    return len(by_path)


def _state_names(path) -> tuple[str, ...]:
    """The trailing dict keys of an optimizer-state path: the parameter's path in the model (``('layer',
    'kernel')`` of ``(0, .mu, 'layer', 'kernel')``)."""
    names = []
    for key in reversed(path):
        if not isinstance(key, jax.tree_util.DictKey):
            break
        names.append(str(key.key))
    return tuple(reversed(names))


def compress_model(model: nnx.Module, tx: optax.GradientTransformation | None = None,
                   opt_state: Any = None) -> nnx.Optimizer | None:
    """Compress every :class:`NMLinear` of ``model`` that holds a mask (:meth:`NMLinear.compress`) and, with ``tx``,
    make the optimizer that trains on: ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.

    Args:
      model: the model, in master mode, after its final ``N = 2`` masks were set (:func:`set_masks`). Layers
        without a mask stay as they are.
      tx: the optimizer to go on with (e.g. the ``adamw`` of ``optax.chain(adamw, gmp_prune(...))``).
      opt_state: optional: ``tx``'s state over the master-mode parameters, to carry over (``optimizer.opt_state[0]``
        of ``nnx.Optimizer(model, optax.chain(adamw, gmp_prune(...)), wrt=nnx.Param)``). Each entry at a
        compressed layer's ``kernel`` (Adam's ``mu``, ``nu``) is gathered into the ``values`` layout under the
        layer's mask; every other entry (the step count, other layers' moments) is copied. So the optimizer
        continues where it was, as :func:`jaxsparse.pruning.to_compressed` does for a linen model.

    Returns:
      The new optimizer, or None without ``tx``. Raises ``ValueError`` if ``opt_state`` is given without ``tx``, or
      is not ``tx``'s state over the master-mode parameters (another structure, or an entry whose shape differs);
      both are found before any layer changes.
    """
    if opt_state is not None and tx is None:
        raise ValueError("compress_model: opt_state is carried into the optimizer made from tx; give tx")

    def is_var(x) -> bool:
        return isinstance(x, nnx.Variable)

    def value(x):
        return x.get_value() if is_var(x) else x

    hint = "give the state of tx alone over the master-mode parameters (e.g. optimizer.opt_state[0] of a chain)"
    if opt_state is not None:  # checked before any layer changes: a wrong state leaves the model as it was
        old = {tuple(path): value(leaf)
               for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_var)[0]}
        expected = {tuple(path): jnp.shape(value(leaf)) for path, leaf in jax.tree_util.tree_flatten_with_path(
            jax.eval_shape(tx.init, nnx.state(model, nnx.Param)), is_leaf=is_var)[0]}
        if set(old) != set(expected):
            raise ValueError(f"compress_model: opt_state is not tx's state over the model's parameters: {hint}")
        for path, shape in expected.items():
            if jnp.shape(old[path]) != shape:
                raise ValueError(f"compress_model: opt_state's entry at {jax.tree_util.keystr(path)} has shape "
                                 f"{jnp.shape(old[path])}, tx's state over the model {shape}")
    masked = {tuple(str(p) for p in path): layer for path, layer in nnx.iter_graph(model)
              if isinstance(layer, NMLinear) and not layer.compressed and layer.mask is not None}
    patterns = {path: (layer.mask.get_value(), layer.sparsity) for path, layer in masked.items()}
    for layer in masked.values():
        layer.compress()
    if tx is None:
        return None
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if opt_state is None:
        return optimizer
    for path, leaf in jax.tree_util.tree_flatten_with_path(optimizer.opt_state, is_leaf=is_var)[0]:
        names = _state_names(path)
        source, pattern = tuple(path), None
        if names and names[-1] == "values" and names[:-1] in patterns:
            source = tuple(path[:-1]) + (jax.tree_util.DictKey("kernel"),)
            pattern = patterns[names[:-1]]
        carried = old[source]  # present, with the master parameter's shape: checked above
        if pattern is not None:
            carried = fmt.compress(carried, *pattern).values
        if is_var(leaf):
            leaf.set_value(jnp.asarray(carried, value(leaf).dtype))
        else:
            raise ValueError(f"compress_model: tx's state holds a plain leaf at {jax.tree_util.keystr(path)}")
    return optimizer

"""A LayerNorm whose backward recomputes the normalized input from the input it saved.

``flax.linen.LayerNorm`` is differentiated by JAX, which saves float32 intermediates of its forward for the backward:
at bf16 activations ``[T, H]``, three ``float32 [T, H]`` arrays a LayerNorm (``x**2``, ``x - mean`` and the scaled
product; ``jax.ad_checkpoint.print_saved_residuals`` lists them), six times the bytes of the bf16 input; XLA writes
in the forward, for the backward to read, whichever of them it does not recompute inside the backward's fusions.
:func:`layer_norm` has a ``custom_vjp`` that saves the input in its own dtype and two float32 numbers a row (mean and
``1 / sqrt(var + eps)``), and computes the backward from them::

    xhat = (x - mean) * rstd,   g = dy * scale
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),   dscale = sum(dy * xhat),   dbias = sum(dy)

The forward is flax's computation (``use_fast_variance``: ``var = max(0, E[x^2] - E[x]^2)`` in float32, then
``(x - mean) * (rsqrt(var + eps) * scale) + bias``), so its outputs are flax's bit for bit; the gradients agree with
JAX's differentiation of it to rounding. :class:`LayerNorm` is the Flax module (parameters ``scale`` and ``bias``,
as flax's), and ``jaxsparse.models.bert.BertConfig(layer_norm_impl="recompute")`` puts it in the BERT model.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes

__all__ = ["layer_norm", "LayerNorm"]


def _stats(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = xf.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, (xf * xf).mean(-1, keepdims=True) - mean * mean)
    return mean, jax.lax.rsqrt(var + eps)


def _forward(x, scale, bias, eps, dtype):
    mean, rstd = _stats(x, eps)
    return jnp.asarray((x - mean) * (rstd * scale) + bias, dtype), (x, mean, rstd, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _layer_norm(x, scale, bias, eps, dtype):
    return _forward(x, scale, bias, eps, dtype)[0]


def _layer_norm_bwd(eps, dtype, saved, dy):
    x, mean, rstd, scale = saved
    xhat = (x - mean) * rstd
    dyf = dy.astype(mean.dtype)
    g = dyf * scale
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return dx.astype(x.dtype), (dyf * xhat).sum(rows).astype(scale.dtype), dyf.sum(rows).astype(scale.dtype)


_layer_norm.defvjp(_forward, _layer_norm_bwd)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float = 1e-6,
               dtype: Any = None) -> jax.Array:
    """LayerNorm over the last axis of ``x`` with learned ``scale`` and ``bias`` (``[H]`` each), flax's forward and
    a backward from the saved input and per-row statistics (module docstring).

    Args:
      x: ``[..., H]``, floating.
      scale, bias: ``[H]`` (float32 master weights in training).
      epsilon: added to the variance.
      dtype: the output dtype (default: ``x``, ``scale`` and ``bias`` promoted, as flax's).

    Returns:
      ``[..., H]`` in ``dtype``.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
        raise ValueError(f"layer_norm needs a floating array with a feature axis, got {x.dtype}{list(x.shape)}")
    h = x.shape[-1]
    if jnp.shape(scale) != (h,) or jnp.shape(bias) != (h,):
        raise ValueError(f"layer_norm: scale and bias must be [{h}] (x's last axis), got {list(jnp.shape(scale))} "
                         f"and {list(jnp.shape(bias))}")
    if not epsilon > 0:
        raise ValueError(f"layer_norm: epsilon must be > 0, got {epsilon}")
    dtype = dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype)
    return _layer_norm(x, scale, bias, float(epsilon), jnp.dtype(dtype))


class LayerNorm(nn.Module):
    """``flax.linen.LayerNorm`` over the last axis (scale and bias, fast variance) with :func:`layer_norm`'s backward.

    Attributes:
      epsilon: added to the variance.
      dtype: the output dtype (default: inferred from the input and the parameters, as flax's).
      param_dtype: the dtype of ``scale`` (initialised to ones) and ``bias`` (zeros).
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = jnp.shape(x)[-1]
        scale = self.param("scale", nn.initializers.ones, (h,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (h,), self.param_dtype)
        return layer_norm(x, scale, bias, self.epsilon, self.dtype)

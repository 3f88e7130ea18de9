"""jaxsparse.layernorm: flax's LayerNorm forward bit for bit, its gradients, what the backward saves; in BERT."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse.layernorm import LayerNorm, layer_norm
from jaxsparse.models import bert


def _inputs(shape, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = shape[-1]
    x = (jax.random.normal(k[0], shape) * 3.0 + 0.5).astype(dtype)  # off-centre rows, so the mean term matters
    scale = 1.0 + 0.1 * jax.random.normal(k[1], (h,))
    bias = 0.1 * jax.random.normal(k[2], (h,))
    dy = jax.random.normal(k[3], shape).astype(dtype)
    return x, scale, bias, dy


def _flax(x, scale, bias, eps, dtype):
    return nn.LayerNorm(epsilon=eps, dtype=dtype).apply({"params": {"scale": scale, "bias": bias}}, x)


@pytest.mark.parametrize("dtype,out", [(jnp.float32, None), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, None)])
@pytest.mark.parametrize("shape", [(3, 17, 96), (64, 384)])
def test_matches_flax(shape, dtype, out):
    """Forward bit for bit under jit; x, scale and bias gradients against JAX's differentiation of flax's LayerNorm
    (float32 relative error ~1e-5; bf16 inputs within bf16 rounding of the float32 reference)."""
    x, scale, bias, dy = _inputs(shape, dtype)
    eps = 1e-12
    ours, theirs = (jax.jit(lambda x, s, b, f=f: jax.vjp(lambda *a: f(*a, eps, out), x, s, b))
                    for f in (layer_norm, _flax))
    (y1, vjp1), (y2, vjp2) = ours(x, scale, bias), theirs(x, scale, bias)
    assert y1.dtype == y2.dtype
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))
    dy = dy.astype(y1.dtype)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for a, b in zip(vjp1(dy), vjp2(dy)):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all()
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), (np.abs(a - b).max(), np.abs(b).max())


def test_backward_saves_the_input_and_row_statistics():
    """What the vjp keeps: x in its dtype, scale, and two float32 numbers a row; flax's keeps float32 [T, H] arrays."""
    x, scale, bias, _ = _inputs((64, 128), jnp.bfloat16)
    _, ours = jax.vjp(lambda x, s, b: layer_norm(x, s, b, 1e-12, jnp.bfloat16), x, scale, bias)
    saved = sorted((str(a.dtype), a.shape) for a in jax.tree_util.tree_leaves(ours))
    assert saved == sorted([("bfloat16", (64, 128)), ("float32", (128,)), ("float32", (64, 1)), ("float32", (64, 1))])
    _, theirs = jax.vjp(lambda x, s, b: _flax(x, s, b, 1e-12, jnp.bfloat16), x, scale, bias)
    assert ("float32", (64, 128)) in [(str(a.dtype), a.shape) for a in jax.tree_util.tree_leaves(theirs)]


def test_module_is_flax_layernorm_with_another_backward():
    """The same parameters (names, shapes, initial values) and outputs as nn.LayerNorm, so weights load unchanged."""
    x = _inputs((2, 5, 32), jnp.float32)[0]
    ours, theirs = LayerNorm(epsilon=1e-5), nn.LayerNorm(epsilon=1e-5)
    p1, p2 = ours.init(jax.random.key(0), x), theirs.init(jax.random.key(0), x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), p1) == jax.tree.map(lambda a: (a.shape, a.dtype), p2)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    np.testing.assert_array_equal(ours.apply(p2, x), theirs.apply(p2, x))
    assert LayerNorm(dtype=jnp.bfloat16).apply(p2, x).dtype == jnp.bfloat16


def test_constant_rows_and_errors():
    """A row with no variance normalises to the bias, with finite gradients; bad inputs are ValueErrors."""
    x = jnp.ones((4, 16))
    scale, bias = jnp.full((16,), 2.0), jnp.arange(16.0)
    y, vjp = jax.vjp(lambda x, s, b: layer_norm(x, s, b, 1e-5), x, scale, bias)
    np.testing.assert_allclose(y, jnp.broadcast_to(bias, x.shape))
    assert all(np.isfinite(np.asarray(g)).all() for g in vjp(jnp.ones_like(y)))
    with pytest.raises(ValueError, match=r"scale and bias must be \[16\]"):
        layer_norm(x, jnp.ones(8), bias)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        layer_norm(x, scale, bias, 0.0)
    with pytest.raises(ValueError, match="floating array"):
        layer_norm(jnp.ones((4, 16), jnp.int32), scale, bias)


def test_bert_layer_norm_impl():
    """BertConfig(layer_norm_impl="recompute"): the same parameter tree and the same logits as flax's LayerNorm,
    gradients within rounding; an unknown name is a ValueError."""
    with pytest.raises(ValueError, match="layer_norm_impl must be one of"):
        bert.BertConfig.preset("tiny", layer_norm_impl="apex")
    ids = jax.random.randint(jax.random.key(2), (2, 16), 0, 1000)
    out = {}
    for impl in bert.LAYER_NORM_IMPLS:
        model = bert.BertForSequenceClassification(bert.BertConfig.preset("tiny", layer_norm_impl=impl,
                                                                          num_hidden_layers=1), num_labels=2)
        params = jax.jit(model.init)(jax.random.key(0), ids)
        grad = jax.jit(jax.value_and_grad(lambda p: model.apply(p, ids).sum()))
        out[impl] = (params, *grad(params))
    (p1, v1, g1), (p2, v2, g2) = out["flax"], out["recompute"]
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    np.testing.assert_array_equal(v1, v2)
    top = max(float(np.abs(g).max()) for g in jax.tree.leaves(g1))  # some leaves' gradients are rounding noise
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * top), g1, g2)

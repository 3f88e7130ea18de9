"""NMDense against nn.Dense: shapes, dtypes, masked products, gradients, compressed mode, jit and pmap."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import format as fmt
from jaxsparse import ops
from jaxsparse.nn import NMDense, compress_tree, compress_variables

K, R = 64, 32


def _x(shape=(3, 5, K), seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def _init(spec="2:4", **kw):
    layer = NMDense(R, sparsity=spec, **kw)
    return layer, layer.init(jax.random.key(1), _x())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("use_bias", [True, False])
def test_without_mask_equals_dense(dtype, use_bias):
    layer, variables = _init(dtype=dtype, use_bias=use_bias)
    dense = nn.Dense(R, dtype=dtype, use_bias=use_bias)
    ref_vars = dense.init(jax.random.key(1), _x())
    assert jax.tree_util.tree_map(jnp.shape, variables) == jax.tree_util.tree_map(jnp.shape, ref_vars)
    assert "sparsity" not in variables  # the layer never creates its own mask
    y, y_ref = layer.apply(variables, _x()), dense.apply(variables, _x())
    assert y.shape == (3, 5, R) and y.dtype == y_ref.dtype == dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


@pytest.mark.parametrize("spec", ["2:4", "16:2:8", "4:8"])
def test_masked_forward_and_gradients_match_dense_with_masked_kernel(spec):
    layer, variables = _init(spec)
    params = variables["params"]
    mask = fmt.select_mask(params["kernel"], spec)
    x = _x()

    def ours(p, x):
        return (layer.apply({"params": p, "sparsity": {"mask": mask}}, x) ** 2).sum()

    def reference(p, x):
        masked = {**p, "kernel": p["kernel"] * mask}
        return (nn.Dense(R).apply({"params": masked}, x) ** 2).sum()

    (v1, (g1, gx1)), (v2, (g2, gx2)) = (jax.value_and_grad(f, argnums=(0, 1))(params, x) for f in (ours, reference))
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    np.testing.assert_allclose(g1["kernel"], g2["kernel"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g1["bias"], g2["bias"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx1, gx2, rtol=1e-4, atol=1e-4)
    assert not np.asarray(g1["kernel"])[~np.asarray(mask)].any(), "pruned weights must get zero gradient"


def test_masked_bf16_compute_keeps_fp32_params():
    layer, variables = _init(dtype=jnp.bfloat16)
    mask = fmt.select_mask(variables["params"]["kernel"], "2:4")
    y = layer.apply({**variables, "sparsity": {"mask": mask}}, _x())
    assert y.dtype == jnp.bfloat16 and variables["params"]["kernel"].dtype == jnp.float32


@pytest.mark.parametrize("spec", ["2:4", "16:2:8"])
def test_compressed_mode_trains_values_only(spec):
    layer, variables = _init(spec)
    mask = fmt.select_mask(variables["params"]["kernel"], spec)
    x = _x()
    y_master = layer.apply({**variables, "sparsity": {"mask": mask}}, x)
    c_params, pattern = compress_variables(variables["params"], {"mask": mask}, spec)
    assert "kernel" not in c_params and c_params["values"].shape == (R, 2 * K // fmt.VNM.parse(spec).m)
    assert ("columns" in pattern) == (fmt.VNM.parse(spec).m > 4)
    c_layer = NMDense(R, sparsity=spec, compressed=True)
    y_c = c_layer.apply({"params": c_params, "sparsity": pattern}, x)
    np.testing.assert_allclose(y_c, y_master, rtol=1e-5, atol=1e-5)

    g_c = jax.grad(lambda p: (c_layer.apply({"params": p, "sparsity": pattern}, x) ** 2).sum())(c_params)
    g_m = jax.grad(lambda p: (layer.apply({"params": p, "sparsity": {"mask": mask}}, x) ** 2).sum())(variables["params"])
    assert g_c["values"].shape == c_params["values"].shape  # no dense [K, R] gradient leaves the layer
    sw = fmt.compress(variables["params"]["kernel"], mask, spec)
    np.testing.assert_allclose(g_c["values"], fmt.compress_like(g_m["kernel"], sw), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(g_c["bias"], g_m["bias"], rtol=1e-4, atol=1e-4)
    moments = compress_tree({"kernel": g_m["kernel"], "bias": g_m["bias"]}, {"mask": mask}, spec)
    np.testing.assert_allclose(moments["values"], g_c["values"], rtol=1e-4, atol=1e-4)


def test_compressed_init_obeys_pattern():
    layer = NMDense(R, sparsity="16:2:8", compressed=True)
    variables = layer.init(jax.random.key(3), _x())
    assert set(variables["params"]) == {"values", "bias"}
    sw = fmt.SparseWeight(variables["params"]["values"], variables["sparsity"]["columns"],
                          variables["sparsity"]["metadata"], (K, R), fmt.VNM.parse("16:2:8"))
    dense = fmt.decompress(sw)
    assert fmt.check_mask(dense != 0, "16:2:8")
    np.testing.assert_allclose(layer.apply(variables, _x()), _x() @ dense + variables["params"]["bias"], rtol=1e-5, atol=1e-5)


def test_bad_input_raises_naming_the_constraint():
    with pytest.raises(ValueError, match="N = 2"):
        NMDense(R, compressed=True).init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="N = 2"):
        NMDense(R, sparsity="4:8", compressed=True).init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="multiple of M"):
        NMDense(R, sparsity="2:4").init(jax.random.key(0), _x((2, 6)))
    layer, variables = _init()
    with pytest.raises(ValueError, match="mask shape"):
        layer.apply({**variables, "sparsity": {"mask": jnp.ones((R, K), bool)}}, _x())
    with pytest.raises(ValueError, match="compressed mode needs"):
        NMDense(R, sparsity="2:4", compressed=True).apply({"params": {"bias": jnp.zeros(R)}}, _x())
    with pytest.raises(ValueError, match="feature axis"):
        NMDense(R, sparsity="2:4").init(jax.random.key(0), jnp.ones(()))
    with pytest.raises(ValueError, match="features must be >= 1"):
        NMDense(0).init(jax.random.key(0), _x())
    with pytest.raises(ValueError, match="diagonal_blocks must be >= 1"):
        NMDense(R, sparsity="64:2:8", compressed=True, diagonal_blocks=0).init(jax.random.key(0), _x())


def test_mask_is_an_input_under_jit():
    layer, variables = _init()
    f = jax.jit(lambda v, x: layer.apply(v, x))
    x = _x()
    masks = [fmt.select_mask(variables["params"]["kernel"], s) for s in ("2:4", "16:2:8")]
    outs = [f({**variables, "sparsity": {"mask": m}}, x) for m in masks]
    for m, y in zip(masks, outs):
        np.testing.assert_allclose(y, x @ (variables["params"]["kernel"] * m) + variables["params"]["bias"], rtol=1e-5, atol=1e-5)
    assert f._cache_size() == 1  # same shapes: one trace serves every mask


PMAP_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    assert jax.local_device_count() == 2, jax.devices()
    from jaxsparse import format as fmt
    from jaxsparse.nn import NMDense
    from jaxsparse.pruning import gmp_prune, masks_of, model_variables
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return NMDense(32, sparsity="2:4", name="encoder_b")(nn.relu(NMDense(64, sparsity="2:4", name="encoder_a")(x)))

    net = Net()
    x = jax.random.normal(jax.random.key(0), (2, 8, 64))
    y = jax.random.normal(jax.random.key(1), (2, 8, 32))
    params = net.init(jax.random.key(2), x[0])["params"]
    tx = optax.chain(optax.adam(1e-2), gmp_prune("2:4", begin_step=2, end_step=2))
    state = tx.init(params)
    rep = lambda t: jax.tree.map(lambda a: jnp.stack([a, a]), t)
    p, s = rep(params), rep(state)

    def step(p, s, x, y):
        def loss(p):
            return ((net.apply(model_variables(p, s), x) - y) ** 2).mean()
        l, g = jax.value_and_grad(loss)(p)
        g = jax.lax.pmean(g, "d")
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, jax.lax.pmean(l, "d")

    pstep = jax.pmap(step, axis_name="d")
    for _ in range(4):
        p, s, l = pstep(p, s, x, y)
    masks = masks_of(s)
    for name in ("encoder_a", "encoder_b"):
        m = np.asarray(masks[name]["kernel"])
        assert (m[0] == m[1]).all(), "masks differ across devices"
        assert fmt.check_mask(m[0], "2:4") and m[0].mean() == 0.5
        k = np.asarray(p[name]["kernel"])
        assert (k[:, ~m[0]] == 0).all(), "pruned weights not zero"
    out = jax.pmap(lambda p, s, x: net.apply(model_variables(p, s), x))(p, s, x)
    single = net.apply(model_variables(jax.tree.map(lambda a: a[0], p), jax.tree.map(lambda a: a[0], s)), x[1])
    np.testing.assert_allclose(out[1], single, rtol=1e-5, atol=1e-5)
    print("PMAP-OK")
    """
)


def test_masks_through_pmap_two_host_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    script = tmp_path / "pmap_check.py"
    script.write_text(PMAP_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PMAP-OK" in proc.stdout, proc.stderr[-3000:]


def test_precision_and_spec_free_layers_apply_the_mask():
    x = _x()
    for layer in (NMDense(R, sparsity="2:4", precision=jax.lax.Precision.HIGHEST), NMDense(R)):
        variables = layer.init(jax.random.key(1), x)
        mask = fmt.select_mask(variables["params"]["kernel"], "2:4")
        y = layer.apply({**variables, "sparsity": {"mask": mask}}, x)
        expected = x @ (variables["params"]["kernel"] * mask) + variables["params"]["bias"]
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_diagonal_blocks_must_match_the_pattern():
    """A compressed layer of diagonal 2:4 blocks stands for V:2:M with ``M = 4 * diagonal_blocks``: another count, or
    a pattern without diagonal blocks, is a ``ValueError`` at init."""
    x = jnp.ones((2, 256), jnp.float32)
    NMDense(128, sparsity="64:2:8", compressed=True, diagonal_blocks=2).init(jax.random.key(0), x)
    for spec, blocks in (("64:2:8", 4), ("64:4:8", 2), ("2:4", 2)):
        with pytest.raises(ValueError):
            NMDense(128, sparsity=spec, compressed=True, diagonal_blocks=blocks).init(jax.random.key(0), x)


def test_return_operands_gives_the_compressed_weight_and_bias():
    """``return_operands``: the layer's ``(SparseWeight, bias)`` over the same parameters as the plain layer, whose
    product they give; a master-mode layer has none to give."""
    x = _x()
    plain = NMDense(R, sparsity="2:4", compressed=True, dtype=jnp.float32)
    variables = plain.init(jax.random.key(0), x)
    sw, bias = NMDense(R, sparsity="2:4", compressed=True, dtype=jnp.float32,
                       return_operands=True).apply(variables, jax.ShapeDtypeStruct(x.shape, x.dtype))
    np.testing.assert_allclose(ops.sparse_linear(x, sw, bias), plain.apply(variables, x), rtol=1e-6)
    with pytest.raises(ValueError, match="return_operands needs compressed=True"):
        NMDense(R, sparsity="2:4", return_operands=True).init(jax.random.key(0), x)

"""jaxsparse.nnx.NMLinear (the Flax NNX layer): nnx.Linear without a mask, the masked product with one, gmp_prune's
masks through nnx.Optimizer, and compressed training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxsparse import format as fmt
from jaxsparse import pruning
from jaxsparse.nnx import NMLinear, compress_model, set_masks

K, R = 64, 128


def _x(shape=(2, 5, K), seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def test_without_a_mask_it_is_nnx_linear():
    """No mask: values and gradients equal nnx.Linear's with the same parameters; dtype and param_dtype as there."""
    layer, dense = NMLinear(K, R, sparsity="64:2:8", rngs=nnx.Rngs(0)), nnx.Linear(K, R, rngs=nnx.Rngs(3))
    dense.kernel.set_value(layer.kernel.get_value())
    dense.bias.set_value(jax.random.normal(jax.random.key(7), (R,)))
    layer.bias.set_value(dense.bias.get_value())
    x = _x()
    np.testing.assert_allclose(layer(x), dense(x), rtol=1e-6, atol=1e-6)
    g = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(layer)
    gd = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(dense)
    np.testing.assert_allclose(g["kernel"].get_value(), gd["kernel"].get_value(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g["bias"].get_value(), gd["bias"].get_value(), rtol=1e-5, atol=1e-6)
    bf = NMLinear(K, R, dtype=jnp.bfloat16, use_bias=False, rngs=nnx.Rngs(0))
    assert bf(x).dtype == jnp.bfloat16 and bf.kernel.get_value().dtype == jnp.float32 and bf.bias is None


def test_with_a_mask_it_computes_the_masked_product():
    """A mask: y = x @ (W * mask) + b, and the kernel's gradient is zero off the mask."""
    layer = NMLinear(K, R, sparsity="64:2:8", rngs=nnx.Rngs(0))
    layer.bias.set_value(jax.random.normal(jax.random.key(7), (R,)))
    w = layer.kernel.get_value()
    mask = fmt.select_mask(w, "64:2:8")
    layer.set_mask(mask)
    x = _x()
    want = x @ jnp.where(mask, w, 0.0) + layer.bias.get_value()
    np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)
    g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)["kernel"].get_value()
    g_ref = jax.grad(lambda k: jnp.sum((x @ jnp.where(mask, k, 0.0) + layer.bias.get_value()) ** 2))(w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(jnp.where(mask, 0.0, g)).max()) == 0.0
    layer.set_mask(None)
    np.testing.assert_allclose(layer(x), x @ w + layer.bias.get_value(), rtol=1e-5, atol=1e-5)


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.encoder_in = NMLinear(K, R, sparsity="64:2:8", rngs=rngs)
        self.head = nnx.Linear(R, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.encoder_in(x)))


def test_gmp_prune_through_nnx_optimizer_then_compressed_training():
    """gmp_prune in an nnx.Optimizer: the schedule's sparsity at each step, every mask valid for its stage, pruned
    weights exactly zero, the loss falls; compress() then keeps the function and training goes on on the values."""
    model = _Net(nnx.Rngs(0))
    tx = optax.chain(optax.adam(1e-2), pruning.gmp_prune("64:2:8", 0, 4))  # 2:4 at step 2, 64:2:8 at step 4
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = _x((64, K))
    y = jax.random.randint(jax.random.key(2), (64,), 0, 3)

    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    losses, density = [], []
    for _ in range(12):
        losses.append(float(step(model, optimizer)))
        assert set_masks(model, pruning.masks_of(optimizer.opt_state)) == 1
        layer = model.encoder_in
        mask, w = layer.mask.get_value(), layer.kernel.get_value()
        density.append(float(mask.mean()))
        assert float(jnp.abs(jnp.where(mask, 0.0, w)).max()) == 0.0  # pruned weights stay zero
        assert model.head.kernel.get_value().shape == (R, 3)  # the head is not pruned
    assert density[:2] == [1.0, 1.0] and density[2:4] == [0.5, 0.5] and density[4:] == [0.25] * 8, density
    assert bool(fmt.mask_is_valid(model.encoder_in.mask.get_value(), "64:2:8"))
    assert losses[-1] < losses[0], losses
    before = model(x)
    mask = model.encoder_in.mask.get_value()
    adam = optimizer.opt_state[0][0]  # the chain's adam state: ScaleByAdamState(count, mu, nu)
    old_nu = adam.nu["encoder_in"]["kernel"].get_value()
    old_head_mu = adam.mu["head"]["kernel"].get_value()
    assert float(jnp.abs(old_nu).min()) < float(jnp.abs(old_nu).max())  # moments that a wrong gather would show
    optimizer = compress_model(model, optax.adam(1e-2), optimizer.opt_state[0])
    layer = model.encoder_in
    assert layer.compressed and layer.kernel is None and layer.mask is None
    assert layer.values.get_value().shape == (R, 2 * K // 8) and layer.columns.get_value().shape == (R // 64, K // 8, 4)
    np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)
    assert [v.shape for v in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))].count((R, 2 * K // 8)) == 1
    # Adam's moments and count carried over: the layer's gathered into the values layout, the head's copied.
    carried = optimizer.opt_state[0]
    assert int(carried.count.get_value()) == 12
    np.testing.assert_array_equal(carried.nu["encoder_in"]["values"].get_value(),
                                  fmt.compress(old_nu, mask, "64:2:8").values)
    np.testing.assert_array_equal(carried.mu["head"]["kernel"].get_value(), old_head_mu)
    after = [float(step(model, optimizer)) for _ in range(4)]
    assert np.isfinite(after).all() and after[-1] < after[0], after


def test_rejects():
    """Shapes and states the layer cannot take raise ValueError naming the constraint."""
    with pytest.raises(ValueError, match="multiple of M"):
        NMLinear(60, R, sparsity="64:2:8", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="multiple of V"):
        NMLinear(K, 96, sparsity="64:2:8", rngs=nnx.Rngs(0))
    layer = NMLinear(K, R, sparsity="64:2:8", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        layer(_x((2, K + 8)))
    with pytest.raises(ValueError, match="mask shape"):
        layer.set_mask(jnp.ones((R, K), bool))
    with pytest.raises(ValueError, match="needs a sparsity pattern and a mask"):
        layer.compress()
    layer.set_mask(fmt.select_mask(layer.kernel.get_value(), "2:4"))  # an earlier ladder stage
    with pytest.raises(ValueError, match="does not obey 64:2:8"):
        layer.compress()
    layer.set_mask(fmt.select_mask(layer.kernel.get_value(), "64:2:8"))
    layer.compress()
    with pytest.raises(ValueError, match="already compressed"):
        layer.compress()
    with pytest.raises(ValueError, match="compressed"):
        layer.set_mask(None)
    with pytest.raises(ValueError, match="no master-mode NMLinear at missing"):
        set_masks(_Net(nnx.Rngs(0)), {"missing": {"kernel": jnp.ones((K, R), bool)}})


def test_compress_model_rejects_a_state_that_is_not_tx_s():
    """compress_model carries only the state of the optimizer it makes: a chain's whole state, or a state
    without tx, raises ValueError naming what to pass."""
    def masked_net():
        net = _Net(nnx.Rngs(0))
        net.encoder_in.set_mask(fmt.select_mask(net.encoder_in.kernel.get_value(), "64:2:8"))
        return net

    net = masked_net()
    chain = nnx.Optimizer(net, optax.chain(optax.adam(1e-2), optax.identity()), wrt=nnx.Param)
    with pytest.raises(ValueError, match="give tx"):
        compress_model(masked_net(), opt_state=chain.opt_state[0])
    with pytest.raises(ValueError, match=r"opt_state\[0\] of a chain"):
        compress_model(net, optax.adam(1e-2), chain.opt_state)
    assert not net.encoder_in.compressed  # refused before any layer changed
    wrong = jax.tree_util.tree_map(lambda a: a[..., :1] if a.ndim == 2 else a, chain.opt_state[0])
    with pytest.raises(ValueError, match="has shape"):
        compress_model(net, optax.adam(1e-2), wrong)
    assert not net.encoder_in.compressed
    net = masked_net()
    assert compress_model(net) is None and net.encoder_in.compressed and net.head.kernel is not None

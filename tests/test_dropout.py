"""jaxsparse.dropout: hash_dropout's mask statistics, determinism, gradient and errors; HashDropout in BERT."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse.dropout import MAX_ELEMENTS, HashDropout, hash_dropout, keep_mask, seed_words
from jaxsparse.models import bert


def _mask(key, shape, rate):
    return np.asarray(keep_mask(seed_words(key), shape, 1.0 - rate))


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_and_spread(rate):
    """The kept fraction is 1 - rate within 5 binomial standard deviations, and the counts of kept elements per row
    and per column spread as binomial counts do (a hash that repeats along an axis would not)."""
    rows, cols = 1024, 1024
    m = _mask(jax.random.key(7, impl="rbg"), (rows, cols), rate)
    keep = 1.0 - rate
    sd = np.sqrt(keep * rate / m.size)
    assert abs(m.mean() - keep) < 5 * sd, (m.mean(), keep)
    for counts, n in ((m.sum(1), cols), (m.sum(0), rows)):
        expected_sd = np.sqrt(n * keep * rate)
        assert abs(counts.mean() - n * keep) < 5 * expected_sd / np.sqrt(len(counts))
        assert 0.8 < counts.std() / expected_sd < 1.2, (counts.std(), expected_sd)


def test_neighbours_are_independent():
    """P(keep next | keep this) is the keep probability, along both axes (within 5 standard deviations)."""
    m = _mask(jax.random.key(3), (512, 2048), 0.5)
    for a, b in ((m[:, :-1], m[:, 1:]), (m[:-1], m[1:])):
        both = (a & b).mean() / a.mean()
        assert abs(both - 0.5) < 5 * np.sqrt(0.25 / a.sum()), both


def test_deterministic_per_key_and_independent_across_keys():
    """The same key gives the same mask; keys folded from one root give masks that overlap as independent draws
    do (keep**2 of the elements kept in both)."""
    root = jax.random.key(0, impl="rbg")
    shape, rate = (256, 1024), 0.1
    a = _mask(jax.random.fold_in(root, 1), shape, rate)
    np.testing.assert_array_equal(a, _mask(jax.random.fold_in(root, 1), shape, rate))
    for other in (jax.random.fold_in(root, 2), jax.random.fold_in(jax.random.fold_in(root, 1), 0)):
        b = _mask(other, shape, rate)
        assert not np.array_equal(a, b)
        both, expected = (a & b).mean(), 0.9 * 0.9
        assert abs(both - expected) < 5 * np.sqrt(expected * (1 - expected) / a.size), both


def test_masks_of_consecutive_steps_are_uncorrelated():
    """The masks of 24 steps' keys (``fold_in(root, step)``, as a training loop makes them): every pair's correlation
    and every mask's kept fraction within 5 standard deviations of independent draws (276 pairs: a max |z| near 3
    is what independence gives), and no mask a shifted copy of another for shifts up to 512."""
    root = jax.random.key(0, impl="rbg")
    shape, keep = (128, 1024), 0.9
    draw = jax.jit(lambda k: keep_mask(seed_words(k), shape, keep))
    ms = np.stack([np.asarray(draw(jax.random.fold_in(root, t))).ravel() for t in range(24)]).astype(np.float64)
    n, sd = ms.shape[1], np.sqrt(keep * (1 - keep))
    assert np.abs((ms.mean(1) - keep) / (sd / np.sqrt(n))).max() < 5
    c = (ms - ms.mean(1, keepdims=True)) / sd
    z = (c @ c.T / n)[np.triu_indices(len(ms), 1)] * np.sqrt(n)
    assert np.abs(z).max() < 5, np.abs(z).max()
    shifted = max(abs(np.dot(c[0, s:], c[1, :n - s])) / (n - s) for s in range(1, 513))
    assert shifted * np.sqrt(n) < 5.5, shifted


@pytest.mark.parametrize("key", [jax.random.PRNGKey(5), jax.random.key(5), jax.random.key(5, impl="rbg"),
                                 jax.random.key(5, impl="unsafe_rbg")], ids=["raw", "threefry", "rbg", "unsafe_rbg"])
def test_forward_and_gradient_share_the_mask(key):
    """Under jit: kept elements are x / keep_prob, dropped ones 0, and the gradient is the upstream gradient under
    the same mask (recomputed from the key in the backward), for every key implementation."""
    x = jax.random.normal(jax.random.key(1), (64, 96), jnp.float32) + 3.0  # no zeros among the inputs
    g = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    rate = 0.25

    @jax.jit
    def f(x):
        y, vjp = jax.vjp(lambda x: hash_dropout(key, x, rate), x)
        return y, vjp(g)[0]

    y, dx = map(np.asarray, f(x))
    kept = y != 0
    assert 0.6 < kept.mean() < 0.9
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(dx != 0, kept)
    np.testing.assert_allclose(dx[kept], np.asarray(g)[kept] / 0.75, rtol=1e-6)


def test_bf16_scales_like_flax():
    """bf16 inputs are divided by keep_prob in bf16, as flax.linen.Dropout does."""
    x = jnp.full((4, 64), 1.5, jnp.bfloat16)
    y = np.asarray(hash_dropout(jax.random.key(0), x, 0.1).astype(jnp.float32))
    expected = float((jnp.bfloat16(1.5) / jnp.asarray(0.9, jnp.bfloat16)).astype(jnp.float32))
    assert set(np.unique(y)) == {0.0, expected}


def test_edge_rates_and_errors():
    key = jax.random.key(0)
    x = jnp.arange(1.0, 7.0)
    np.testing.assert_array_equal(hash_dropout(key, x, 0.0), x)
    np.testing.assert_array_equal(hash_dropout(key, x, 1.0), jnp.zeros_like(x))
    np.testing.assert_array_equal(jax.grad(lambda x: hash_dropout(key, x, 1.0).sum())(x), jnp.zeros_like(x))
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"rate must be in \[0, 1\]"):
            hash_dropout(key, x, rate)
    with pytest.raises(ValueError, match="floating"):
        hash_dropout(key, jnp.arange(6), 0.1)
    with pytest.raises(ValueError, match="one key"):
        hash_dropout(jax.random.split(key, 2), x, 0.1)
    with pytest.raises(ValueError, match="uint32 key"):
        hash_dropout(jnp.arange(2), x, 0.1)
    with pytest.raises(ValueError, match="2\\*\\*32 elements"):
        keep_mask(seed_words(key), (2**16, 2**16 + 1), 0.9)
    assert MAX_ELEMENTS == 2**32


def test_module_uses_the_dropout_stream():
    """HashDropout: identity when deterministic; otherwise hash_dropout with the key flax's make_rng gives."""
    x = jax.random.normal(jax.random.key(0), (8, 128)) + 3.0
    mod = HashDropout(0.2)
    np.testing.assert_array_equal(mod.apply({}, x, deterministic=True), x)
    y = mod.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(4)})
    kept = np.asarray(y) != 0
    assert 0.6 < kept.mean() < 0.95
    assert not np.array_equal(kept, np.asarray(mod.apply({}, x, deterministic=False,
                                                         rngs={"dropout": jax.random.key(5)})) != 0)
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\]"):
        HashDropout(1.5).apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(4)})
    # the attribute form and an explicit key, as flax's Dropout takes them
    np.testing.assert_array_equal(HashDropout(0.2, deterministic=True).apply({}, x), x)
    np.testing.assert_array_equal(HashDropout(0.2).apply({}, x, deterministic=False, rng=jax.random.key(9)),
                                  hash_dropout(jax.random.key(9), x, 0.2))


def test_bert_dropout_impl():
    """BertConfig(dropout_impl="hash"), the default, trains with no random-bit generator in the step's HLO (flax's dropout
    has one per dropout) and keeps the rate; an unknown name is a ValueError."""
    with pytest.raises(ValueError, match="dropout_impl must be one of"):
        bert.BertConfig.preset("tiny", dropout_impl="philox")
    ids = jnp.ones((2, 16), jnp.int32)
    hlo = {}
    for impl in bert.DROPOUT_IMPLS:
        cfg = bert.BertConfig.preset("tiny", dropout_impl=impl, num_hidden_layers=1)
        model = bert.BertForSequenceClassification(cfg, num_labels=2)
        params = jax.jit(model.init)(jax.random.key(0), ids)
        rngs = {"dropout": jax.random.key(1, impl="rbg")}

        def loss(p):
            return model.apply(p, ids, deterministic=False, rngs=rngs).sum()

        grad = jax.jit(jax.grad(loss))
        hlo[impl] = grad.lower(params).as_text()
        assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(grad(params)))
        train, test = jax.jit(lambda p: (model.apply(p, ids, deterministic=False, rngs=rngs),
                                         model.apply(p, ids, deterministic=True)))(params)
        assert not np.allclose(train, test)
    assert "rng_bit_generator" in hlo["rng"]
    assert "rng_bit_generator" not in hlo["hash"]
    assert isinstance(bert.dropout_layer(bert.BertConfig.preset("tiny"), 0.1), HashDropout)  # the default
    assert isinstance(bert.dropout_layer(bert.BertConfig.preset("tiny", dropout_impl="rng"), 0.1), nn.Dropout)


def _buffer_types(compiled_text: str) -> list[str]:
    """The result types of the instructions that own buffers in an optimized HLO module's text: those of every
    computation but the fusions' bodies (the ENTRY computation's and, on a GPU, its command buffers'), each array of
    a tuple result on its own."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", compiled_text))
    types, keep = [], False
    for line in compiled_text.split("\n"):
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if head:
            keep = head.group(1) not in fused
            continue
        m = re.match(r"^\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) ", line)
        if keep and m:
            types += re.findall(r"\w+\[[\d,]*\]", m.group(1))
    return types


def test_no_random_words_in_memory():
    """Compiled by XLA (this backend), a dropout between a product and a residual sum, with its gradient: with
    hash_dropout no 32-bit integer array of the activation's size is a buffer of the step (the hash is computed
    inside fusions, in the forward and again in the backward); flax's dropout writes its random words as one. XLA:CPU
    fuses the keep bits into their users; XLA:GPU writes them as a boolean buffer (one byte an element, session 42),
    which this test allows."""
    key = jax.random.key(1, impl="rbg")
    x, w = jnp.ones((16, 64, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)

    def loss(drop):
        def f(x, w):
            y = drop(x @ w) + x
            return ((y - y.mean(-1, keepdims=True)) ** 2).sum()
        return f

    def big_integer_buffers(drop):
        text = jax.jit(jax.grad(loss(drop), argnums=(0, 1))).lower(x, w).compile().as_text()
        sizes = [np.prod([int(d) for d in dims.split(",") if d]) for kind, dims in
                 re.findall(r"^(u32|s32)\[([\d,]*)\]", "\n".join(_buffer_types(text)), flags=re.M)]
        return [s for s in sizes if s >= x.size // 4]

    assert big_integer_buffers(lambda y: hash_dropout(key, y, 0.1)) == []
    assert big_integer_buffers(lambda y: nn.Dropout(0.1).apply({}, y, deterministic=False, rngs={"dropout": key}))

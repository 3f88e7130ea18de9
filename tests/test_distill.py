"""The distillation losses and the unlabelled batch variants (``jaxsparse.distill``), against direct formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsparse.distill import (attention_distill_loss, augment_tokens, hidden_distill_loss, loss_fn,
                               token_neighbors)


def test_distillation_loss():
    logits = jax.random.normal(jax.random.key(0), (6, 3))
    labels = jnp.array([0, 1, 2, 0, 1, 2])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    assert loss_fn(logits, labels) == pytest.approx(float(ce))
    # A student equal to its teacher pays no soft term; a different teacher raises the loss.
    assert loss_fn(logits, labels, logits, 0.7, 2.0) == pytest.approx(0.3 * float(ce), rel=1e-5)
    other = logits[::-1]
    assert loss_fn(logits, labels, other, 0.7, 2.0) > 0.3 * float(ce) + 1e-3
    g = jax.grad(lambda s: loss_fn(s, labels, other, 1e-9 + 0.5, 3.0))(logits)
    assert np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).sum()) > 0


def test_hidden_distill_loss():
    rng = np.random.default_rng(0)
    s = [jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32) for _ in range(3)]
    t = [jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32) for _ in range(3)]
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    m = np.asarray(mask, bool)
    want = np.mean([((np.asarray(a) - np.asarray(b)) ** 2)[m].mean() for a, b in zip(s, t)])
    assert float(hidden_distill_loss(s, t, mask)) == pytest.approx(want, rel=1e-5)
    assert float(hidden_distill_loss(s, s, mask)) == 0.0
    # Padding does not count: changing the student's padded positions leaves the loss unchanged.
    s2 = [a.at[0, 3:].set(100.0) for a in s]
    assert float(hidden_distill_loss(s2, t, mask)) == pytest.approx(want, rel=1e-5)
    # Only the student gets a gradient.
    gs, gt = jax.grad(lambda a, b: hidden_distill_loss(a, b, mask), argnums=(0, 1))(s, t)
    assert all(float(jnp.abs(g).sum()) > 0 for g in gs) and all(float(jnp.abs(g).sum()) == 0 for g in gt)
    with pytest.raises(ValueError, match="as many student as teacher layers"):
        hidden_distill_loss(s[:2], t, mask)


def test_attention_distill_loss():
    rng = np.random.default_rng(1)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    bias = np.where(mask[:, None, None, :] > 0, 0.0, -1e9)  # as BertModel adds it to the scores
    s = [jnp.asarray(rng.standard_normal((2, 3, 5, 5)) + bias, jnp.float32) for _ in range(2)]
    t = [jnp.asarray(2.0 * rng.standard_normal((2, 3, 5, 5)) + bias, jnp.float32) for _ in range(2)]

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def reference(s_layers, t_layers):
        per_layer = []
        for a, b in zip(s_layers, t_layers):
            ps, pt = softmax(np.asarray(a, np.float64)), softmax(np.asarray(b, np.float64))
            kl = (pt * (np.log(np.maximum(pt, 1e-300)) - np.log(np.maximum(ps, 1e-300)))).sum(-1)  # [B, heads, T]
            per_layer.append(kl.transpose(0, 2, 1)[mask > 0].mean())  # over real queries and heads
        return np.mean(per_layer)

    want = reference(s, t)
    assert want > 0.05
    assert float(attention_distill_loss(s, t, jnp.asarray(mask))) == pytest.approx(want, rel=1e-5)
    assert float(attention_distill_loss(s, s, jnp.asarray(mask))) == pytest.approx(0.0, abs=1e-6)
    # Padded queries do not count: changing the student's rows there leaves the loss unchanged.
    s2 = [a.at[0, :, 3:, :3].set(50.0) for a in s]
    assert float(attention_distill_loss(s2, t, jnp.asarray(mask))) == pytest.approx(want, rel=1e-5)
    # Only the student gets a gradient, and it is finite despite the -1e9 padding bias.
    gs, gt = jax.grad(lambda a, b: attention_distill_loss(a, b, jnp.asarray(mask)), argnums=(0, 1))(s, t)
    assert all(np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).sum()) > 0 for g in gs)
    assert all(float(jnp.abs(g).sum()) == 0 for g in gt)
    with pytest.raises(ValueError, match="as many student as teacher layers"):
        attention_distill_loss(s[:1], t, jnp.asarray(mask))


def test_augment_tokens_replaces_only_inner_real_tokens_from_the_batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1000, 30000, (64, 40)), jnp.int32)
    mask = np.ones((64, 40), np.int32)
    lengths = rng.integers(3, 41, 64)
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
    mask[5, 2:] = 0  # a row of [CLS] [SEP] only: nothing eligible
    out = np.asarray(augment_tokens(jax.random.key(7), ids, jnp.asarray(mask), 0.3))
    ids_np = np.asarray(ids)
    eligible = np.zeros_like(mask, bool)
    for i in range(64):
        n = int(mask[i].sum())
        eligible[i, 1:n - 1] = True
    changed = out != ids_np
    assert not changed[~eligible].any()  # [CLS], [SEP], padding and the short row untouched
    rate = changed[eligible].mean()
    assert 0.25 < rate < 0.35, rate  # ~0.3 (a draw of the same value counts as unchanged)
    assert set(out[changed].tolist()) <= set(ids_np[eligible].tolist())  # replacements come from the batch
    assert (np.asarray(augment_tokens(jax.random.key(7), ids, jnp.asarray(mask), 0.0)) == ids_np).all()
    other = np.asarray(augment_tokens(jax.random.key(8), ids, jnp.asarray(mask), 0.3))
    assert (other != out).any()  # the key decides the copy


def test_token_neighbors_against_brute_force():
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(50, 8)).astype(np.float32)
    ids = rng.integers(0, 30, (6, 12)).astype(np.int32)  # word pieces 30..49 never occur
    mask = np.ones_like(ids)
    mask[2, 7:] = 0
    inner = np.zeros(ids.shape, bool)
    for i in range(6):
        inner[i, 1:int(mask[i].sum()) - 1] = True
    cand = np.unique(ids[inner])
    out = token_neighbors(emb, ids, mask, 3, chunk=4)  # several chunks, the last one short
    assert out.shape == (50, 3) and out.dtype == np.int32
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    for t in range(50):
        if t in cand:
            sim = unit[cand] @ unit[t]
            sim[cand == t] = -np.inf
            assert list(out[t]) == list(cand[np.argsort(-sim)[:3]]), t
        else:  # not an inner token of the data: kept as it is
            assert (out[t] == t).all(), t
    with pytest.raises(ValueError, match="1 <= k < candidates"):
        token_neighbors(emb, ids, mask, len(cand))
    with pytest.raises(ValueError, match="token ids must lie"):
        token_neighbors(emb[:10], ids, mask, 2)


def test_augment_tokens_with_neighbors_replaces_by_a_neighbor():
    rng = np.random.default_rng(1)
    vocab = 40
    neighbors = np.stack([(np.arange(vocab) + d) % vocab for d in (1, 2, 3)], axis=1).astype(np.int32)
    ids = rng.integers(0, vocab, (32, 20)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, 15:] = 0
    out = np.asarray(augment_tokens(jax.random.key(2), jnp.asarray(ids), jnp.asarray(mask), 0.4,
                                          jnp.asarray(neighbors)))
    changed = out != ids
    inner = np.zeros(ids.shape, bool)
    inner[:, 1:14] = True
    assert not changed[~inner].any()
    assert 0.34 < changed[inner].mean() < 0.46, changed[inner].mean()  # neighbours differ from the token
    assert all(out[i, j] in neighbors[ids[i, j]] for i, j in zip(*np.nonzero(changed)))
    picks = (out[changed] - ids[changed]) % vocab
    assert set(picks.tolist()) == {1, 2, 3}  # every neighbour slot is drawn

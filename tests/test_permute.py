"""Channel permutations of the BERT encoder: the function is unchanged, the mask keeps more."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import format as fmt, permute
from jaxsparse.models import bert

CFG = bert.BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                      intermediate_size=256, max_position_embeddings=32)
HEADS = CFG.num_attention_heads


def _ids(b=2, t=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 1, CFG.vocab_size)


def _random_params(model, seed=0):
    """Init, then every leaf random (biases and LayerNorm too), so a permutation that misses one shows."""
    params = model.init(jax.random.key(seed), _ids())["params"]
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _random_perms(params, rng):
    d = CFG.hidden_size // HEADS
    out = {}
    for name in permute.encoder_layer_names(params):
        heads = rng.permutation(HEADS)
        attn = np.concatenate([h * d + rng.permutation(d) for h in heads])
        out[name] = permute.LayerPermutation(ffn=rng.permutation(CFG.intermediate_size), attention=attn)
    return out


def _mask_attention():
    return jnp.asarray([[1] * 12, [1] * 7 + [0] * 5])


def test_random_permutations_preserve_the_function():
    model = bert.BertModel(CFG, add_pooler=False)
    params = _random_params(model)
    perms = _random_perms(params, np.random.default_rng(0))
    new = permute.apply_permutations(params, perms, num_heads=HEADS)
    changed = jax.tree_util.tree_map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), params, new)
    assert sum(jax.tree_util.tree_leaves(changed)) == 3 * 10  # Q/K/V/FFN-in kernels and biases, both output kernels
    ids, mask = _ids(), _mask_attention()
    h0, _ = model.apply({"params": params}, ids, attention_mask=mask)
    h1, _ = model.apply({"params": new}, ids, attention_mask=mask)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), atol=1e-5, rtol=1e-5)


def test_searched_permutations_are_valid_preserve_the_classifier_and_raise_the_objective():
    model = bert.BertForSequenceClassification(CFG, num_labels=3)
    params = _random_params(model, seed=3)
    perms = permute.search_permutations(params, "64:2:8", num_heads=HEADS, iters=4, batch=64)
    assert set(perms) == {f"encoder_layer_{i}" for i in range(CFG.num_hidden_layers)}
    d = CFG.hidden_size // HEADS
    for p in perms.values():
        assert np.array_equal(np.sort(p.ffn), np.arange(CFG.intermediate_size))
        assert np.array_equal(np.sort(p.attention), np.arange(CFG.hidden_size))
        heads = p.attention.reshape(HEADS, d) // d
        assert (heads == heads[:, :1]).all()
    new = permute.apply_permutations(params, perms, num_heads=HEADS)
    ids, mask = _ids(), _mask_attention()
    np.testing.assert_allclose(np.asarray(model.apply({"params": new}, ids, attention_mask=mask)),
                               np.asarray(model.apply({"params": params}, ids, attention_mask=mask)),
                               atol=1e-5, rtol=1e-5)
    before = permute.permutation_objective(params, "64:2:8", num_heads=HEADS)
    after = permute.permutation_objective(params, "64:2:8", perms, num_heads=HEADS)
    assert after["total"] >= before["total"] * (1 - 1e-6)
    for i in range(CFG.num_hidden_layers):  # per layer, what each permutation touches, never lower
        ffn = [f"encoder_layer_{i}/{m}" for m in ("intermediate", "output")]
        att = [f"encoder_layer_{i}/attention/{m}" for m in ("query", "key", "value", "output")]
        for group in (ffn, att):
            assert sum(after[k] for k in group) >= sum(before[k] for k in group) * (1 - 1e-6)
    # The objective is select_mask's: the kept squared magnitude of its mask on the permuted kernel.
    w = np.asarray(new["bert"]["encoder_layer_0"]["intermediate"]["kernel"])
    kept = float((w**2 * np.asarray(fmt.select_mask(w**2, "64:2:8"))).sum())
    np.testing.assert_allclose(after["encoder_layer_0/intermediate"], kept, rtol=1e-5)


def _structured_ffn(rng):
    """FFN units of 4 kinds interleaved: kind k is large at inputs 2k, 2k+1 of every group of 8 only, so a
    64-unit block with all kinds keeps half of them, and blocks of two kinds keep all."""
    k, n = CFG.hidden_size, CFG.intermediate_size
    w = 0.01 * rng.standard_normal((k, n)).astype(np.float32)
    for u in range(n):
        kind = u % 4
        for g in range(k // 8):
            w[g * 8 + 2 * kind: g * 8 + 2 * kind + 2, u] += 1.0 + 0.1 * rng.standard_normal(2)
    return w


def test_search_finds_a_better_grouping_when_one_exists():
    model = bert.BertModel(CFG, add_pooler=False)
    params = _random_params(model, seed=5)
    rng = np.random.default_rng(1)
    layer = dict(params["encoder_layer_0"])
    layer["intermediate"] = {**layer["intermediate"], "kernel": jnp.asarray(_structured_ffn(rng))}
    params = {**params, "encoder_layer_0": layer}
    perms = permute.search_permutations(params, "64:2:8", num_heads=HEADS, iters=2, batch=32,
                                        layers=["encoder_layer_0"])
    assert np.array_equal(perms["encoder_layer_1"].ffn, np.arange(CFG.intermediate_size))  # not searched
    before = permute.permutation_objective(params, "64:2:8", num_heads=HEADS)
    after = permute.permutation_objective(params, "64:2:8", perms, num_heads=HEADS)
    w = np.asarray(layer["intermediate"]["kernel"])
    assert before["encoder_layer_0/intermediate"] < 0.6 * (w**2).sum()
    assert after["encoder_layer_0/intermediate"] > 0.95 * (w**2).sum()
    kinds = perms["encoder_layer_0"].ffn.reshape(-1, 64) % 4
    assert all(len(set(b.tolist())) <= 2 for b in kinds)  # 4 blocks: at most 2 kinds (4 columns) each


def test_bad_inputs_raise():
    model = bert.BertModel(CFG, add_pooler=False)
    params = _random_params(model)
    with pytest.raises(ValueError, match="N <= 2"):
        permute.search_permutations(params, "64:4:8", num_heads=HEADS)
    with pytest.raises(ValueError, match="multiple of V"):
        permute.search_permutations(params, "256:2:8", num_heads=HEADS)
    with pytest.raises(ValueError, match="num_heads"):
        permute.search_permutations(params, "64:2:8", num_heads=3)
    with pytest.raises(ValueError, match="iters"):
        permute.search_permutations(params, "64:2:8", num_heads=HEADS, iters=-1)
    with pytest.raises(ValueError, match="encoder_layer"):
        permute.search_permutations({"embeddings": {}}, "64:2:8", num_heads=HEADS)
    ident = permute.identity_permutations(params)
    name = "encoder_layer_0"
    bad = {name: dataclasses.replace(ident[name], ffn=np.zeros(CFG.intermediate_size, np.int64))}
    with pytest.raises(ValueError, match="permutation"):
        permute.apply_permutations(params, bad, num_heads=HEADS)
    split = np.arange(CFG.hidden_size)
    split[[0, 40]] = split[[40, 0]]  # dimension 0 of head 0 swapped with one of head 1: not a head permutation
    with pytest.raises(ValueError, match="head"):
        permute.apply_permutations(params, {name: dataclasses.replace(ident[name], attention=split)}, num_heads=HEADS)
    with pytest.raises(ValueError, match="not an encoder layer"):
        permute.apply_permutations(params, {"encoder_layer_9": ident[name]}, num_heads=HEADS)
    with pytest.raises(ValueError, match="score"):
        permute.search_permutations(params, "64:2:8", num_heads=HEADS, score={"x": 1})

"""Second-order one-shot pieces: input Hessian, OBS scores, least-squares refit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import format as fmt, obs


def _data(k=32, r=64, n=400, seed=0):
    rng = np.random.default_rng(seed)
    # Correlated, unevenly scaled inputs: refit has something to recover.
    mix = rng.normal(size=(k, k)) * 0.3 + np.eye(k)
    x = (rng.normal(size=(n, k)) @ mix * rng.uniform(0.2, 3.0, size=k)).astype(np.float32)
    w = rng.normal(size=(k, r)).astype(np.float32)
    return x, w


def _lstsq_refit(x, w, mask):
    out = np.zeros_like(w, dtype=np.float64)
    for r in range(w.shape[1]):
        s = np.nonzero(mask[:, r])[0]
        sol, *_ = np.linalg.lstsq(x[:, s].astype(np.float64), x.astype(np.float64) @ w[:, r], rcond=None)
        out[s, r] = sol
    return out


def test_input_hessian_matches_definition():
    x, _ = _data()
    h = obs.input_hessian(x.reshape(8, 50, -1))
    np.testing.assert_allclose(h, x.T @ x / len(x), rtol=1e-4, atol=1e-4)
    weights = (np.arange(400) % 3 != 0).astype(np.float32).reshape(8, 50)
    hw = obs.input_hessian(x.reshape(8, 50, -1), weights)
    keep = x[weights.reshape(-1) > 0]
    np.testing.assert_allclose(hw, keep.T @ keep / len(keep), rtol=1e-4, atol=1e-4)
    assert h.dtype == jnp.float32 and h.shape == (32, 32)


def test_damp_and_inverse_diag():
    x, _ = _data()
    h = obs.input_hessian(x)
    hd = obs.damp_hessian(h, 0.1)
    np.testing.assert_allclose(np.diag(hd) - np.diag(h), 0.1 * np.mean(np.diag(h)), rtol=1e-4)
    d = obs.hessian_inverse_diag(h, 0.1)
    np.testing.assert_allclose(d, np.diag(np.linalg.inv(np.asarray(hd, np.float64))), rtol=1e-4)


@pytest.mark.parametrize("pattern", ["2:4", "8:2:8", "16:2:16"])
def test_refit_reaches_least_squares_optimum(pattern):
    x, w = _data(k=32, r=32)
    h = obs.input_hessian(x)
    mask = np.asarray(fmt.select_mask(w, pattern))
    w_new = np.asarray(obs.refit(w, mask, h, damp=0.0))
    expect = _lstsq_refit(x, w, mask)
    np.testing.assert_allclose(w_new, expect, rtol=2e-3, atol=2e-3)
    assert np.all(w_new[~mask] == 0)


@pytest.mark.parametrize("damp", [0.0, 0.01, 0.1])
@pytest.mark.parametrize("pattern", ["2:4", "16:2:8"])
def test_refit_never_worse_than_masking(pattern, damp):
    x, w = _data(k=64, r=64, seed=1)
    h = obs.input_hessian(x)
    mask = np.asarray(fmt.select_mask(w, pattern))
    w_new = obs.refit(w, mask, h, damp=damp)
    masked = np.where(mask, w, 0)
    e_mask = obs.reconstruction_error(w, masked, h)
    e_refit = obs.reconstruction_error(w, w_new, h)
    assert e_refit <= e_mask * (1 + 1e-5)
    if damp == 0.0:
        assert e_refit < 0.9 * e_mask  # correlated inputs: the refit recovers a real share
    # Per row too (each output is solved on its own).
    d_mask, d_refit = w - masked, w - np.asarray(w_new, np.float64)
    h64 = np.asarray(h, np.float64)
    per_mask = np.einsum("kr,kj,jr->r", d_mask, h64, d_mask)
    per_refit = np.einsum("kr,kj,jr->r", d_refit, h64, d_refit)
    assert np.all(per_refit <= per_mask * (1 + 1e-4) + 1e-6)
    assert np.all(np.asarray(w_new)[~mask] == 0)


def test_refit_uneven_rows_and_dtype():
    x, w = _data(k=16, r=8)
    h = obs.input_hessian(x)
    rng = np.random.default_rng(3)
    mask = rng.random((16, 8)) < 0.4
    mask[:, 0] = False  # a row keeping nothing
    out = obs.refit(jnp.asarray(w, jnp.bfloat16), mask, h, damp=0.0)
    assert out.dtype == jnp.bfloat16 and out.shape == w.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), _lstsq_refit(x, w, mask), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(out, np.float32)[~mask] == 0)
    # chunking does not change the answer
    np.testing.assert_allclose(obs.refit(w, mask, h, damp=0.0, chunk=1), obs.refit(w, mask, h, damp=0.0), rtol=1e-5, atol=1e-6)


def test_obs_scores_identity_is_magnitude():
    _, w = _data(k=64, r=128)
    s = obs.obs_scores(w, np.ones(64, np.float32))
    np.testing.assert_allclose(s, w.astype(np.float32) ** 2, rtol=1e-6)
    for pattern in ("2:4", "2:8"):  # per-row top-n: the same order as |w|
        np.testing.assert_array_equal(fmt.select_mask(s, pattern), fmt.select_mask(w, pattern))
    # With V > 1 select_mask sums the kept scores over a block: squared magnitudes, not |w| (other columns may win).
    np.testing.assert_array_equal(fmt.select_mask(s, "64:2:8"), fmt.select_mask(w.astype(np.float32) ** 2, "64:2:8"))
    # A scaled diagonal Hessian scales the score per input row: ranks like |w| * ||x_k||.
    scale = np.linspace(0.5, 2.0, 64).astype(np.float32)
    s2 = obs.obs_scores(w, 1.0 / scale**2)
    np.testing.assert_allclose(s2, (np.abs(w) * scale[:, None]) ** 2, rtol=1e-5)


def test_bad_inputs_raise():
    x, w = _data(k=16, r=8)
    h = obs.input_hessian(x)
    with pytest.raises(ValueError, match=r"\[\.\.\., K\]"):
        obs.input_hessian(np.ones(5))
    with pytest.raises(ValueError, match="x.shape"):
        obs.input_hessian(x, np.ones(3))
    with pytest.raises(ValueError, match="damp"):
        obs.damp_hessian(h, -1.0)
    with pytest.raises(ValueError, match="square"):
        obs.damp_hessian(np.ones((3, 4)))
    with pytest.raises(ValueError, match="2-D"):
        obs.obs_scores(np.ones(16), np.ones(16))
    with pytest.raises(ValueError, match=r"\[K\]"):
        obs.obs_scores(w, np.ones(15))
    with pytest.raises(ValueError, match="> 0"):
        obs.obs_scores(w, np.zeros(16))
    with pytest.raises(ValueError, match="mask shape"):
        obs.refit(w, np.ones((16, 7), bool), h)
    with pytest.raises(ValueError, match="K = 16"):
        obs.refit(w, np.ones((16, 8), bool), np.eye(15))
    with pytest.raises(ValueError, match="2-D"):
        obs.refit(np.ones(16), np.ones(16, bool), h)
    with pytest.raises(ValueError, match="positive definite"):
        obs.hessian_inverse_diag(np.zeros((4, 4)))


def _tiny_bert(seed=0):
    import jax

    from jaxsparse.models import bert

    cfg = bert.BertConfig.preset("tiny")
    model = bert.BertModel(cfg, add_pooler=False)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(1, 500, size=(4, 12)), jnp.int32)
    types = jnp.zeros_like(ids)
    mask = jnp.asarray(np.arange(12)[None] < np.array([12, 9, 7, 12])[:, None], jnp.int32)
    params = model.init(jax.random.key(seed), ids, types, mask)["params"]
    return model, params, (ids, types, mask)


def test_kernel_stages_and_multi_batch_hessians():
    """Forward order with Q/K/V grouped, at any prefix; H over two batches = H over their concatenation."""
    from jaxsparse.pruning import encoder_kernels

    model, params, (ids, types, mask) = _tiny_bert()
    stages = obs.kernel_stages(params)
    assert stages[0] == [("encoder_layer_0", "attention", q) for q in ("query", "key", "value")]
    assert stages[1:4] == [[("encoder_layer_0", "attention", "output")], [("encoder_layer_0", "intermediate")],
                           [("encoder_layer_0", "output")]] and len(stages) == 8
    nested = obs.kernel_stages({"bert": params})
    assert nested[4] == [("bert", "encoder_layer_1", "attention", q) for q in ("query", "key", "value")]
    whole = obs.input_hessians(model, params, [(ids, types, mask)])
    split = obs.input_hessians(model, params, [(ids[:2], types[:2], mask[:2]), (ids[2:], types[2:], mask[2:])])
    assert set(whole) == set(split) == {p for s in stages for p in s}
    for p in whole:
        np.testing.assert_allclose(split[p], whole[p], rtol=1e-4, atol=1e-5)
    assert whole[stages[0][0]] is whole[stages[0][2]]  # Q/K/V share one input
    with pytest.raises(ValueError, match="not a BERT encoder kernel"):
        obs.kernel_stages({"encoder": {"odd": {"kernel": jnp.zeros((4, 4))}}}, encoder_kernels)


@pytest.mark.parametrize("score", ["activation", "magnitude"])
def test_oneshot_refit_masks_survive_reselection(score):
    """oneshot_refit's kernels obey their masks, and one-shot selection on them picks the same masks."""

    from jaxsparse import pruning

    from flax import traverse_util

    model, params, batch = _tiny_bert()
    new, masks = obs.oneshot_refit(model, params, [batch], "16:2:8", score)
    flat_m = {k: v for k, v in traverse_util.flatten_dict(masks).items() if v is not None}
    flat_w = traverse_util.flatten_dict(new)
    assert len(flat_m) == 12
    for k, m in flat_m.items():
        m, w = np.asarray(m), np.asarray(flat_w[k])
        assert fmt.check_mask(m, "16:2:8") and (w[~m] == 0).all() and (w[m] != 0).all()
    sq = None
    if score == "activation":
        sq = traverse_util.unflatten_dict({k: (jnp.full((m.shape[0],), 3.0) if k in flat_m else None)
                                           for k, m in traverse_util.flatten_dict(masks).items()})
    again = traverse_util.flatten_dict(pruning.oneshot_masks(new, "16:2:8", input_sq=sq))
    assert all(bool((np.asarray(again[k]) == np.asarray(m)).all()) for k, m in flat_m.items())


@pytest.mark.parametrize("pattern, transposable", [("2:4", False), ("16:2:8", False), ("16:2:8", True)])
def test_sparsegpt_mask_with_uncorrelated_inputs_is_the_magnitude_mask(pattern, transposable):
    """With H = I no removed weight has anywhere to go (U = I): every group is chosen on the original weights,
    as select_mask on the squared magnitudes chooses them."""
    _, w = _data(k=32, r=64)
    m = obs.sparsegpt_mask(w, np.eye(32, dtype=np.float32), pattern, damp=0.0, transposable=transposable)
    want = fmt.select_mask(w.astype(np.float32) ** 2, pattern, transposable=transposable)
    np.testing.assert_array_equal(np.asarray(m), np.asarray(want))
    assert fmt.check_mask(np.asarray(m), pattern)


def test_sparsegpt_mask_keeps_the_duplicate_that_takes_over_a_pruned_weight():
    """Input 8 duplicates input 0 (x_8 = x_0). Group 0 of the row keeps its two large weights and prunes w_0; the
    OBS update moves w_0 onto w_8, which group 1 then keeps. The one-shot OBS score instead sees each duplicate as
    free to remove alone and prunes both: after the refit its layer error is larger."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 16)).astype(np.float32)
    x[:, 8] = x[:, 0]
    w = np.zeros((16, 4), np.float32)
    w[:8, 0] = [1.0, 3.0, 3.0, 0.1, 0, 0, 0, 0]          # group 0 (inputs 0-3), group 1 (4-7)
    w[8:, 0] = [0.5, 1.2, 1.2, 0.1, 0, 0, 0, 0]          # group 2 (inputs 8-11) holds the duplicate, group 3
    w[:, 1:] = rng.normal(size=(16, 3)) * 0.1
    h = np.asarray(obs.input_hessian(x))
    damp = 1e-4
    m_gpt = np.asarray(obs.sparsegpt_mask(w, h, "2:4", damp))
    m_obs = np.asarray(fmt.select_mask(obs.mask_score("obs", w, h, damp), "2:4"))
    assert fmt.check_mask(m_gpt, "2:4") and not m_gpt[0, 0] and m_gpt[8, 0]
    assert not m_obs[0, 0] and not m_obs[8, 0]
    err = {name: obs.reconstruction_error(w, obs.refit(w, m, h, damp), h) for name, m in (("gpt", m_gpt), ("obs", m_obs))}
    assert err["gpt"] < 0.8 * err["obs"], err


def test_sparsegpt_mask_bad_inputs_raise():
    _, w = _data(k=32, r=64)
    with pytest.raises(ValueError, match="2-D"):
        obs.sparsegpt_mask(w[0], np.eye(32), "2:4")
    with pytest.raises(ValueError, match=r"\[K, K\]"):
        obs.sparsegpt_mask(w, np.eye(16), "2:4")
    with pytest.raises(ValueError):
        obs.sparsegpt_mask(w, np.eye(32), "16:2:12")  # K = 32 is not a multiple of M = 12

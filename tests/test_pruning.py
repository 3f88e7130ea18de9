"""gmp_prune: the cubic schedule, ladder stages, mask validity, exact zeros, one source of truth."""

from __future__ import annotations

import dataclasses
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsparse import format as fmt
from jaxsparse import pruning
from jaxsparse.nn import NMDense


def _params(seed=0, k=128, r=128):
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        "embeddings": {"embedding": jax.random.normal(keys[0], (50, k))},
        "encoder_layer_0": {"query": {"kernel": jax.random.normal(keys[1], (k, r)), "bias": jnp.zeros(r)},
                            "output": {"kernel": jax.random.normal(keys[2], (r, k)), "bias": jnp.zeros(k)}},
        "classifier": {"kernel": jax.random.normal(keys[3], (k, 4)), "bias": jnp.zeros(4)},
    }


def _cubic(step, s_f, t0, t1):
    """Zhu & Gupta, written out independently of the module."""
    if step >= t1:
        return s_f
    if step <= t0:
        return 0.0
    return s_f + (0.0 - s_f) * (1 - (step - t0) / (t1 - t0)) ** 3


def test_default_and_published_ladders():
    assert [str(s) for s in pruning.default_ladder("128:2:16")] == ["2:4", "128:2:8", "128:2:16"]
    assert [str(s) for s in pruning.default_ladder("64:2:8")] == ["2:4", "64:2:8"]
    assert [str(s) for s in pruning.default_ladder("2:4")] == ["2:4"]
    assert all(s.n == 2 for s in pruning.default_ladder("128:2:32"))
    assert [fmt.VNM.parse(s).n for s in pruning.PUBLISHED_LADDER] == [6, 4, 2]


@pytest.mark.parametrize("t0,t1,freq", [(0, 100, 1), (10, 90, 10), (5, 5, 1)])
def test_schedule_sparsity_at_chosen_steps(t0, t1, freq):
    sched = pruning.GMPSchedule(pruning.default_ladder("128:2:16"), t0, t1, freq)
    s_f = 1 - 2 / 16
    grid = sorted(set(range(t0, t1, freq)) | {t1})
    for step in (0, t0, (t0 + t1) // 2, t1 - 1, t1, t1 + 50):
        assert sched.target_sparsity(step) == pytest.approx(_cubic(step, s_f, t0, t1))
    for spec, start in zip(sched.ladder, sched.stage_steps):
        need = 1 - spec.density
        expected = min(t for t in grid if _cubic(t, s_f, t0, t1) >= need - 1e-9)
        assert start == expected
        assert sched.sparsity_at(start) >= need
    if t0 > 0:
        assert sched.sparsity_at(t0 - 1) == 0.0
    assert sched.sparsity_at(t1) == pytest.approx(s_f)
    assert list(sched.stage_steps) == sorted(sched.stage_steps)


def test_schedule_known_stage_steps():
    # s(t) = 0.875 (1 - (1 - t/100)^3) crosses 0.5 between t = 24 and 25, 0.75 between 47 and 48.
    sched = pruning.GMPSchedule(pruning.default_ladder("128:2:16"), 0, 100)
    assert sched.stage_steps == (25, 48, 100)
    assert [sched.sparsity_at(t) for t in (24, 25, 47, 48, 99, 100)] == [0, 0.5, 0.5, 0.75, 0.75, 0.875]


@pytest.mark.parametrize("kwargs,match", [
    (dict(ladder=("64:2:8", "2:4"), begin_step=0, end_step=10), "strictly decrease"),
    (dict(ladder=("2:4",), begin_step=10, end_step=5), "begin_step <= end_step"),
    (dict(ladder=("2:4",), begin_step=0, end_step=5, frequency=0), "frequency"),
    (dict(ladder=(), begin_step=0, end_step=5), "at least one"),
])
def test_schedule_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pruning.GMPSchedule(**kwargs)


def test_init_rejects_incompatible_layers_and_empty_filter():
    params = _params(k=128, r=96)  # R = 96 is not a multiple of V = 64
    with pytest.raises(ValueError, match="encoder_layer_0/query/kernel.*multiple of V"):
        pruning.gmp_prune("64:2:8").init(params)
    with pytest.raises(ValueError, match="selected no"):
        pruning.gmp_prune("2:4", filter_fn=lambda path, x: False).init(params)
    with pytest.raises(ValueError, match="selected no"):
        pruning.oneshot_masks(params, "2:4", filter_fn=lambda path, x: False)
    # a transposable V:2:M mask needs V % 4 == 0 (4 rows sharing their columns): said at init, with the layer's name
    with pytest.raises(ValueError, match="encoder_layer_0/output/kernel.*V to be a multiple of 4"):
        pruning.gmp_prune("2:2:8", transposable=True).init(params)
    tx = pruning.gmp_prune("2:4")
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state)


def test_default_filter_selects_encoder_kernels_only():
    masks = pruning.gmp_prune("2:4").init(_params()).masks
    assert masks["embeddings"]["embedding"] is None and masks["classifier"]["kernel"] is None
    assert masks["encoder_layer_0"]["query"]["bias"] is None
    assert masks["encoder_layer_0"]["query"]["kernel"].shape == (128, 128)


@pytest.mark.parametrize("ladder", ["128:2:16", pruning.PUBLISHED_LADDER])
def test_ladder_run_masks_valid_zeros_exact_and_changes_only_at_stage_steps(ladder):
    params = _params()
    prune = pruning.gmp_prune(ladder, begin_step=2, end_step=12, frequency=2)
    sched = prune.schedule
    tx = optax.chain(optax.adamw(0.05, weight_decay=0.1), prune)  # momentum + decay try to revive weights
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    prev = pruning.masks_of(state)
    seen = set()
    for step in range(16):
        grads = jax.tree_util.tree_map(lambda p: jax.random.normal(jax.random.key(step), p.shape), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        masks = pruning.masks_of(state)
        stage = sched.stage_at(step)
        assert int(pruning.find_state(state).stage) == stage
        changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(prev), jax.tree_util.tree_leaves(masks)))
        assert changed == (step in sched.stage_steps), f"step {step}: mask changed={changed}"
        if stage:
            spec = sched.ladder[stage - 1]
            seen.add(str(spec))
            for name in ("query", "output"):
                m = np.asarray(masks["encoder_layer_0"][name]["kernel"])
                k = np.asarray(params["encoder_layer_0"][name]["kernel"])
                assert fmt.check_mask(m, spec)
                assert m.mean() == pytest.approx(spec.density)
                assert (k[~m] == 0).all(), "pruned weights must be exactly zero"
            assert pruning.sparsity_of(params, masks) >= 1 - spec.density
        # unpruned leaves move freely
        assert np.count_nonzero(np.asarray(params["classifier"]["kernel"])) == params["classifier"]["kernel"].size
        prev = masks
    assert seen == {str(s) for s in sched.ladder}


def test_oneshot_and_model_reads_the_optimizer_masks():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(NMDense(128, sparsity="2:4", name="encoder_in")(x))
            return nn.Dense(3, name="classifier")(h)

    net = Net()
    x = jax.random.normal(jax.random.key(0), (8, 64))
    params = net.init(jax.random.key(1), x)["params"]
    tx = optax.chain(optax.sgd(0.1), pruning.gmp_prune(["2:4"], 0, 0))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: net.apply(pruning.model_variables(p, state), x).sum())(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = step(params, state)
    mask = pruning.masks_of(state)["encoder_in"]["kernel"]
    assert fmt.check_mask(mask, "2:4") and int(pruning.find_state(state).stage) == 1
    variables = pruning.model_variables(params, state)
    assert variables["sparsity"]["encoder_in"]["mask"] is mask  # the model's mask *is* the optimizer's
    assert "classifier" not in variables["sparsity"]
    kernel = params["encoder_in"]["kernel"]
    np.testing.assert_array_equal(np.asarray(kernel)[~np.asarray(mask)], 0)
    # a mask that disagrees with the weights shows in the output: the model really applies the state's mask
    other = fmt.select_mask(jax.random.normal(jax.random.key(5), kernel.shape), "2:4")
    h = jax.nn.relu(x @ jnp.where(other, kernel, 0) + params["encoder_in"]["bias"])
    expected = h @ params["classifier"]["kernel"] + params["classifier"]["bias"]
    got = net.apply(pruning.model_variables(params, masks={"encoder_in": {"kernel": other, "bias": None},
                                                           "classifier": {"kernel": None, "bias": None}}), x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    masks_direct = pruning.oneshot_masks(params, "2:4", pruning.path_filter(include=()))
    assert masks_direct["classifier"]["kernel"] is None  # excluded by name


def test_to_compressed_converts_params_and_adam_moments():
    class Net(nn.Module):
        compressed: bool = False

        @nn.compact
        def __call__(self, x):
            return NMDense(64, sparsity="16:2:8", compressed=self.compressed, name="encoder_in")(x)

    x = jax.random.normal(jax.random.key(0), (8, 64))
    params = Net().init(jax.random.key(1), x)["params"]
    base = optax.adam(1e-2)
    tx = optax.chain(base, pruning.gmp_prune("16:2:8", 0, 0))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: (Net().apply(pruning.model_variables(p, state), x) ** 2).sum())(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        params, state = step(params, state)
    masks = pruning.masks_of(state)
    c_params, pattern, c_state = pruning.to_compressed(params, masks, "16:2:8", state[0])
    y_master = Net().apply(pruning.model_variables(params, state), x)
    y_c = Net(compressed=True).apply({"params": c_params, "sparsity": pattern}, x)
    np.testing.assert_allclose(y_c, y_master, rtol=1e-5, atol=1e-5)
    mu = c_state[0].mu["encoder_in"]
    assert set(mu) == {"values", "bias"} and mu["values"].shape == c_params["encoder_in"]["values"].shape
    sw = fmt.compress(params["encoder_in"]["kernel"], masks["encoder_in"]["kernel"], "16:2:8")
    np.testing.assert_allclose(mu["values"], fmt.compress_like(state[0][0].mu["encoder_in"]["kernel"], sw))
    # the same optimizer continues on the compressed tree
    g = jax.grad(lambda p: (Net(compressed=True).apply({"params": p, "sparsity": pattern}, x) ** 2).sum())(c_params)
    updates, _ = base.update(g, c_state, c_params)
    assert updates["encoder_in"]["values"].shape == c_params["encoder_in"]["values"].shape


def test_fade_shrinks_the_next_stage_pruned_weights_then_cuts_them():
    params = _params(3)
    tx = pruning.gmp_prune(["2:4", "64:2:8"], 0, 20, frequency=1, fade_steps=4)
    entries = tx.schedule.stage_steps
    assert entries[1] - entries[0] > 4  # two separate fade windows
    jitted = jax.jit(tx.update)
    state = tx.init(params)
    w0 = params["encoder_layer_0"]["query"]["kernel"]
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    history = []
    for step in range(entries[1] + 1):
        updates, state = jitted(zero, state, params)
        params = optax.apply_updates(params, updates)
        history.append((np.asarray(params["encoder_layer_0"]["query"]["kernel"]),
                        np.asarray(state.target["encoder_layer_0"]["query"]["kernel"]),
                        np.asarray(state.masks["encoder_layer_0"]["query"]["kernel"])))
    e = entries[1]
    before, _, _ = history[e - 5]  # the last step before the fade window: nothing scaled yet
    np.testing.assert_array_equal(before != 0, np.asarray(fmt.select_mask(w0, fmt.VNM.parse("2:4"))))
    _, target, _ = history[e - 4]  # the window's first update chose the 64:2:8 target
    assert fmt.check_mask(target, "64:2:8")
    np.testing.assert_array_equal(target, np.asarray(fmt.select_mask(jnp.asarray(before), fmt.VNM.parse("64:2:8"))))
    fading = (before != 0) & ~target
    for k, (w, t, _) in enumerate(history[e - 4:e]):  # linear decay over the window: 4/5, 3/5, 2/5, 1/5
        np.testing.assert_array_equal(t, target)
        np.testing.assert_allclose(w[fading], before[fading] * (4 - k) / 5, rtol=1e-6)
        np.testing.assert_array_equal(w[target], before[target])  # kept weights untouched
    final, _, mask = history[e]
    np.testing.assert_array_equal(mask, target)  # the stage keeps exactly the faded-in target
    assert not final[~mask].any()
    assert pruning.gmp_prune("2:4", 0, 10).init(_params()).target == ()
    with pytest.raises(ValueError, match="fade_steps"):
        pruning.gmp_prune("2:4", 0, 10, fade_steps=-1)


def test_activation_score_follows_the_input_norms():
    """score="activation": |W_jr| * ||X_j||: inputs that never fire lose their weights whatever |W| is."""
    params = _params(4)
    tx = pruning.gmp_prune("2:4", 0, 0, score="activation")
    state = tx.init(params)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    with pytest.raises(ValueError, match="needs input_sq"):
        tx.update(zero, state, params)
    k = params["encoder_layer_0"]["query"]["kernel"].shape[0]
    silent = jnp.tile(jnp.array([0.0, 0.0, 1.0, 4.0]), k // 4)  # features 0, 1 of every group never fire
    input_sq = jax.tree_util.tree_map_with_path(
        lambda path, x: silent if pruning._path_names(path)[-1] == "kernel" and x.ndim == 2 else None, params)
    _, state = jax.jit(tx.update)(zero, state, params, input_sq=input_sq)
    for name in ("query", "output"):
        mask = np.asarray(state.masks["encoder_layer_0"][name]["kernel"])
        assert fmt.check_mask(mask, "2:4")
        np.testing.assert_array_equal(mask, np.tile(np.array([False, False, True, True]), k // 4)[:, None]
                                      .repeat(mask.shape[1], 1))
    with pytest.raises(ValueError, match="score"):
        pruning.gmp_prune("2:4", score="hessian")


def test_input_norms_tree_maps_layer_stats_to_kernels():
    layer = NMDense(8, sparsity="2:4")
    x = jax.random.normal(jax.random.key(0), (3, 5, 16))
    variables = layer.init(jax.random.key(1), x)
    assert "input_stats" not in variables  # nothing recorded at init
    _, stats = layer.apply(variables, x, mutable=["input_stats"])
    np.testing.assert_allclose(stats["input_stats"]["sq"], np.sum(np.asarray(x) ** 2, axis=(0, 1)), rtol=1e-5)
    tree = pruning.input_norms_tree({"dense": stats["input_stats"]}, {"dense": variables["params"]})
    assert tree["dense"]["bias"] is None and tree["dense"]["kernel"].shape == (16,)


def test_learned_masks_train_pruned_weights_reselect_on_schedule_then_fix_them():
    """regrow_every: in the window the pruned weights take their update minus the decay (not -param), masks are
    chosen again only every regrow_every steps and at regrow_until, where the pruned weights become exactly 0."""
    params = _params(1)
    decay = 0.25
    tx = pruning.gmp_prune("2:4", 0, 0, regrow_every=3, regrow_until=7, regrow_decay=decay)
    assert tx.regrow and tx.final_step == 7
    assert not pruning.gmp_prune("2:4", 0, 5).regrow and pruning.gmp_prune("2:4", 0, 5).final_step == 5
    state = tx.init(params)
    kernel = ("encoder_layer_0", "query", "kernel")
    get = lambda tree: tree[kernel[0]][kernel[1]][kernel[2]]  # noqa: E731
    rng = np.random.default_rng(0)
    p, history, pushed = params, [], None
    for step in range(10):
        u = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(0, 1e-3, x.shape), x.dtype), p)
        if step == 1:  # push one pruned weight far above every other weight of its group
            m0 = np.asarray(get(pruning.masks_of(state)))
            pushed = tuple(np.argwhere(~m0)[0])
            big = np.zeros(m0.shape, np.float32)
            big[pushed] = 100.0
            u[kernel[0]][kernel[1]][kernel[2]] = get(u) + big
        new_u, state = tx.update(u, state, p)
        m = np.asarray(get(pruning.masks_of(state)))
        assert fmt.check_mask(m, "2:4")
        pw, uw, nw = (np.asarray(get(t)) for t in (p, u, new_u))
        if step < 7:  # the window: pruned weights train and decay
            np.testing.assert_allclose(nw[~m], (uw - decay * pw)[~m], rtol=1e-6, atol=1e-7)
        else:  # from the final step on: exact zeros
            np.testing.assert_array_equal((pw + nw)[~m], 0.0)
        np.testing.assert_array_equal(nw[m], uw[m])
        p = optax.apply_updates(p, new_u)
        history.append(m)
    changes = [i for i in range(1, 10) if not np.array_equal(history[i], history[i - 1])]
    assert set(changes) <= {3, 6, 7} and 3 in changes  # the pushed weight comes back at the first reselection
    assert not history[1][pushed] and history[3][pushed]
    assert (np.asarray(get(p))[~history[-1]] == 0).all()
    assert 0.0 < pruning.mask_change({"k": history[0]}, {"k": history[-1]}) < 1.0
    assert pruning.mask_change({"k": history[0]}, {"k": history[0]}) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(regrow_every=-1), "regrow_every"),
    (dict(regrow_every=2), "regrow_until"),
    (dict(regrow_every=2, regrow_until=5), "regrow_until"),
    (dict(regrow_every=2, regrow_until=20, regrow_decay=1.0), "regrow_decay"),
])
def test_learned_masks_reject_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pruning.gmp_prune("2:4", 0, 10, **kwargs)


def test_straight_through_reads_the_mask_and_passes_the_gradient():
    params = _params(2)
    masks = pruning.oneshot_masks(params, "2:4")
    q = params["encoder_layer_0"]["query"]["kernel"]
    m = masks["encoder_layer_0"]["query"]["kernel"]
    st = pruning.straight_through(params, masks)
    np.testing.assert_array_equal(st["encoder_layer_0"]["query"]["kernel"], jnp.where(m, q, 0.0))
    np.testing.assert_array_equal(st["classifier"]["kernel"], params["classifier"]["kernel"])  # no mask there
    w = jax.random.normal(jax.random.key(5), q.shape)
    grad = jax.grad(lambda p: jnp.sum(w * pruning.straight_through(p, masks)["encoder_layer_0"]["query"]["kernel"]))
    g = grad(params)["encoder_layer_0"]["query"]["kernel"]
    np.testing.assert_array_equal(g, w)  # dense: the pruned entries get theirs too (a mask product would give w * m)
    assert not bool(m.all())


def test_transposable_masks_through_the_transforms():
    """``transposable`` reaches the masks of the 2-per-group stages: one-shot and the GMP transform's final stage give
    transposable masks (and the same masks as ``select_mask``), its N > 2 stages plain ones."""
    params = _params(3)
    q = params["encoder_layer_0"]["query"]["kernel"]
    one = pruning.oneshot_masks(params, "2:4", transposable=True)["encoder_layer_0"]["query"]["kernel"]
    np.testing.assert_array_equal(one, fmt.select_mask(q, "2:4", transposable=True))
    assert bool(fmt.transposable_mask_is_valid(one))
    plain = pruning.oneshot_masks(params, "2:4")["encoder_layer_0"]["query"]["kernel"]
    assert not bool(fmt.transposable_mask_is_valid(plain))
    tx = pruning.gmp_prune(["64:6:8", "64:2:8"], 0, 2, transposable=True)
    state = tx.init(params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    for _ in range(3):
        _, state = tx.update(zeros, state, params)
    m = state.masks["encoder_layer_0"]["query"]["kernel"]
    assert bool(fmt.check_mask(m, "64:2:8")) and bool(fmt.transposable_mask_is_valid(m))


def test_exclusive_columns_through_the_transforms():
    """``exclusive_columns`` reaches the V:2:M stages with M > 4: one-shot and the GMP transform's final stage give
    column-capped masks (the same as ``select_mask``'s), its 2:4 stage a plain one."""
    params = _params(4, k=128, r=512)
    q = params["encoder_layer_0"]["query"]["kernel"]
    one = pruning.oneshot_masks(params, "64:2:8", exclusive_columns=True)
    np.testing.assert_array_equal(one["encoder_layer_0"]["query"]["kernel"],
                                  fmt.select_mask(q, "64:2:8", exclusive_columns=True))
    for m in (one["encoder_layer_0"]["query"]["kernel"], one["encoder_layer_0"]["output"]["kernel"]):
        assert bool(fmt.columns_are_exclusive(m, "64:2:8"))
    plain = pruning.oneshot_masks(params, "64:2:8")["encoder_layer_0"]["query"]["kernel"]
    assert not bool(fmt.columns_are_exclusive(plain, "64:2:8"))
    np.testing.assert_array_equal(pruning.oneshot_masks(params, "2:4", exclusive_columns=True)["encoder_layer_0"]
                                  ["query"]["kernel"], fmt.select_mask(q, "2:4"))  # no cap at M = 4
    tx = pruning.gmp_prune(["2:4", "64:2:8"], 0, 2, exclusive_columns=True, transposable=True)
    state = tx.init(params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    for _ in range(3):
        _, state = tx.update(zeros, state, params)
    m = state.masks["encoder_layer_0"]["query"]["kernel"]
    assert bool(fmt.check_mask(m, "64:2:8")) and bool(fmt.columns_are_exclusive(m, "64:2:8"))
    assert bool(fmt.transposable_mask_is_valid(m))


def test_diagonal_ffn_out_through_the_transforms_and_to_compressed():
    """``diagonal_fn`` gives the FFN out kernels diagonal 2:4 blocks (one-shot and the GMP transform's learned masks),
    the other kernels their V:2:M masks; ``to_compressed`` relabels the hidden units and stores the stacked blocks,
    and the compressed model computes what the masked master model computed."""
    from jaxsparse.models import bert

    spec = "64:2:8"
    cfg = bert.BertConfig.preset("tiny", diagonal_ffn_out=True, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    master = bert.BertForSequenceClassification(cfg, sparsity=spec, num_labels=3)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 1000)
    args = (ids, jnp.zeros_like(ids), jnp.ones_like(ids))
    params = master.init(jax.random.PRNGKey(0), *args)["params"]
    masks = pruning.oneshot_masks(params, spec, transposable=True, diagonal_fn=pruning.ffn_out_kernels)
    layer = masks["bert"]["encoder_layer_0"]
    out, inter = np.asarray(layer["output"]["kernel"]), np.asarray(layer["intermediate"]["kernel"])
    sets = np.asarray(fmt.diagonal_sets(out, 2, chunk=64))  # raises unless block-diagonal in chunks of V = 64
    assert out.mean() == 0.25 and bool(fmt.check_mask(inter, spec)) and not bool(fmt.check_mask(out, spec))
    tx = pruning.gmp_prune([spec], 0, 0, transposable=True, diagonal_fn=pruning.ffn_out_kernels, regrow_every=1,
                           regrow_until=2)
    state = tx.init(params)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    for _ in range(3):
        _, state = jax.jit(tx.update)(zeros, state, params)
    np.testing.assert_array_equal(state.masks["bert"]["encoder_layer_0"]["output"]["kernel"], out)

    y_master = master.apply(pruning.model_variables(params, masks=masks), *args)
    opt = optax.adam(1e-3).init(params)
    c_params, pattern, c_state = pruning.to_compressed(params, masks, spec, opt, diagonal_fn=pruning.ffn_out_kernels)
    c_out = c_params["bert"]["encoder_layer_0"]["output"]
    assert "kernel" not in c_out and c_out["values"].shape == (128, 512 // 2 // 2)
    assert "columns" not in pattern["bert"]["encoder_layer_0"]["output"]
    perm = sets.reshape(-1)
    np.testing.assert_array_equal(c_params["bert"]["encoder_layer_0"]["intermediate"]["bias"],
                                  params["bert"]["encoder_layer_0"]["intermediate"]["bias"][perm])
    compressed = bert.BertForSequenceClassification(cfg, sparsity=spec, compressed=True, num_labels=3)
    y = compressed.apply({"params": c_params, "sparsity": pattern}, *args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_master), atol=1e-5)
    shapes = lambda t: [a.shape for a in jax.tree_util.tree_leaves(t)]  # noqa: E731
    assert shapes(c_state[0].mu) == shapes(c_params) and shapes(c_state[0].nu) == shapes(c_params)
    with pytest.raises(ValueError, match="params-shaped"):
        pruning.to_compressed(params, pruning.sparsity_collection(masks), spec, diagonal_fn=pruning.ffn_out_kernels)


@pytest.mark.parametrize("diagonal_fn,field", [(pruning.encoder_kernels, "diagonal_all"),
                                               (pruning.ffn_kernels, "diagonal_ffn")])
def test_chunked_diagonal_to_compressed_keeps_the_inputs_and_stores_chunk_tables(diagonal_fn, field):
    """``diagonal_fn`` with ``diagonal_chunks``: every kernel it selects (every encoder kernel, or the FFN's two)
    gets diagonal 2:4 blocks in 64-feature chunks; ``to_compressed`` stores each as its stacked blocks with its chunk
    table (nothing relabelled; the other kernels stay V:2:M with their column sets), and the compressed model
    (``BertConfig.diagonal_all`` / ``diagonal_ffn``) computes what the masked master model did."""
    from jaxsparse.models import bert

    spec = "64:2:8"
    cfg = bert.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    master = bert.BertForSequenceClassification(cfg, sparsity=spec, num_labels=3)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 1000)
    args = (ids, jnp.zeros_like(ids), jnp.ones_like(ids))
    params = master.init(jax.random.PRNGKey(0), *args)["params"]
    masks = pruning.oneshot_masks(params, spec, transposable=True, diagonal_fn=diagonal_fn)
    y_master = master.apply(pruning.model_variables(params, masks=masks), *args)
    opt = optax.adam(1e-3).init(params)
    c_params, pattern, c_state = pruning.to_compressed(params, masks, spec, opt, diagonal_fn=diagonal_fn,
                                                       diagonal_chunks=True)
    layer, sparsity = c_params["bert"]["encoder_layer_0"], pattern["bert"]["encoder_layer_0"]
    assert layer["output"]["values"].shape == (128, 512 // 2 // 2)
    assert layer["intermediate"]["values"].shape == (512, 128 // 2 // 2)
    np.testing.assert_array_equal(layer["intermediate"]["bias"],
                                  params["bert"]["encoder_layer_0"]["intermediate"]["bias"])
    table = np.asarray(sparsity["intermediate"]["chunks"])
    assert table.shape == (2, 1) and sorted(table.ravel()) == [0, 1] and "columns" not in sparsity["output"]
    query = sparsity["attention"]["query"]
    assert ("chunks" in query) == (field == "diagonal_all") and ("columns" in query) == (field == "diagonal_ffn")
    compressed = bert.BertForSequenceClassification(dataclasses.replace(cfg, **{field: True}), sparsity=spec,
                                                    compressed=True, num_labels=3)
    y = compressed.apply({"params": c_params, "sparsity": pattern}, *args)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_master), atol=1e-5)
    shapes = lambda t: [a.shape for a in jax.tree_util.tree_leaves(t)]  # noqa: E731
    assert shapes(c_state[0].mu) == shapes(c_params) and shapes(c_state[0].nu) == shapes(c_params)
    with pytest.raises(ValueError, match="give diagonal_fn"):
        pruning.to_compressed(params, masks, spec, diagonal_chunks=True)

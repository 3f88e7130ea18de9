"""Data-parallel training (jaxsparse.parallel) on 2 host devices.

The device count of the CPU platform is fixed when JAX starts, so the multi-device work runs once in a
subprocess (this file run as a script with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``);
it prints one JSON report and the tests below check it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TOL = dict(rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------------------------- worker
def _worker() -> dict:
    import jax
    import numpy as np
    import optax

    from jaxsparse import parallel, pruning, train
    from jaxsparse.models import bert

    jax.config.update("jax_default_matmul_precision", "highest")
    out: dict = {"devices": jax.device_count()}
    cfg = bert.BertConfig.preset("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=512)
    spec = "64:2:8"
    rng = np.random.default_rng(0)
    b, t = 8, 16
    ids = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[::3, 10:] = 0
    batch = (ids, np.zeros_like(ids), mask, rng.integers(0, 2, (b,)).astype(np.int32))
    key = jax.random.key(1, impl="rbg")
    mesh = parallel.local_mesh(2)

    master = bert.BertForSequenceClassification(cfg, sparsity=spec, num_labels=2)
    params0 = master.init(jax.random.key(0), ids[:1])["params"]
    tx_sgd = optax.sgd(0.05, momentum=0.9)  # scale-sensitive: a wrong gradient average changes the update

    def max_rel(a, b_, p0):
        """Largest parameter difference over the largest reference update (all leaves)."""
        leaves = lambda t: [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]  # noqa: E731
        err = max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b_)))
        upd = max(float(np.max(np.abs(x - z))) for x, z in zip(leaves(a), leaves(p0)))
        return err / upd

    def close(a, b_):
        return all(np.allclose(np.asarray(x), np.asarray(y), **TOL)
                   for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b_)))

    def run(step, params, state, extra, data, n=2):
        losses = []
        for _ in range(n):
            params, state, loss = step(params, state, extra, data, key)
            losses.append(float(loss))
        return params, state, losses

    # master mode, one-shot gmp mask set by the first update and read from opt_state by the second step
    tx = optax.chain(tx_sgd, pruning.gmp_prune([spec], 0, 0))
    state0 = tx.init(params0)
    single = run(train.make_step(master, tx, True), params0, state0, {}, batch)
    dp = run(train.make_step(master, tx, True, mesh), params0, state0, {}, batch)
    half = run(train.make_step(master, tx, True), params0, state0, {}, tuple(a[: b // 2] for a in batch))
    masks_s, masks_d = pruning.masks_of(single[1]), pruning.masks_of(dp[1])
    out["master"] = {
        "close": close(single[0], dp[0]), "max_rel": max_rel(single[0], dp[0], params0),
        "loss_single": single[2], "loss_dp": dp[2],
        "masks_equal": all(bool(np.array_equal(x, y)) for x, y in
                           zip(jax.tree_util.tree_leaves(masks_s), jax.tree_util.tree_leaves(masks_d))),
        "masked_zero": bool((np.asarray(dp[0]["bert"]["encoder_layer_0"]["intermediate"]["kernel"])
                             [~np.asarray(masks_d["bert"]["encoder_layer_0"]["intermediate"]["kernel"])] == 0).all()),
        "control_close": close(single[0], half[0]), "control_max_rel": max_rel(single[0], half[0], params0),
    }

    # the activation-weighted mask score: each device's input statistics are averaged before selection,
    # so the data-parallel masks are the full batch's
    tx_act = optax.chain(tx_sgd, pruning.gmp_prune([spec], 0, 0, score="activation"))
    act_s = run(train.make_step(master, tx_act, True, mask_score="activation"), params0, tx_act.init(params0), {}, batch)
    act_d = run(train.make_step(master, tx_act, True, mesh, mask_score="activation"), params0, tx_act.init(params0),
                {}, batch)
    out["activation"] = {
        "close": close(act_s[0], act_d[0]),
        "masks_equal": all(bool(np.array_equal(x, y)) for x, y in zip(
            jax.tree_util.tree_leaves(pruning.masks_of(act_s[1])), jax.tree_util.tree_leaves(pruning.masks_of(act_d[1])))),
    }

    # compressed mode: values are the trainable params, the pattern is replicated in "sparsity"
    masks = pruning.oneshot_masks(params0, spec)
    c_params, pattern = pruning.to_compressed(params0, masks, spec)
    comp = bert.BertForSequenceClassification(cfg, sparsity=spec, compressed=True, num_labels=2)
    c_state0 = tx_sgd.init(c_params)
    extra = {pruning.SPARSITY: pattern}
    single = run(train.make_step(comp, tx_sgd, False), c_params, c_state0, extra, batch)
    dp_step = train.make_step(comp, tx_sgd, False, mesh)
    dp = run(dp_step, c_params, c_state0, extra, batch)
    out["compressed"] = {"close": close(single[0], dp[0]), "max_rel": max_rel(single[0], dp[0], c_params),
                         "loss_single": single[2], "loss_dp": dp[2]}

    # the constant arguments placed on the mesh once: every leaf on both devices, the same steps
    placed = parallel.replicate(extra, mesh)
    leaves = jax.tree_util.tree_leaves(placed)
    dp_placed = run(dp_step, c_params, c_state0, placed, batch)
    import warnings

    def warnings_of(extra_arg):  # a fresh data-parallel step, two calls
        step = train.make_step(comp, tx_sgd, False, mesh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(step, c_params, c_state0, extra_arg, batch)
        return [str(w.message) for w in caught if "data_parallel" in str(w.message)]

    out["replicate"] = {
        "warned_unplaced": warnings_of(extra),
        "warned_placed": warnings_of(placed),
        "leaves": len(leaves),
        "on_every_device": all(x.sharding.is_fully_replicated and x.sharding.device_set == set(mesh.devices.flat)
                               for x in leaves),
        "original_on_one_device": all(len(x.sharding.device_set) == 1 for x in jax.tree_util.tree_leaves(extra)),
        "same_steps": close(dp[0], dp_placed[0]) and dp[2] == dp_placed[2],
    }

    # the collectives of the compiled step: result shapes of every all-reduce
    def allreduce_shapes(step, *args):
        hlo = step.lower(*args).compile().as_text()
        shapes = []
        for line in hlo.splitlines():
            m = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
            if m:
                shapes += re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        return [[d, [int(s) for s in dims.split(",") if s]] for d, dims in shapes]

    out["hlo_compressed"] = allreduce_shapes(dp_step, c_params, c_state0, extra, batch, key)
    out["hlo_master"] = allreduce_shapes(train.make_step(master, tx, True, mesh), params0, state0, {}, batch, key)
    out["grad_shapes_compressed"] = [list(x.shape) for x in jax.tree_util.tree_leaves(c_params)]
    out["grad_shapes_master"] = [list(x.shape) for x in jax.tree_util.tree_leaves(params0)]
    out["exchanged_compressed"] = parallel.exchanged_bytes(c_params)

    # errors
    errors = {}
    try:
        dp_step(c_params, c_state0, extra, tuple(a[:7] for a in batch), key)
    except ValueError as e:
        errors["batch"] = str(e)
    try:
        parallel.local_mesh(3)
    except ValueError as e:
        errors["mesh"] = str(e)
    out["errors"] = errors
    return out


# --------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def report() -> dict:
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_devices_are_seen(report):
    assert report["devices"] == 2


def test_master_mode_with_gmp_mask_matches_the_full_batch_step(report):
    r = report["master"]
    assert r["close"] and r["max_rel"] < 1e-3, r
    assert r["masks_equal"] and r["masked_zero"]
    assert r["loss_dp"] == pytest.approx(r["loss_single"], rel=1e-5)
    # the tolerance can tell a half batch (one device's gradient alone) from the averaged one
    assert not r["control_close"] and r["control_max_rel"] > 0.05, r


def test_activation_score_masks_match_the_full_batch_step(report):
    assert report["activation"]["masks_equal"] and report["activation"]["close"], report["activation"]


def test_compressed_mode_matches_the_full_batch_step(report):
    r = report["compressed"]
    assert r["close"] and r["max_rel"] < 1e-3, r
    assert r["loss_dp"] == pytest.approx(r["loss_single"], rel=1e-5)


def test_replicate_puts_the_constant_arguments_on_every_device_once(report):
    r = report["replicate"]
    assert r["leaves"] > 0 and r["on_every_device"] and r["original_on_one_device"], r
    assert r["same_steps"], r
    # a step given the pattern off the mesh says so once (argument 2, the "extra" collections), one given it placed not
    assert len(r["warned_unplaced"]) == 1 and "argument 2 has" in r["warned_unplaced"][0], r["warned_unplaced"]
    assert "parallel.replicate" in r["warned_unplaced"][0]
    assert r["warned_placed"] == [], r["warned_placed"]


def _multiset(shapes):
    return sorted(tuple(s) for s in shapes)


def test_compressed_allreduce_carries_the_values_not_the_dense_kernels(report):
    f32 = [s for d, s in report["hlo_compressed"] if d == "f32"]
    # one operand per gradient leaf plus the scalar loss: the values [R, 2K/8], never a [K, R] kernel
    assert _multiset(f32) == _multiset(report["grad_shapes_compressed"] + [[]])
    master_f32 = [s for d, s in report["hlo_master"] if d == "f32"]
    assert _multiset(master_f32) == _multiset(report["grad_shapes_master"] + [[]])
    # the FFN kernels [128, 512] and [512, 128] of the 2 layers: exchanged in master mode, not compressed
    # ([512, 128] is also the shape of the word and position embeddings, which stay dense in both)
    assert master_f32.count([128, 512]) == 2 and f32.count([128, 512]) == 0
    assert master_f32.count([512, 128]) == f32.count([512, 128]) + 2
    # compressed: values [R, 2K/8] of q, k, v, out ([128, 32]), FFN in ([512, 32]) and FFN out ([128, 128])
    assert f32.count([128, 32]) == 8 and f32.count([512, 32]) == 2 and f32.count([128, 128]) == 2
    assert master_f32.count([128, 128]) == 8 and master_f32.count([128, 32]) == 0  # dense q, k, v, out kernels
    n_bytes = sum(4 * int(np.prod(s)) for s in f32)
    assert n_bytes - 4 == report["exchanged_compressed"]["total"]  # exchanged_bytes = the HLO payload, less the loss


def test_exchanged_bytes_64_2_8_is_a_quarter_for_the_sparse_layers():
    from jaxsparse import parallel
    from jaxsparse.models import bert

    rep = parallel.bert_exchanged_bytes("tiny", "64:2:8")
    m, c = rep["master"], rep["compressed"]
    h = bert.BertConfig.preset("tiny").hidden_size
    layers = bert.BertConfig.preset("tiny").num_hidden_layers
    shapes = [(h, h)] * 4 + [(h, 4 * h), (4 * h, h)]  # q, k, v, attention out, FFN in, FFN out: (K, R)
    expect_c = layers * 4 * sum(r * 2 * k // 8 + r for k, r in shapes)  # values + bias, float32
    expect_m = layers * 4 * sum(k * r + r for k, r in shapes)
    assert (c["sparse_layers"], m["sparse_layers"]) == (expect_c, expect_m)
    assert 0.25 <= c["sparse_layers"] / m["sparse_layers"] <= 0.27
    assert c["compressed"] == layers * 4 * sum(r * 2 * k // 8 for k, r in shapes) and m["compressed"] == 0
    assert c["total"] - c["sparse_layers"] == m["total"] - m["sparse_layers"]  # the rest is unchanged


def test_batch_not_divisible_by_the_devices_is_a_clear_error(report):
    assert "batch size 7" in report["errors"]["batch"] and "not divisible by the 2 devices" in report["errors"]["batch"]
    assert "asked for 3 devices" in report["errors"]["mesh"]


def test_cli_devices_option():
    from jaxsparse import train

    assert train.parse_args([]).devices == 1
    assert train.parse_args(["--devices", "all"]).devices == "all"
    assert train.parse_args(["--devices", "4"]).devices == 4
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            train.parse_args(["--devices", bad])


if __name__ == "__main__":
    print(json.dumps(_worker()))

